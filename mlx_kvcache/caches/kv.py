"""`KVCache`: a full-attention KV cache with snapshot / restore / merge / split, and
`BatchKVCache`, the batch ``KVCache.merge(caches)`` builds: mlx-lm's own (left padding),
except that ``extract`` gives back our `KVCache`. Its snapshots (`KVSnapshot`) are rows
(`rows`)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc
from mlx_lm.models.cache import create_attention_mask

from .buffers import KVBuffers, concat_rows
from .checks import check_kv, check_offset, check_snapshot, check_target
from .merging import MergeDispatch, as_class
from .reach import Reach, Span, UpTo, chain, scheduled_reach
from .rollback import Rollback
from .quantized import QuantizedKVCache
from .rows import KVSnapshot, QuantizedSnapshot, merge_rows, quantize_rows, split_rows
from .snapshot import CacheError, compact

__all__ = ["KVCache", "KVSnapshot", "BatchKVCache"]


class KVCache(KVBuffers, Rollback):
    """Growable KV cache for one attention layer, drop-in for mlx-lm's ``KVCache``.

    Keys and values live in buffers grown in steps of 256 positions (as mlx-lm does,
    so decoding writes in place); ``offset`` is the number of tokens held, which is
    also the absolute position of the next token.
    """

    step = 256
    #: Snapshots are deltas over the rows below them (the budget counts only new rows).
    delta_snapshots = True

    def __init__(self) -> None:
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0
        self._parts: Optional[Tuple[Any, ...]] = None  # see `restored_parts`

    # -- writing ----------------------------------------------------------------------
    def _write(self, keys: mx.array, values: mx.array) -> None:
        self._parts = None
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    # Drop stale rows past the offset (left by a rewind or a compact restore).
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
        self.offset = prev + n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values

    def update(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append ``[B, H, L, D]`` keys/values; return all keys/values to attend to."""
        check_kv(keys, values, self.keys, self.values)
        self._write(keys, values)
        return self.keys_and_values()

    update_and_fetch = update

    def free(self) -> None:
        """Drop all state; ``offset`` becomes 0."""
        self.keys = self.values = None
        self.offset = 0
        self._parts = None

    def restored_parts(self) -> Optional[Tuple[List[Tuple[mx.array, int]], List[Tuple[mx.array, int]]]]:
        """``(keys, values)``: the arrays whose leading rows, in order, are rows ``[0,
        offset)`` — ``[(array, rows), ...]`` along axis 2 — while the buffers are still
        the ones `restore_chain` built from them and nothing has been written since;
        None otherwise. A caller that copies the rows elsewhere anyway (mlx-lm's batch
        merge) copies them from these, and the buffers, still unevaluated, never are."""
        p = getattr(self, "_parts", None)  # (an instance made without __init__ has none)
        if p is None or p[0] is not self.keys or p[1] is not self.values or p[2] != self.offset:
            return None
        return p[3], p[4]

    # -- snapshot face ----------------------------------------------------------------
    def snapshot(self, from_offset: int = 0) -> Optional[KVSnapshot]:
        """Compact copy of ``[from_offset, offset)``; None when that range is empty."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        if self.keys is None or from_offset == self.offset:
            return None
        k = compact(self.keys[..., from_offset : self.offset, :])
        v = compact(self.values[..., from_offset : self.offset, :])
        mx.eval(k, v)
        return KVSnapshot(from_offset, self.offset, {"keys": k, "values": v})

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        """Bytes ``snapshot(from_offset)`` would hold (nothing is copied)."""
        if self.keys is None or from_offset >= self.offset:
            return 0
        return (self.offset - max(from_offset, 0)) * self._row_bytes()

    def restore(self, snapshot: Optional[KVSnapshot], target: int) -> bool:
        """Bring the cache to ``target`` tokens.

        With ``snapshot=None`` this rewinds the live state (any ``target <= offset``).
        With a snapshot, the cache must already hold its base (``offset >=
        snapshot.from_offset``) and ``target <= snapshot.to_offset``. Returns False,
        changing nothing, when the target is unreachable.
        """
        target = check_target(target)
        if target is None:
            return False
        if snapshot is None:
            if target > self.offset:
                return False
            self.offset = target
            return True
        check_snapshot(snapshot, KVSnapshot, "KVCache.restore")
        k, v = snapshot.keys, snapshot.values
        if self.keys is not None:
            check_kv(k, v, self.keys, self.values)
        if target > snapshot.to_offset or self.offset < snapshot.from_offset:
            return False
        self.offset = snapshot.from_offset
        self._write(k, v)
        self.offset = min(target, snapshot.to_offset)
        return True

    def restore_chain(self, snapshots: Sequence[KVSnapshot], target: int, room: int = 0) -> bool:
        """`restore` through adjacent snapshots ``[a, b), [b, c), ...`` in one copy.

        The first must start at or below ``offset`` and ``target`` must be at most the
        last one's end. The buffer is rebuilt once — live rows below the first snapshot,
        then each snapshot's rows, then room to grow — instead of growing (and copying
        everything so far) once per snapshot. ``room``: tokens about to be written (the
        rest of a prompt); the buffer gets space for them now, so the next writes do not
        copy it all again to grow. False, changing nothing, when unreachable.
        """
        target = check_target(target)
        if target is None:
            return False
        if not snapshots:
            return self.restore(None, target)
        for s in snapshots:
            check_snapshot(s, KVSnapshot, "KVCache.restore_chain")
        for a, b in zip(snapshots, snapshots[1:]):
            if a.to_offset != b.from_offset:
                raise CacheError(f"snapshots [{a.from_offset}, {a.to_offset}) and "
                                 f"[{b.from_offset}, {b.to_offset}) are not adjacent")
        like_k, like_v = (self.keys, self.values) if self.keys is not None else (
            snapshots[0].keys, snapshots[0].values)
        for s in snapshots:
            check_kv(s.keys, s.values, like_k, like_v)
        start = snapshots[0].from_offset
        if self.offset < start or target > snapshots[-1].to_offset:
            return False
        if target <= start:
            return self.restore(None, target)
        # Room to grow (at least one row, so the buffer is never a bare snapshot array),
        # rounded up to whole steps as `_write` grows.
        rows = -(-(target + max(int(room), 1)) // self.step) * self.step
        ks = [(self.keys, start)] if start else []
        vs = [(self.values, start)] if start else []
        for s in snapshots:
            if s.from_offset >= target:
                break
            hi = min(s.to_offset, target) - s.from_offset
            ks.append((s.keys, hi))
            vs.append((s.values, hi))
        self.keys = concat_rows(ks, rows - target)
        self.values = concat_rows(vs, rows - target)
        self.offset = target
        self._parts = (self.keys, self.values, target, ks, vs)
        return True

    merge = MergeDispatch()

    def merge_snapshots(self, parent: KVSnapshot, child: KVSnapshot) -> KVSnapshot:
        """Concatenate adjacent ``[a, b)`` and ``[b, c)`` into ``[a, c)``; closes both.

        A layer's nodes may also hold quantized rows (``kv_bits``): a pair with a
        `QuantizedSnapshot` in it merges by `quantized.merge_rows`'s rules."""
        if isinstance(parent, (KVSnapshot, QuantizedSnapshot)) and isinstance(
                child, (KVSnapshot, QuantizedSnapshot)) and QuantizedSnapshot in (type(parent), type(child)):
            return merge_rows(parent, child)
        check_snapshot(parent, KVSnapshot, "KVCache.merge")
        check_snapshot(child, KVSnapshot, "KVCache.merge")
        if parent.to_offset != child.from_offset:
            raise CacheError(
                f"cannot merge non-adjacent snapshots [{parent.from_offset}, {parent.to_offset}) "
                f"and [{child.from_offset}, {child.to_offset})"
            )
        check_kv(child.keys, child.values, parent.keys, parent.values)
        k = concat_rows([(parent.keys, parent.to_offset - parent.from_offset),
                         (child.keys, child.to_offset - child.from_offset)], 0)
        v = concat_rows([(parent.values, parent.to_offset - parent.from_offset),
                         (child.values, child.to_offset - child.from_offset)], 0)
        mx.eval(k, v)
        out = KVSnapshot(parent.from_offset, child.to_offset, {"keys": k, "values": v})
        parent.close()
        child.close()
        return out

    def split(
        self, snapshot: KVSnapshot, at: int
    ) -> Tuple[Optional[KVSnapshot], Optional[KVSnapshot]]:
        """Cut ``[a, c)`` into ``[a, at)`` and ``[at, c)``; takes ownership of the input.

        ``at <= a`` gives ``(None, snapshot)``, ``at >= c`` gives ``(snapshot, None)``.
        A `QuantizedSnapshot` (``kv_bits``) splits the same way.
        """
        if isinstance(snapshot, QuantizedSnapshot):
            return split_rows(snapshot, at)
        check_snapshot(snapshot, KVSnapshot, "KVCache.split")
        at = check_offset("at", at)
        a, c = snapshot.from_offset, snapshot.to_offset
        if at <= a:
            return None, snapshot
        if at >= c:
            return snapshot, None
        r = at - a
        k, v = snapshot.keys, snapshot.values
        hk, hv = compact(k[..., :r, :]), compact(v[..., :r, :])
        tk, tv = compact(k[..., r:, :]), compact(v[..., r:, :])
        mx.eval(hk, hv, tk, tv)
        snapshot.close()
        return (
            KVSnapshot(a, at, {"keys": hk, "values": hv}),
            KVSnapshot(at, c, {"keys": tk, "values": tv}),
        )

    # -- restore along a stored prefix (`reach`) -----------------------------------------
    #: Kind rules (`reach`): every offset below a snapshot's end is reachable from the
    #: rows stored; the ``kv_bits`` switch converts this layer.
    any_offset = True
    interval_cap = 0
    quantizable = True
    #: Why a restore landed short, in words (`prefix.explain`): a plain KV layer falls
    #: short only under a ``kv_bits`` schedule.
    restore_rule = "quantized KV rows restore only where the kv_bits schedule allows"

    def reach(self, spans: Sequence[Span], live_common: int, top: int, quant: Any = None) -> Reach:
        """Every offset up to where the live rows and the spans' `KVSnapshot` rows run
        without a gap; under a ``kv_bits`` schedule (``quant``) the schedule's rows."""
        if quant is not None:
            live_kv = min(live_common, self.offset)
            return scheduled_reach(spans, top, quant, live_kv, min(live_kv, quant.start))
        limit = live_common
        for start, end, s in spans:  # the rows page in span after span above the live prefix
            if end <= limit:
                continue
            if start > limit or not isinstance(s, KVSnapshot):
                break
            limit = min(end, top)
        return UpTo(max(limit, live_common))

    def restore_along(self, spans: Sequence[Span], t: int, live_common: int, room: int = 0) -> bool:
        """Rewind the live rows to the shared prefix, then the spans' rows up to ``t`` in
        one copy (``room``: tokens the request adds next, made room for at once)."""
        if t <= live_common and self.restore(None, t):
            return True
        if not self.restore(None, min(live_common, t, self.offset)):
            return False
        return self.restore_chain(chain(spans, self.offset, t, KVSnapshot), t, room=room) \
            and self.offset == t

    def targets(self, top: int) -> List[int]:
        return []

    def snapshot_rows(self, tokens: int) -> int:
        """A snapshot at ``tokens`` holds that many rows (deltas add up)."""
        return tokens

    # -- mlx-lm face ------------------------------------------------------------------
    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`); ``quantization``: the
        `KVQuantization` whose rows this layer's snapshots hold past its switch."""
        return ["kv"] + (quantization.signature() if quantization is not None else [])

    def to_mlx(self) -> Any:
        """mlx-lm's ``KVCache`` holding these rows, sharing the arrays: the whole buffer,
        room to grow included (mlx-lm's own layout: rows past ``offset`` are free space),
        so the prompt's rest is written in place instead of copying every row first."""
        n = mlc.KVCache()
        if self.keys is not None and self.offset:
            n.keys, n.values = self.keys, self.values
            n.offset = self.offset
        return n

    #: The mlx-lm class this one stands for (`factory.convert` turns one into the other).
    mlx_class = mlc.KVCache

    @classmethod
    def from_mlx(cls, c: Any) -> "KVCache":
        """Ours holding what mlx-lm's ``KVCache`` ``c`` holds, sharing its arrays (no copy)."""
        out = cls()
        if c.keys is not None:
            out.keys, out.values = c.keys, c.values
        out.offset = int(c.offset)
        return out

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``KVCache.merge``: the caches stacked into a left-padded batch cache
        (`BatchKVCache`, whose ``extract`` gives back this class)."""
        return BatchKVCache.merge(caches)

    @property
    def state(self) -> Tuple[Any, ...]:
        """``(keys, values, offset)``: the whole buffer (room to grow included) and the
        number of valid rows, mlx-lm 0.32's layout."""
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v) -> None:
        keys, values, offset = v
        self.keys, self.values, self.offset = keys, values, int(offset)

    @classmethod
    def from_state(cls, state) -> "KVCache":
        obj = cls()
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, int(n))
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """Our `QuantizedKVCache` holding these rows quantized (mlx-lm's
        ``maybe_quantize_kv_cache`` swaps caches through this)."""
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        if self.keys is not None and self.offset:
            k, v = self.keys_and_values()
            q.write_rows(quantize_rows(k, group_size, bits), quantize_rows(v, group_size, bits))
        return q

    def __repr__(self) -> str:
        return f"KVCache(offset={self.offset})"


class BatchKVCache(mlc.BatchKVCache):
    """mlx-lm's ``BatchKVCache``; ``extract`` gives our `KVCache`."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchKVCache":
        return as_class(cls, super().merge(caches))

    def extract(self, idx: int) -> Any:
        return KVCache.from_mlx(super().extract(idx))
