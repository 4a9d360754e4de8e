"""`RecurrentCache`: state of a recurrent layer (Mamba, gated delta net, RG-LRU, conv).

A recurrent state has no positions: it summarises every token seen so far. The only
way back to an earlier prefix is a snapshot taken exactly there, so snapshots are
whole states and restore only to their own offset.

`BatchRecurrentCache` is the batch ``RecurrentCache.merge(caches)`` builds: mlx-lm's
``ArraysCache.merge`` / ``filter`` / ``extend`` on ours, plus each row's token count
(``offsets``), so that ``extract`` gives a `RecurrentCache` with its exact ``offset``. A
row whose count is unknown — merged from a cache without an offset (mlx-lm's
``ArraysCache``, not empty), or a model that writes its state without calling ``advance``
(Mamba-1) — is extracted as mlx-lm's ``ArraysCache``, as mlx-lm would, never as ours with
a wrong offset.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import mlx_lm.models.cache as _mlx_cache
from mlx_lm.models.cache import ArraysCache

from .checks import check_offset, check_snapshot, check_target
from .merging import MergeDispatch
from .reach import WholeState
from .rollback import Rollback
from .snapshot import CacheError, Snapshot, compact


class RecurrentSnapshot(Snapshot):
    """Every slot of a recurrent cache at ``to_offset``."""

    kind = "recurrent"
    needs_base = False

    @property
    def slots(self) -> List[Optional[mx.array]]:
        if self.closed:
            self._get("0")  # raises the "closed" error
        return [self._arrays.get(str(i)) for i in range(self._slot_count())]

    def _slot_count(self) -> int:
        return max((int(k) + 1 for k in self._shapes), default=0)

    def meta(self):
        return {**super().meta(), "size": self._slot_count()}

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            return cls(int(meta["from_offset"]), int(meta["to_offset"]), dict(arrays))
        except KeyError as e:
            raise CacheError(f"recurrent snapshot is missing {e}") from None


class RecurrentCache(WholeState, Rollback, ArraysCache):
    """Slots of recurrent state (``cache[0]`` conv state, ``cache[1]`` recurrent state),
    drop-in for mlx-lm's ``ArraysCache`` (it subclasses it, which Mamba-1 requires).

    The recurrent state (slot 1 when ``size >= 2``) is kept in float32: it is an
    accumulator over the whole sequence. ``offset`` counts the tokens absorbed; models
    that call ``advance(n)`` keep it current, and `settle` covers those that do not.
    """

    #: Why a restore landed short, in words (`prefix.explain`).
    restore_rule = "recurrent layers restore only at checkpoints"

    def __init__(self, size: int = 2, left_padding: Optional[List[int]] = None) -> None:
        if int(size) < 1:
            raise CacheError(f"size must be >= 1, got {size}")
        super().__init__(int(size), left_padding=left_padding)
        self.offset = 0
        self._dirty = False  # written since the last advance

    @property
    def _fp32_slot(self) -> Optional[int]:
        return 1 if len(self.cache) >= 2 else None

    def __setitem__(self, idx: int, value: Optional[mx.array]) -> None:
        if value is not None:
            if not isinstance(value, mx.array):
                raise CacheError(f"slot {idx} must be an mx.array, got {type(value).__name__}")
            old = self.cache[idx]
            if idx == self._fp32_slot and value.dtype != mx.float32:
                value = value.astype(mx.float32)
            if old is not None and (old.shape != value.shape or old.dtype != value.dtype):
                raise CacheError(
                    f"slot {idx} changed mid-sequence from {tuple(old.shape)} {old.dtype} "
                    f"to {tuple(value.shape)} {value.dtype}"
                )
        self.cache[idx] = value
        self._dirty = True

    def advance(self, n: int) -> None:
        """Record ``n`` absorbed tokens (called by the model after writing its state)."""
        super().advance(n)
        self.offset += int(n)
        self._dirty = False

    def settle(self, n: int) -> None:
        """After a forward pass of ``n`` tokens: advance if the model wrote state without
        calling `advance` (Mamba-1 does not), so ``offset`` stays exact."""
        if self._dirty:
            self.advance(n)

    # -- accessors in the seed's spirit ------------------------------------------------
    def _slot(self, idx: int, batch: int, dtype) -> Optional[mx.array]:
        s = self.cache[idx]
        if s is not None and (s.shape[0] != batch or (dtype is not None and s.dtype != dtype)):
            raise CacheError(
                f"slot {idx} holds batch {s.shape[0]} {s.dtype}, asked for batch {batch} {dtype}"
            )
        return s

    def conv_state(self, batch: int = 1, dtype=None) -> Optional[mx.array]:
        """The conv state (None before the first write); raises on a batch/dtype mismatch."""
        return self._slot(0, batch, dtype)

    def set_conv_state(self, v: mx.array) -> None:
        # Compact so the state does not pin the forward pass's larger concat buffer.
        self[0] = compact(v)

    def delta_state(self, batch: int = 1, dtype=mx.float32) -> Optional[mx.array]:
        """The recurrent (delta / SSM) state, float32 (None before the first write)."""
        if len(self.cache) < 2:
            raise CacheError("this cache has no recurrent-state slot (size < 2)")
        return self._slot(1, batch, dtype)

    def set_delta_state(self, v: mx.array) -> None:
        if len(self.cache) < 2:
            raise CacheError("this cache has no recurrent-state slot (size < 2)")
        self[1] = v

    def free(self) -> None:
        """Drop all state; ``offset`` becomes 0."""
        self.cache = [None] * len(self.cache)
        self.offset = 0
        self._dirty = False
        self.lengths = None
        self.left_padding = None

    # -- snapshot face ----------------------------------------------------------------
    def update(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Recurrent layers attend to nothing: a pass-through that satisfies the protocol."""
        return keys, values

    def snapshot(self, from_offset: int = 0) -> Optional[RecurrentSnapshot]:
        """Copy of every slot at ``offset`` (``from_offset`` is recorded, not used)."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        if self.empty() or from_offset == self.offset:
            return None
        arrays = {str(i): compact(s) for i, s in enumerate(self.cache) if s is not None}
        mx.eval(list(arrays.values()))
        return RecurrentSnapshot(from_offset, self.offset, arrays)

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        """Bytes ``snapshot(from_offset)`` would hold: every slot (nothing is copied)."""
        if self.empty() or from_offset >= self.offset:
            return 0
        return sum(s.size * s.dtype.size for s in self.cache if s is not None)

    def restore(self, snapshot: Optional[RecurrentSnapshot], target: int) -> bool:
        """Recurrent state cannot rewind: only ``target == offset`` (live) or
        ``target == snapshot.to_offset`` succeed. False (no change) otherwise."""
        target = check_target(target)
        if target is None:
            return False
        if snapshot is None:
            return target == self.offset
        check_snapshot(snapshot, RecurrentSnapshot, "RecurrentCache.restore")
        slots = snapshot.slots
        if len(slots) > len(self.cache):
            raise CacheError(f"snapshot has {len(slots)} slots, the cache has {len(self.cache)}")
        for i, (old, new) in enumerate(zip(self.cache, slots)):
            if old is not None and new is not None and (old.shape != new.shape or old.dtype != new.dtype):
                raise CacheError(
                    f"snapshot slot {i} is {tuple(new.shape)} {new.dtype}, the cache holds "
                    f"{tuple(old.shape)} {old.dtype}"
                )
        if target != snapshot.to_offset:
            return False
        # New handles on the snapshot's (immutable) arrays, sharing their buffers (no
        # copy): a slot write by the model rebinds only the cache's handle, never the
        # snapshot's, and MLX copies a shared buffer before writing into it.
        fresh = [None if s is None else s[...] for s in slots]
        self.cache = fresh + [None] * (len(self.cache) - len(slots))
        self.offset = target
        self._dirty = False
        return True

    merge = MergeDispatch()

    def merge_snapshots(
        self, parent: Optional[RecurrentSnapshot], child: Optional[RecurrentSnapshot]
    ) -> Optional[RecurrentSnapshot]:
        """The child's state supersedes the parent's; the parent is closed."""
        for s in (parent, child):
            if s is not None:
                check_snapshot(s, RecurrentSnapshot, "RecurrentCache.merge")
        if parent is not None and parent is not child:
            parent.close()
        return child

    def split(self, snapshot: RecurrentSnapshot, at: int) -> Tuple[None, RecurrentSnapshot]:
        """A state cannot be cut: returns ``(None, snapshot)``."""
        check_snapshot(snapshot, RecurrentSnapshot, "RecurrentCache.split")
        check_offset("at", at)
        return None, snapshot

    # -- mlx-lm face ------------------------------------------------------------------
    @property
    def state(self):
        """``(slots, left_padding, lengths, offset)``."""
        return self.cache, self.left_padding, self.lengths, self.offset

    @state.setter
    def state(self, v) -> None:
        if len(v) == 4:
            self.cache, self.left_padding, self.lengths, offset = v
        else:  # an mlx-lm ArraysCache state
            self.cache, self.left_padding, self.lengths = v
            offset = 0
        self.cache = list(self.cache)
        self.offset = int(offset)
        self._dirty = False

    @property
    def dirty(self) -> bool:
        """Written since the last `advance` / `settle`: a forward pass was interrupted
        half-way (or has not been counted yet), so the state is at no token offset."""
        return self._dirty

    @classmethod
    def from_state(cls, state) -> "RecurrentCache":
        obj = cls(len(state[0]))
        obj.state = state
        return obj

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`)."""
        return ["recurrent", len(self.cache)]

    def arrays(self) -> List[mx.array]:
        """The arrays the cache holds now (to evaluate after a forward pass)."""
        return [x for x in self.cache if x is not None]

    def to_mlx(self, cls: type = ArraysCache) -> Any:
        """mlx-lm's ``ArraysCache`` (or its subclass ``cls``) holding this state, sharing
        the arrays."""
        n = cls(len(self.cache))
        n.cache = list(self.cache)
        return n

    def adopt_length(self, length: int, quant: Any = None) -> bool:
        """Made from mlx-lm's class (`from_mlx`), which records no token count: take
        ``length`` from the caller. False for a batch row's padding bookkeeping (not a
        single sequence) or an empty state."""
        if self.empty() or self.lengths is not None or self.left_padding is not None:
            return False
        self.offset = length  # recurrent state has no positions: the caller's count
        return True

    #: The mlx-lm class this one stands for (`factory.convert` turns one into the other).
    mlx_class = ArraysCache

    @classmethod
    def from_mlx(cls, c: Any) -> "RecurrentCache":
        """Ours holding what mlx-lm's ``ArraysCache`` ``c`` holds, sharing its arrays (no copy)."""
        out = cls(len(c.cache))
        out.cache = list(c.cache)
        out.left_padding, out.lengths = c.left_padding, c.lengths
        return out

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``ArraysCache.merge``: the states stacked into a batch cache
        (`BatchRecurrentCache`, which counts each row's tokens so that ``extract``
        gives back this class with its offset)."""
        return BatchRecurrentCache.merge(caches)

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)

    def __repr__(self) -> str:
        return f"RecurrentCache(size={len(self.cache)}, offset={self.offset})"


# mlx-lm's load_prompt_cache (and CacheList) rebuild classes by name from its own module.
if not hasattr(_mlx_cache, "RecurrentCache"):
    _mlx_cache.RecurrentCache = RecurrentCache


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
        out = _mlx_cache.ArraysCache.merge.__func__(cls, caches)
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
        _mlx_cache.ArraysCache.advance(self, n)
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
        _mlx_cache.ArraysCache.extend(self, other)
        self.offsets = mx.concatenate([self.offsets, theirs])
        self.known = self.known + list(known)
        self._written |= getattr(other, "_written", set())

    def extract(self, idx: int) -> Any:
        if not self.known[idx] or self._written:
            return _mlx_cache.ArraysCache.extract(self, idx)
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


def _indices(ix: Any) -> List[int]:
    return [int(i) for i in (ix.tolist() if isinstance(ix, mx.array) else ix)]
