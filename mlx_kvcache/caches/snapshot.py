"""The `Snapshot` base type shared by every cache kind.

A snapshot is a compact, immutable copy of part (KV) or all (rotating window,
recurrent state) of a cache's state. It owns its arrays: no later write to the
live cache can change it, and holding it keeps no live buffer alive.

A snapshot may be *parked*: its arrays dropped while a copy lives elsewhere (a file of
the disk tier), its kind, offsets, shapes and dtypes kept. A parked snapshot holds no
memory (``nbytes`` is 0, ``size`` what it holds when filled) and refuses to be read
(`CacheError`) until its owner `fill`s it with the same shapes again — so a forgotten
fill fails loudly instead of restoring zeros.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Tuple, Type

import mlx.core as mx


class CacheError(ValueError):
    """Bad input to a cache or a snapshot operation (shape, dtype, offset, kind).

    Raised before anything is changed: the cache is left as it was.
    """


class Snapshot:
    """State covering the tokens ``[from_offset, to_offset)`` of one cache layer.

    ``needs_base`` tells whether restoring it requires the cache to already hold the
    tokens below ``from_offset`` (KV snapshots are deltas); whole-state snapshots
    (rotating window, recurrent) stand alone and are only valid at ``to_offset``.
    """

    #: Short name of the cache kind ("kv", "rotating", "recurrent").
    kind: ClassVar[str] = "base"
    #: True when the snapshot is a delta over the tokens below ``from_offset``.
    needs_base: ClassVar[bool] = False

    _registry: ClassVar[Dict[str, Type["Snapshot"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        Snapshot._registry[cls.kind] = cls

    def __init__(self, from_offset: int, to_offset: int, arrays: Dict[str, mx.array]):
        self._from = int(from_offset)
        self._to = int(to_offset)
        self._arrays: Dict[str, mx.array] | None = dict(arrays)
        self._nbytes = sum(a.nbytes for a in arrays.values())
        #: name -> (shape, dtype); kept while parked (reading shapes evaluates nothing).
        self._shapes: Dict[str, Tuple[Tuple[int, ...], mx.Dtype]] = {
            n: (tuple(a.shape), a.dtype) for n, a in self._arrays.items()}
        self._parked = False

    @property
    def from_offset(self) -> int:
        """First absolute token position the snapshot covers."""
        return self._from

    @property
    def to_offset(self) -> int:
        """Absolute position just past the last covered token (the cache offset it restores)."""
        return self._to

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot really holds (0 once closed, and while parked)."""
        return 0 if self._arrays is None else self._nbytes

    @property
    def size(self) -> int:
        """Bytes it holds when resident, parked or not (0 once closed)."""
        return 0 if self.closed else self._nbytes

    @property
    def closed(self) -> bool:
        return self._arrays is None and not self._parked

    @property
    def parked(self) -> bool:
        """Its arrays were dropped (`park`) and not yet filled again."""
        return self._parked

    def shapes(self) -> Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]:
        """``{name: (shape, dtype)}`` of its arrays, parked or resident."""
        return dict(self._shapes)

    def close(self) -> None:
        """Drop the arrays. Idempotent."""
        self._arrays = None
        self._parked = False

    def park(self) -> None:
        """Drop the arrays, keeping kind, offsets, shapes and dtypes (a copy lives
        elsewhere). Idempotent; a closed snapshot stays closed."""
        if self._arrays is not None:
            self._arrays = None
            self._parked = True

    def fill(self, arrays: Dict[str, mx.array]) -> None:
        """Give a parked snapshot its arrays back (the same names, shapes and dtypes);
        raises `CacheError` otherwise."""
        if not self._parked:
            raise CacheError(f"{self!r} is not parked")
        got = {n: (tuple(a.shape), a.dtype) for n, a in arrays.items()}
        if got != self._shapes:
            raise CacheError(f"{self!r}: arrays {got} do not match {self._shapes}")
        self._arrays = dict(arrays)
        self._parked = False

    def _get(self, name: str) -> mx.array:
        if self._arrays is None:
            state = "parked (its data lives elsewhere)" if self._parked else "closed"
            raise CacheError(f"{type(self).__name__} [{self._from}, {self._to}) is {state}")
        return self._arrays[name]

    # -- serialisation (used by persistence) -------------------------------------------
    def meta(self) -> Dict[str, int]:
        """Integers besides the arrays that restore needs."""
        return {"from_offset": self._from, "to_offset": self._to}

    def to_arrays(self) -> Tuple[Dict[str, mx.array], Dict[str, int]]:
        """The arrays and integer metadata that fully describe the snapshot."""
        if self._arrays is None:
            raise CacheError(f"cannot serialise a {'parked' if self._parked else 'closed'} snapshot")
        return dict(self._arrays), self.meta()

    @classmethod
    def from_arrays(cls, kind: str, arrays: Dict[str, mx.array], meta: Dict[str, int]) -> "Snapshot":
        """Rebuild a snapshot written by `to_arrays`; raises `CacheError` on a mismatch."""
        try:
            sub = Snapshot._registry[kind]
        except KeyError:
            raise CacheError(f"unknown snapshot kind {kind!r}") from None
        return sub._from_arrays(arrays, meta)

    @classmethod
    def _from_arrays(cls, arrays, meta):  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("parked" if self._parked else f"{self.nbytes} B")
        return f"{type(self).__name__}([{self._from}, {self._to}), {state})"


def compact(x: mx.array) -> mx.array:
    """A copy of ``x`` in a row-contiguous buffer of its own, exactly its size.

    ``mx.contiguous`` alone returns the *same* buffer when a slice is row-contiguous and
    the buffer is at most 16 KiB larger (a one-KV-head cache's first rows, say), which
    would pin the whole live buffer; ``mx.array`` always copies (and ``contiguous`` then
    fixes broadcast layouts). Evaluate the result while ``x``'s buffer is still referenced,
    or MLX may donate that buffer to it.
    """
    return mx.contiguous(mx.array(x))
