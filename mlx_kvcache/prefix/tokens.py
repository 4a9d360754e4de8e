"""Token sequences as read-only int64 numpy arrays.

The hit path of a 64k-token prompt must not do per-token Python work: the trie's edges,
a live set's tokens and the prompts the manager plans for are numpy arrays, so matching
an edge, finding a common prefix or slicing costs O(1) Python operations and O(bytes)
work in C. Three shapes:

* `as_tokens` — any token sequence as a 1-D read-only int64 array (zero-copy for ours);
* `Tokens` — a trie edge: reads like a tuple of ints (``len``, indexing, iteration and
  ``==`` against lists all work, ints come out as Python ints), ``np.asarray`` gives the
  array itself;
* `TokenBuffer` — an append-only log of the tokens a request's caches absorbed; views of
  what was appended never change afterwards, so the manager may keep them.

Read-only matters: a view of a prompt is shared by the request, its live set and the
trie's bookkeeping, and no holder may change what the others see.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Union

import numpy as np

__all__ = ["as_tokens", "common_prefix", "join", "Tokens", "TokenBuffer"]

DTYPE = np.int64


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def as_tokens(seq: Any) -> np.ndarray:
    """``seq`` as a 1-D read-only int64 array.

    An array that is already one (ours) is returned as it is; anything else — a list, a
    caller's writable array, an ``mx.array`` — is copied, so a later change by the caller
    cannot reach what the trie holds. Values are converted as ``int`` would.
    """
    if isinstance(seq, np.ndarray):
        if seq.dtype == DTYPE and seq.ndim == 1 and not seq.flags.writeable:
            return seq
        a = np.array(seq, dtype=DTYPE)
    elif isinstance(seq, (Tokens, TokenBuffer)):
        return seq.array
    elif isinstance(seq, (list, tuple, range)):
        a = np.fromiter(seq, dtype=DTYPE, count=len(seq))
    else:  # mx.array and other array-likes
        a = np.array(seq, dtype=DTYPE)
    if a.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {a.shape}")
    return _frozen(a)


def join(*parts: Any) -> np.ndarray:
    """The concatenation of token sequences, as a new read-only array."""
    return _frozen(np.concatenate([as_tokens(p) for p in parts]))


def common_prefix(a: Any, b: Any) -> int:
    """How many leading tokens ``a`` and ``b`` share (vectorised)."""
    a, b = as_tokens(a), as_tokens(b)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    i = int(differ.argmax())
    return i if differ[i] else n


class Tokens(Sequence):
    """An immutable token sequence (a trie edge) backed by a read-only int64 array.

    Reads like a tuple of ints: ``len``, indexing (Python ints), slicing (a `Tokens`),
    iteration, ``list(t)``, ``t == [1, 2]``; ``np.asarray(t)`` is the array, no copy.
    """

    __slots__ = ("_a",)

    def __init__(self, seq: Any = ()) -> None:
        self._a = as_tokens(seq)

    @classmethod
    def copy_of(cls, seq: Any) -> "Tokens":
        """A `Tokens` over its own copy of ``seq`` (shares no memory with it)."""
        a = as_tokens(seq)
        return cls._wrap(a if isinstance(seq, (list, tuple, range)) else a.copy())

    @classmethod
    def _wrap(cls, fresh: np.ndarray) -> "Tokens":
        # ``fresh``: a 1-D int64 array nobody else holds (frozen here, not copied).
        t = cls.__new__(cls)
        t._a = _frozen(fresh)
        return t

    @property
    def array(self) -> np.ndarray:
        """The read-only int64 array (shared, never copied)."""
        return self._a

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Tokens(self._a[i])
        return int(self._a[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._a.tolist())

    def tolist(self) -> List[int]:
        return self._a.tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self._a if dtype is None else self._a.astype(dtype, copy=False)
        return a.copy() if copy else a

    def _other(self, other) -> Optional[np.ndarray]:
        if isinstance(other, (Tokens, TokenBuffer)):
            return other.array
        if isinstance(other, np.ndarray):
            return other
        if isinstance(other, (list, tuple, range)):
            try:
                return as_tokens(other)
            except (TypeError, ValueError, OverflowError):
                return None
        return None

    def __eq__(self, other) -> bool:
        o = self._other(other)
        if o is None:
            return NotImplemented if not isinstance(other, (list, tuple, range)) else False
        return o.shape == self._a.shape and bool(np.array_equal(self._a, o))

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # like a list: equal to lists, so it cannot hash like a tuple

    # Lexicographic order, as lists compare (tests and debugging sort by edges).
    def __lt__(self, other) -> bool:
        return self.tolist() < list(other)

    def __le__(self, other) -> bool:
        return self.tolist() <= list(other)

    def __gt__(self, other) -> bool:
        return self.tolist() > list(other)

    def __ge__(self, other) -> bool:
        return self.tolist() >= list(other)

    def __add__(self, other) -> "Tokens":
        return Tokens._wrap(np.concatenate([self._a, as_tokens(other)]))

    def __radd__(self, other) -> Union[List[int], "Tokens"]:
        if isinstance(other, list):
            return other + self.tolist()
        return Tokens._wrap(np.concatenate([as_tokens(other), self._a]))

    def __repr__(self) -> str:
        n = len(self._a)
        body = self._a.tolist() if n <= 16 else self._a[:8].tolist() + ["..."] + [f"{n} tokens"]
        return f"Tokens({body})"


class TokenBuffer:
    """An append-only log of token ids (what a request's caches absorbed).

    Appending is amortised O(1) per token; `array` is a read-only view of everything
    appended so far, which later appends never change (a truncation moves the log to a
    fresh buffer for the same reason). Behaves like a list of ints where a request needs
    it: ``extend``, ``append``, ``len``, indexing, iteration, ``del log[k:]``.
    """

    __slots__ = ("_buf", "_n")

    def __init__(self, initial: Any = ()) -> None:
        a = as_tokens(initial)
        self._buf = np.empty(max(64, len(a) + len(a) // 4), dtype=DTYPE)
        self._buf[: len(a)] = a
        self._n = len(a)

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need > len(self._buf):
            buf = np.empty(max(need, 2 * len(self._buf)), dtype=DTYPE)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf

    def extend(self, tokens: Any) -> None:
        a = tokens if isinstance(tokens, np.ndarray) else as_tokens(tokens)
        self._reserve(len(a))
        self._buf[self._n: self._n + len(a)] = a
        self._n += len(a)

    def append(self, token: int) -> None:
        self._reserve(1)
        self._buf[self._n] = token
        self._n += 1

    @property
    def array(self) -> np.ndarray:
        """Read-only view of the tokens appended so far."""
        return _frozen(self._buf[: self._n])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.array if dtype is None else self.array.astype(dtype, copy=False)
        return a.copy() if copy else a

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.array[i]
        return int(self.array[i])

    def __delitem__(self, i) -> None:
        if not isinstance(i, slice) or i.step not in (None, 1) or \
                (i.stop is not None and i.stop < self._n):
            raise TypeError("a token log can only drop a tail: del log[k:]")
        k = range(self._n)[i].start if self._n else 0
        self._buf = self._buf[:k].copy()  # views handed out keep the old buffer intact
        self._n = k

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def tolist(self) -> List[int]:
        return self.array.tolist()

    def __repr__(self) -> str:
        return f"TokenBuffer({self._n} tokens)"
