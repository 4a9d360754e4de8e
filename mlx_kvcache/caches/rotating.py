"""`RotatingKVCache`: a sliding-window KV cache with snapshot / restore.

It follows mlx-lm's ``RotatingKVCache`` exactly (same buffer layout, same masks), so
models produce identical logits on either. A window that has wrapped has lost the
tokens it overwrote; the only way back to an earlier point is a snapshot taken
there, and a snapshot is therefore the whole window plus the write cursor.

`BatchRotatingKVCache` is the batch ``RotatingKVCache.merge(caches)`` builds: mlx-lm's own
(the window wrapping inside the batch), except that ``extract`` gives back ours. Like
mlx-lm's, the batched window ignores ``keep`` (the extracted window has ``keep=0``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc
from mlx_lm.models.base import create_causal_mask

from .buffers import KVBuffers, SnapshotKV
from .checks import check_kv, check_offset, check_snapshot, check_target
from .merging import MergeDispatch, as_class
from .reach import Reach, Span, WholeState, whole_state_reach
from .rollback import Rollback
from .snapshot import CacheError, Snapshot, compact


class RotatingSnapshot(SnapshotKV, Snapshot):
    """The whole window at ``to_offset``: buffer rows, write cursor, and window settings."""

    kind = "rotating"
    needs_base = False

    def __init__(self, from_offset, to_offset, arrays, idx: int, max_size: int, keep: int):
        super().__init__(from_offset, to_offset, arrays)
        self.idx = int(idx)
        self.max_size = int(max_size)
        self.keep = int(keep)

    @property
    def wrapped(self) -> bool:
        """True when tokens before the window were already dropped."""
        return self._to > self.max_size

    def meta(self):
        return {**super().meta(), "idx": self.idx, "max_size": self.max_size, "keep": self.keep}

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            return cls(
                int(meta["from_offset"]), int(meta["to_offset"]),
                {"keys": arrays["keys"], "values": arrays["values"]},
                int(meta["idx"]), int(meta["max_size"]), int(meta["keep"]),
            )
        except KeyError as e:
            raise CacheError(f"rotating snapshot is missing {e}") from None


class RotatingKVCache(WholeState, KVBuffers, Rollback):
    """Sliding-window KV cache holding at most ``max_size`` positions (plus ``keep``
    attention-sink rows that are never evicted), drop-in for mlx-lm's class.

    ``offset`` counts every token ever seen (it drives RoPE); ``_idx`` is the next
    physical write slot.
    """

    step = 256

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if int(max_size) < 1:
            raise CacheError(f"max_size must be >= 1, got {max_size}")
        if not 0 <= int(keep) < int(max_size):
            raise CacheError(f"keep must be in [0, max_size), got keep={keep}, max_size={max_size}")
        self.max_size = int(max_size)
        self.keep = int(keep)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self._idx = 0

    # -- buffer mechanics (mlx-lm's semantics) ----------------------------------------
    def _trim(self, trim_size: int, v: mx.array, append: Optional[mx.array] = None) -> mx.array:
        parts = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]] if trim_size > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    def _temporal_order(self, v: mx.array) -> mx.array:
        """The buffer in token order, without unused rows."""
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:
            return mx.concatenate(
                [v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]],
                axis=2,
            )
        return v[..., : self._idx, :]

    def _update_concat(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = mx.array(keys), mx.array(values)  # never write into the caller's arrays
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = self.keys.shape[2]
            # Keep max_size - 1 old rows so every new query sees a full window.
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        B, H, S, dk = keys.shape
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            grow = min(self.step, self.max_size - prev)
            new_k = mx.zeros((B, H, grow, dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            self._idx = prev
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self.offset += S
        self._idx += S
        return self.keys_and_values()

    def update(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append ``[B, H, L, D]`` keys/values; return the window to attend to."""
        check_kv(keys, values, self.keys, self.values)
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    update_and_fetch = update

    def free(self) -> None:
        """Drop all state; ``offset`` becomes 0."""
        self.keys = self.values = None
        self.offset = 0
        self._idx = 0

    @property
    def wrapped(self) -> bool:
        """True once tokens have left the window (they cannot come back)."""
        return self.offset > self.max_size

    # -- rollback after a rejected draft (`rollback`): a window rewinds live until it wraps
    def rewinds_live(self) -> bool:
        return not self.wrapped

    def needs_checkpoint(self, ahead: int) -> bool:
        return self.offset + ahead > self.max_size

    # -- snapshot face ----------------------------------------------------------------
    def snapshot(self, from_offset: int = 0) -> Optional[RotatingSnapshot]:
        """The whole window at ``offset`` (``from_offset`` is recorded, not used)."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        if self.keys is None or from_offset == self.offset:
            return None
        k, v, idx = self.keys, self.values, self._idx
        if not self.wrapped:
            # Unwrapped: rows [0, offset) in order; the rest is growth padding or stale.
            k, v, idx = k[..., : self.offset, :], v[..., : self.offset, :], self.offset
        elif k.shape[2] > self.max_size:
            # Oversized after a multi-token write (always in temporal order): keep the
            # rows any next write would keep, i.e. what mlx-lm's trim leaves behind.
            cut = k.shape[2] - self.max_size
            k, v, idx = self._trim(cut, k), self._trim(cut, v), self.max_size
        k, v = compact(k), compact(v)
        mx.eval(k, v)
        return RotatingSnapshot(
            from_offset, self.offset, {"keys": k, "values": v}, idx, self.max_size, self.keep
        )

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        """Bytes ``snapshot(from_offset)`` would hold: the window (nothing is copied)."""
        if self.keys is None or from_offset >= self.offset:
            return 0
        return (self.max_size if self.wrapped else self.offset) * self._row_bytes()

    def restore(self, snapshot: Optional[RotatingSnapshot], target: int) -> bool:
        """Bring the cache to ``target`` tokens.

        Live rewind (``snapshot=None``): ``target == offset``, or any lower target while
        the window never wrapped. From a snapshot: ``target == snapshot.to_offset``, or
        any lower target when the snapshot never wrapped. False (no change) otherwise.
        """
        target = check_target(target)
        if target is None:
            return False
        if snapshot is None:
            if target == self.offset:
                return True
            if target > self.offset or self.wrapped:
                return False
            self.offset = self._idx = target
            return True
        check_snapshot(snapshot, RotatingSnapshot, "RotatingKVCache.restore")
        if (snapshot.max_size, snapshot.keep) != (self.max_size, self.keep):
            raise CacheError(
                f"snapshot window (max_size={snapshot.max_size}, keep={snapshot.keep}) does not "
                f"match the cache's (max_size={self.max_size}, keep={self.keep})"
            )
        k, v = snapshot.keys, snapshot.values
        if self.keys is not None:
            check_kv(k, v, self.keys, self.values)
        if target > snapshot.to_offset or (target < snapshot.to_offset and snapshot.wrapped):
            return False
        # New handles on the snapshot's (immutable) arrays, sharing their buffers (no
        # copy): a slice write rebinds only the cache's handle, and MLX copies a buffer
        # that another handle still holds before writing it, so the snapshot never changes.
        self.keys, self.values = k[...], v[...]
        self.offset, self._idx = snapshot.to_offset, snapshot.idx
        if target < snapshot.to_offset:
            self.offset = self._idx = target
        return True

    merge = MergeDispatch()

    def merge_snapshots(
        self, parent: Optional[RotatingSnapshot], child: Optional[RotatingSnapshot]
    ) -> Optional[RotatingSnapshot]:
        """The child's window supersedes the parent's; the parent is closed."""
        for s in (parent, child):
            if s is not None:
                check_snapshot(s, RotatingSnapshot, "RotatingKVCache.merge")
        if parent is not None and parent is not child:
            parent.close()
        return child

    def split(self, snapshot: RotatingSnapshot, at: int) -> Tuple[None, RotatingSnapshot]:
        """A window cannot be cut: returns ``(None, snapshot)``."""
        check_snapshot(snapshot, RotatingSnapshot, "RotatingKVCache.split")
        check_offset("at", at)
        return None, snapshot

    # -- restore along a stored prefix (`reach`) -----------------------------------------
    #: Why a restore landed short, in words (`prefix.explain`).
    restore_rule = "sliding-window layers restore only at checkpoints once their window wrapped"
    # (Kind rules: `WholeState`'s — a window comes back whole, from a snapshot at a span's
    # end — and, while it never wrapped, any offset below.)
    def reach(self, spans: Sequence[Span], live_common: int, top: int, quant: Any = None) -> Reach:
        """The span ends holding a window, the live offset, and any offset below a window
        that never wrapped."""
        return whole_state_reach(self.offset, spans, live_common, top, live_any=not self.wrapped,
                                 unwrapped=lambda s: isinstance(s, RotatingSnapshot) and not s.wrapped)

    def snapshot_rows(self, tokens: int) -> int:
        """A snapshot holds the window: at most ``max_size`` rows."""
        return min(tokens, int(self.max_size))

    # -- mlx-lm face ------------------------------------------------------------------
    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        # A single query needs a mask only when the model's window is smaller than the buffer.
        if self.offset >= window_size and self.max_size > window_size:
            idx = 0 if self._idx >= self.max_size else self._idx
            size = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(size) >= (size - window_size)
            return mx.roll(mask, shift=idx + 1)
        return None

    @property
    def state(self) -> Tuple[Any, ...]:
        """``(keys, values, offset, keep, max_size, _idx)``, mlx-lm's layout."""
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, offset, keep, max_size, idx = v
        self.offset, self.keep, self.max_size, self._idx = int(offset), int(keep), int(max_size), int(idx)

    @classmethod
    def from_state(cls, state) -> "RotatingKVCache":
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`)."""
        return ["rotating", self.max_size, self.keep]

    def to_mlx(self) -> Any:
        """mlx-lm's ``RotatingKVCache`` holding this window, sharing the arrays."""
        n = mlc.RotatingKVCache(self.max_size, keep=self.keep)
        if self.keys is not None and self.offset:
            n.state = self.state  # (mlx-lm's layout, the write cursor included)
        return n

    #: The mlx-lm class this one stands for (`factory.convert` turns one into the other).
    mlx_class = mlc.RotatingKVCache

    @classmethod
    def from_mlx(cls, c: Any) -> "RotatingKVCache":
        """Ours holding what mlx-lm's ``RotatingKVCache`` ``c`` holds, sharing its arrays (no copy)."""
        out = cls(c.max_size, keep=c.keep)
        if c.keys is not None:
            out.state = c.state
        return out

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``RotatingKVCache.merge``: the windows stacked into a left-padded batch
        cache (`BatchRotatingKVCache`, whose ``extract`` gives back this class)."""
        return BatchRotatingKVCache.merge(caches)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            raise CacheError(
                f"cannot trim a window that has wrapped (offset {self.offset} >= max_size {self.max_size})"
            )
        n = min(self.offset, int(n))
        self.offset -= n
        self._idx -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def __repr__(self) -> str:
        return f"RotatingKVCache(max_size={self.max_size}, keep={self.keep}, offset={self.offset})"


class BatchRotatingKVCache(mlc.BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache``; ``extract`` gives our `RotatingKVCache`."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchRotatingKVCache":
        return as_class(cls, super().merge(caches))

    def extract(self, idx: int) -> Any:
        return RotatingKVCache.from_mlx(super().extract(idx))
