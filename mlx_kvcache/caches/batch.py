"""Batch caches built by ``merge(caches)`` (mlx-lm's batch constructor) from our classes.

mlx-lm's ``BatchGenerator`` / ``batch_generate`` stack per-sequence caches into one batch
cache (``merge``), then ``prepare`` / ``finalize`` / ``filter`` / ``extend`` it and hand each
finished sequence's cache back with ``extract(i)``. For the kinds mlx-lm batches, ours are
mlx-lm's own batch classes, unchanged, except that ``extract`` gives back *our* class (a
cache that can snapshot), holding exactly what mlx-lm's would:

* `BatchKVCache`, `BatchRotatingKVCache`: mlx-lm's (left padding, the window wrapping
  inside the batch); ``extract`` → our `KVCache` / `RotatingKVCache`. Like mlx-lm's, the
  batched window ignores ``keep`` (the extracted window has ``keep=0``).
* `BatchRecurrentCache`: mlx-lm's ``ArraysCache.merge`` / ``filter`` / ``extend`` on our
  `RecurrentCache`, plus each row's token count (``offsets``), so that ``extract`` gives a
  `RecurrentCache` with its exact ``offset``. A row whose count is unknown — merged from a
  cache without an offset (mlx-lm's ``ArraysCache``, not empty), or a model that writes
  its state without calling ``advance`` (Mamba-1) — is extracted as mlx-lm's
  ``ArraysCache``, as mlx-lm would, never as ours with a wrong offset.
* `BatchQuantizedKVCache`: mlx-lm has no quantized batch cache (its ``QuantizedKVCache``
  does not batch). This one is three mlx-lm ``BatchKVCache`` side by side, one per part of
  the quantized triple (packed data, scales, biases): each holds its part's rows exactly
  as mlx-lm's batch holds plain rows (padding, rolls, filter, extend), so the parts stay
  aligned and every row is the row a `QuantizedKVCache` would hold.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc

from .factory import convert
from .quantized import QuantizedKVCache, Triple, quantize_rows
from .recurrent import RecurrentCache
from .snapshot import CacheError

__all__ = ["BatchKVCache", "BatchRotatingKVCache", "BatchRecurrentCache", "BatchQuantizedKVCache"]


def _as(cls: type, obj: Any) -> Any:
    """``obj`` as an instance of ``cls`` (a subclass adding no state): mlx-lm's merge builds
    its own class by name where every cache is empty."""
    if type(obj) is cls:
        return obj
    out = cls.__new__(cls)
    out.__dict__.update(vars(obj))
    return out


def _indices(ix: Any) -> List[int]:
    return [int(i) for i in (ix.tolist() if isinstance(ix, mx.array) else ix)]


class BatchKVCache(mlc.BatchKVCache):
    """mlx-lm's ``BatchKVCache``; ``extract`` gives our `KVCache`."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchKVCache":
        return _as(cls, super().merge(caches))

    def extract(self, idx: int) -> Any:
        return convert(super().extract(idx))


class BatchRotatingKVCache(mlc.BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache``; ``extract`` gives our `RotatingKVCache`."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchRotatingKVCache":
        return _as(cls, super().merge(caches))

    def extract(self, idx: int) -> Any:
        return convert(super().extract(idx))


class BatchRecurrentCache(RecurrentCache):
    """Recurrent state of a batch (mlx-lm's ``ArraysCache`` batch path) with each row's
    token count: ``offsets`` (an ``int32`` array, one per row) and ``known`` (whether the
    count of that row is exact)."""

    def __init__(self, size: int = 2, left_padding: Optional[List[int]] = None) -> None:
        super().__init__(size, left_padding)
        n = len(left_padding) if left_padding else 1
        self.offsets = mx.zeros((n,), mx.int32)
        self.known: List[bool] = [True] * n
        self._written: Set[int] = set()  # slots written since the last advance

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchRecurrentCache":
        out = mlc.ArraysCache.merge.__func__(cls, caches)
        out.offsets = mx.array([_row_offset(c) or 0 for c in caches], mx.int32)
        out.known = [_row_offset(c) is not None for c in caches]
        out._written = set()
        return out

    def __setitem__(self, idx: int, value: Optional[mx.array]) -> None:
        if idx in self._written:
            # Written twice without `advance`: the model does not count its tokens
            # (Mamba-1), so no row's count can be trusted from here on.
            self.known = [False] * len(self.known)
        self._written.add(idx)
        super().__setitem__(idx, value)

    def advance(self, n: int) -> None:
        # The tokens of this pass a row really absorbed: those neither left padding nor
        # past its length (the positions `make_mask` lets through).
        lo = 0 if self.left_padding is None else mx.clip(self.left_padding, 0, n)
        hi = n if self.lengths is None else mx.clip(self.lengths, 0, n)
        self.offsets = self.offsets + mx.maximum(hi - lo, 0).astype(mx.int32)
        mlc.ArraysCache.advance(self, n)
        self._written.clear()

    def filter(self, batch_indices: Any) -> None:
        keep = _indices(batch_indices)
        super().filter(batch_indices)
        self.offsets = self.offsets[mx.array(keep, mx.int32)] if keep else mx.zeros((0,), mx.int32)
        self.known = [self.known[i] for i in keep]

    def extend(self, other: Any) -> None:
        theirs = other.offsets if isinstance(other, BatchRecurrentCache) else mx.zeros(
            (other.batch_size,), mx.int32)
        known = other.known if isinstance(other, BatchRecurrentCache) else [
            other.empty()] * other.batch_size
        mlc.ArraysCache.extend(self, other)
        self.offsets = mx.concatenate([self.offsets, theirs])
        self.known = self.known + list(known)
        self._written |= getattr(other, "_written", set())

    def extract(self, idx: int) -> Any:
        if not self.known[idx] or self._written:
            return mlc.ArraysCache.extract(self, idx)
        out = RecurrentCache(len(self.cache))
        out.cache = [None if c is None else c[idx : idx + 1] for c in self.cache]
        out.offset = int(self.offsets[idx].item())
        return out

    @property
    def state(self):
        """``(slots, left_padding, lengths, offsets)``."""
        return self.cache, self.left_padding, self.lengths, self.offsets

    @state.setter
    def state(self, v) -> None:
        self.cache, self.left_padding, self.lengths, self.offsets = v
        self.cache = list(self.cache)
        self.known = [True] * int(self.offsets.size)
        self._written = set()

    @classmethod
    def from_state(cls, state) -> "BatchRecurrentCache":
        obj = cls(len(state[0]))
        obj.state = state
        return obj

    def snapshot(self, from_offset: int = 0):
        raise CacheError("a batch cache has no single offset to snapshot: extract(i) a row first")

    def restore(self, snapshot, target: int) -> bool:
        raise CacheError("a batch cache cannot be restored: restore each row's cache, then merge")

    def __repr__(self) -> str:
        return f"BatchRecurrentCache(size={len(self.cache)}, batch={len(self.known)})"


def _row_offset(c: Any) -> Optional[int]:
    """Tokens a per-sequence recurrent cache absorbed (None: it does not say)."""
    if isinstance(c, RecurrentCache) and not isinstance(c, BatchRecurrentCache):
        return int(c.offset)
    return 0 if c.empty() else None


class BatchQuantizedKVCache:
    """A left-padded batch of quantized KV rows (see the module docstring): three mlx-lm
    ``BatchKVCache`` in ``parts``, and mlx-lm's quantized-attention attributes ``bits`` /
    ``group_size``."""

    def __init__(self, group_size: int, bits: int, parts: Sequence[mlc.BatchKVCache]) -> None:
        self.group_size, self.bits = int(group_size), int(bits)
        self.parts = list(parts)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchQuantizedKVCache":
        """Stack quantized per-sequence caches (ours or mlx-lm's) with one setting."""
        settings = {(int(c.group_size), int(c.bits)) for c in caches}
        if len(settings) != 1:
            raise ValueError(f"quantized caches with different (group_size, bits) {sorted(settings)} "
                             f"cannot share a batch")
        (group_size, bits), = settings
        parts = []
        for j in range(3):
            views = []
            for c in caches:
                v = mlc.KVCache()  # part j of c's rows, sharing its arrays
                if c.keys is not None and c.offset:
                    v.keys, v.values, v.offset = c.keys[j], c.values[j], int(c.offset)
                views.append(v)
            parts.append(mlc.BatchKVCache.merge(views))
        return cls(group_size, bits, parts)

    # -- what the model sees ------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset

    @property
    def left_padding(self) -> mx.array:
        return self.parts[0].left_padding

    @property
    def keys(self) -> Optional[Triple]:
        return None if self.parts[0].keys is None else tuple(p.keys for p in self.parts)

    @property
    def values(self) -> Optional[Triple]:
        return None if self.parts[0].values is None else tuple(p.values for p in self.parts)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[Triple, Triple]:
        kq = quantize_rows(keys, self.group_size, self.bits)
        vq = quantize_rows(values, self.group_size, self.bits)
        out = [p.update_and_fetch(k, v) for p, k, v in zip(self.parts, kq, vq)]
        return tuple(o[0] for o in out), tuple(o[1] for o in out)  # type: ignore[return-value]

    def keys_and_values(self) -> Tuple[Triple, Triple]:
        out = [p.keys_and_values() for p in self.parts]
        return tuple(o[0] for o in out), tuple(o[1] for o in out)  # type: ignore[return-value]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any):
        return self.parts[0].make_mask(N, return_array=return_array, **kwargs)

    # -- the batch path -----------------------------------------------------------------
    def prepare(self, **kwargs: Any) -> None:
        for p in self.parts:
            p.prepare(**kwargs)

    def finalize(self) -> None:
        for p in self.parts:
            p.finalize()

    def filter(self, batch_indices: Any) -> None:
        for p in self.parts:
            p.filter(batch_indices)

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        if not isinstance(other, BatchQuantizedKVCache) or (other.group_size, other.bits) != (
                self.group_size, self.bits):
            raise ValueError(f"cannot extend a quantized batch (group_size={self.group_size}, "
                             f"bits={self.bits}) with {other!r}")
        for p, o in zip(self.parts, other.parts):
            p.extend(o)

    def extract(self, idx: int) -> QuantizedKVCache:
        rows = [p.extract(idx) for p in self.parts]
        out = QuantizedKVCache(self.group_size, self.bits)
        if rows[0].offset:
            out.keys = tuple(r.keys for r in rows)  # type: ignore[assignment]
            out.values = tuple(r.values for r in rows)  # type: ignore[assignment]
            out.offset = int(rows[0].offset)
        return out

    # -- the rest of mlx-lm's protocol ----------------------------------------------------
    @property
    def state(self):
        """``(part states, group_size, bits)``."""
        return tuple(p.state for p in self.parts), self.group_size, self.bits

    @state.setter
    def state(self, v) -> None:
        states, group_size, bits = v
        self.group_size, self.bits = int(group_size), int(bits)
        self.parts = []
        for s in states:
            p = mlc.BatchKVCache([])  # (mlx-lm's from_state skips __init__'s attributes)
            p.state = s
            self.parts.append(p)

    @classmethod
    def from_state(cls, state) -> "BatchQuantizedKVCache":
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return [p.trim(n) for p in self.parts][0]

    def size(self) -> int:
        return self.parts[0].size()

    def empty(self) -> bool:
        return self.parts[0].empty()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __repr__(self) -> str:
        return (f"BatchQuantizedKVCache(bits={self.bits}, group_size={self.group_size}, "
                f"batch={self.parts[0].left_padding.size})")
