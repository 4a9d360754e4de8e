"""`QuantizedKVCache`: a full-attention KV cache whose rows are stored quantized.

Drop-in for mlx-lm's ``QuantizedKVCache``: keys and values are triples (packed ``uint32``
data, scales, biases) in ``[B, H, rows, ...]`` buffers, and the ``bits`` / ``group_size``
attributes make mlx-lm models take the quantized attention path. Quantization groups run
along the head dimension, so every token's row is quantized on its own: a snapshot is a
delta of rows ``[a, b)`` exactly like a `KVSnapshot`, it restores at any token, splits at
any token and merges by concatenation.

Which rows a *request* may reuse is a separate question, decided by the quantization
schedule (`KVQuantization`, see `schedule`): rows computed after the switch to quantized
attention are valid only for requests with the same ``(bits, group_size, start)``.

`BatchQuantizedKVCache` is the batch ``QuantizedKVCache.merge(caches)`` builds (mlx-lm's
own quantized cache does not batch): three mlx-lm ``BatchKVCache`` side by side, one per
part of the quantized triple (packed data, scales, biases). Each holds its part's rows
exactly as mlx-lm's batch holds plain rows (padding, rolls, filter, extend), so the parts
stay aligned and every row is the row a `QuantizedKVCache` would hold.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc
from mlx_lm.models.cache import create_attention_mask

from .checks import check_kv, check_offset, check_snapshot, check_target
from .merging import MergeDispatch
from .reach import Reach, Span, UpTo, chain, scheduled_reach, walk
from .rollback import Rollback
from .rows import (
    KVSnapshot, QuantizedSnapshot, Triple, check_quant, merge_rows,
    pack_rows, quantize_rows, split_rows,
)
from .snapshot import CacheError, Snapshot, compact

class QuantizedKVCache(Rollback):
    """Growable quantized KV cache for one attention layer (mlx-lm's layout and face).

    ``quantized_kv_start`` records the schedule the rows belong to (-1 when unknown); it
    is carried into snapshots so they are reused only where they are valid.
    """

    step = 256
    #: Snapshots are deltas over the rows below them (the budget counts only new rows).
    delta_snapshots = True

    def __init__(self, group_size: int = 64, bits: int = 8, quantized_kv_start: int = -1) -> None:
        self.bits, self.group_size = check_quant(bits, group_size)
        self.quantized_kv_start = int(quantized_kv_start)
        self.keys: Optional[Triple] = None
        self.values: Optional[Triple] = None
        self.offset = 0

    # -- writing ----------------------------------------------------------------------
    def _dims(self) -> Optional[Tuple[int, int, int, int, Any]]:
        """``(B, H, key dim, value dim, dtype)`` of the rows held (None when empty)."""
        if self.keys is None:
            return None
        w, sc = self.keys[0], self.keys[1]
        return (w.shape[0], w.shape[1], w.shape[3] * 32 // self.bits,
                self.values[0].shape[3] * 32 // self.bits, sc.dtype)

    def _check_input(self, keys: mx.array, values: mx.array) -> None:
        check_kv(keys, values, None, None)
        for name, d in (("key", keys.shape[3]), ("value", values.shape[3])):
            if d % self.group_size:
                raise CacheError(f"{name} head dim {d} is not a multiple of the kv group size "
                                 f"{self.group_size}")
        dims = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        held = self._dims()
        if held is not None and dims != held:
            raise CacheError(f"keys/values [B={dims[0]}, H={dims[1]}, dk={dims[2]}, dv={dims[3]}, "
                             f"{dims[4]}] do not match the cache's [B={held[0]}, H={held[1]}, "
                             f"dk={held[2]}, dv={held[3]}, {held[4]}]")

    def write_rows(self, kq: Triple, vq: Triple) -> None:
        """Append rows quantized with this cache's ``bits`` / ``group_size`` (`quantize_rows`)
        at ``offset`` (grown in 256-row steps, written in place)."""
        prev, n = self.offset, kq[0].shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = ((n + self.step - 1) // self.step) * self.step

            def expand(buf, like):
                z = mx.zeros((*like.shape[:2], grow, like.shape[3]), like.dtype)
                if buf is None:
                    return z
                if prev % self.step:  # stale rows past the offset (a rewind or compact restore)
                    buf = buf[..., :prev, :]
                return mx.concatenate([buf, z], axis=2)

            old_k = self.keys or (None,) * 3
            old_v = self.values or (None,) * 3
            self.keys = tuple(expand(b, x) for b, x in zip(old_k, kq))  # type: ignore[assignment]
            self.values = tuple(expand(b, x) for b, x in zip(old_v, vq))  # type: ignore[assignment]
        self.offset = prev + n
        for buf, x in zip(self.keys + self.values, kq + vq):
            buf[..., prev : self.offset, :] = x

    def update(self, keys: mx.array, values: mx.array) -> Tuple[Triple, Triple]:
        """Quantize and append ``[B, H, L, D]`` keys/values; return every row to attend to."""
        self._check_input(keys, values)
        self.write_rows(quantize_rows(keys, self.group_size, self.bits),
                    quantize_rows(values, self.group_size, self.bits))
        return self.keys_and_values()

    update_and_fetch = update

    def keys_and_values(self) -> Tuple[Triple, Triple]:
        """The triples cut to the ``offset`` valid rows."""
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        cut = tuple(x[..., : self.offset, :] for x in self.keys + self.values)
        return cut[:3], cut[3:]  # type: ignore[return-value]

    def free(self) -> None:
        """Drop all state; ``offset`` becomes 0."""
        self.keys = self.values = None
        self.offset = 0

    # -- snapshot face ----------------------------------------------------------------
    def _row_bytes(self) -> int:
        return sum(x.shape[0] * x.shape[1] * x.shape[3] * x.dtype.size for x in self.keys + self.values)

    def snapshot(self, from_offset: int = 0) -> Optional[QuantizedSnapshot]:
        """Compact copy of rows ``[from_offset, offset)``; None when that range is empty."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        if self.keys is None or from_offset == self.offset:
            return None
        parts = [compact(x[..., from_offset : self.offset, :]) for x in self.keys + self.values]
        mx.eval(parts)
        return QuantizedSnapshot(from_offset, self.offset, pack_rows(tuple(parts[:3]), tuple(parts[3:])),
                                 self.bits, self.group_size, self.quantized_kv_start)

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        """Bytes ``snapshot(from_offset)`` would hold (nothing is copied)."""
        if self.keys is None or from_offset >= self.offset:
            return 0
        return (self.offset - max(from_offset, 0)) * self._row_bytes()

    def _rows_of(self, s: Snapshot, lo: int, hi: int) -> Tuple[Triple, Triple]:
        """Rows ``[lo, hi)`` of a KV-family snapshot, quantized with this cache's settings.

        A `KVSnapshot`'s rows are quantized here, which equals quantizing them in a live
        cache (each row is quantized on its own)."""
        r0, r1 = lo - s.from_offset, hi - s.from_offset
        if isinstance(s, QuantizedSnapshot):
            if (s.bits, s.group_size) != (self.bits, self.group_size):
                raise CacheError(f"snapshot quantized with bits={s.bits}, group_size={s.group_size}; "
                                 f"the cache uses bits={self.bits}, group_size={self.group_size}")
            cut = tuple(x[..., r0:r1, :] for x in s.keys + s.values)
            return cut[:3], cut[3:]  # type: ignore[return-value]
        k, v = s.keys[..., r0:r1, :], s.values[..., r0:r1, :]
        return quantize_rows(k, self.group_size, self.bits), quantize_rows(v, self.group_size, self.bits)

    def _usable(self, s: Snapshot) -> bool:
        """The schedule rule: quantized rows of another start, or unquantized rows at or past
        this cache's start, were computed under another attention and are not these rows."""
        check_snapshot(s, (QuantizedSnapshot, KVSnapshot), "QuantizedKVCache.restore")
        start = self.quantized_kv_start
        if isinstance(s, QuantizedSnapshot):
            return s.start == start
        return start < 0 or s.to_offset <= start

    def restore(self, snapshot: Optional[Snapshot], target: int) -> bool:
        """Bring the cache to ``target`` tokens.

        ``snapshot=None`` rewinds (any ``target <= offset``). A `QuantizedSnapshot` (same
        bits, group size and start) or a `KVSnapshot` (rows below this cache's start,
        quantized as they are copied) needs ``offset >= snapshot.from_offset`` and
        ``target <= snapshot.to_offset``. False, changing nothing, when unreachable or when
        the schedule rule forbids the rows.
        """
        if check_target(target) is None:
            return False
        if snapshot is None:
            if target > self.offset:
                return False
            self.offset = target
            return True
        return self.restore_chain([snapshot], target)

    def restore_chain(self, snapshots: Sequence[Snapshot], target: int) -> bool:
        """`restore` through adjacent snapshots ``[a, b), [b, c), ...`` in one copy (each a
        `QuantizedSnapshot` or a `KVSnapshot`). False, changing nothing, when unreachable."""
        target = check_target(target)
        if target is None:
            return False
        if not snapshots:
            return self.restore(None, target)
        usable = [self._usable(s) for s in snapshots]
        for a, b in zip(snapshots, snapshots[1:]):
            if a.to_offset != b.from_offset:
                raise CacheError(f"snapshots [{a.from_offset}, {a.to_offset}) and "
                                 f"[{b.from_offset}, {b.to_offset}) are not adjacent")
        start = snapshots[0].from_offset
        if self.offset < start or target > snapshots[-1].to_offset:
            return False
        if target <= start:
            return self.restore(None, target)
        parts = [[] for _ in range(6)]
        if start:
            for p, x in zip(parts, self.keys + self.values):
                p.append(x[..., :start, :])
        for s, ok in zip(snapshots, usable):
            if s.from_offset >= target:
                break
            if not ok:
                return False
            kq, vq = self._rows_of(s, s.from_offset, min(s.to_offset, target))
            like = self.keys + self.values if self.keys is not None else [p[0] for p in parts if p]
            for x, y in zip(kq + vq, like):
                if x.shape[:2] != y.shape[:2] or x.shape[3] != y.shape[3] or x.dtype != y.dtype:
                    raise CacheError(f"snapshot rows {tuple(x.shape)} {x.dtype} do not match "
                                     f"the cache's {tuple(y.shape)} {y.dtype}")
            for p, x in zip(parts, kq + vq):
                p.append(x)
        pad = self.step - target % self.step  # room to grow; never a bare snapshot array
        out = [mx.concatenate(p + [mx.zeros((*p[0].shape[:2], pad, p[0].shape[3]), p[0].dtype)], axis=2)
               for p in parts]
        self.keys, self.values = tuple(out[:3]), tuple(out[3:])  # type: ignore[assignment]
        self.offset = target
        return True

    merge = MergeDispatch()

    def merge_snapshots(self, parent: Snapshot, child: Snapshot) -> Optional[Snapshot]:
        """Concatenate adjacent ``[a, b)`` and ``[b, c)`` (see `merge_rows`); closes both."""
        return merge_rows(parent, child)

    def split(self, snapshot: QuantizedSnapshot, at: int):
        """Cut ``[a, c)`` into ``[a, at)`` and ``[at, c)``; takes ownership of the input."""
        return split_rows(snapshot, at)

    # -- restore along a stored prefix (`reach`) -----------------------------------------
    #: Kind rules (`reach`). Rows reach any offset, but only within the schedule they
    #: were made for, so prefill keeps its periodic snapshots.
    any_offset = False
    interval_cap = 0
    quantizable = True
    #: Why a restore landed short, in words (`prefix.explain`).
    restore_rule = "quantized KV rows restore only where the kv_bits schedule allows"

    def reach(self, spans: Sequence[Span], live_common: int, top: int, quant: Any = None) -> Reach:
        """Under ``quant`` (a `KVQuantization`): the rows valid for it; without one, only
        unquantized rows stored in the spans."""
        if quant is None:
            return UpTo(max(walk(spans, 0, top,
                                 lambda s: s.to_offset if isinstance(s, KVSnapshot) else -1), 0))
        return scheduled_reach(spans, top, quant, 0,
                               min(live_common, self.offset) if quant.owns(self) else 0)

    def restore_along(self, spans: Sequence[Span], t: int, live_common: int, room: int = 0) -> bool:
        """The live rows below the shared prefix, then the spans' KV-family rows up to ``t``
        (unquantized rows are quantized as they are copied; rows the schedule does not
        allow are refused)."""
        base = min(live_common, self.offset, t)
        if not self.restore(None, base):
            return False
        return self.restore_chain(chain(spans, base, t), t) and self.offset == t

    def targets(self, top: int) -> List[int]:
        return []

    def snapshot_rows(self, tokens: int) -> int:
        return tokens

    # -- mlx-lm face ------------------------------------------------------------------
    def dequantized_view(self) -> "DequantizedView":
        """This cache as a plain one for a forward pass of many tokens (`DequantizedView`)."""
        return DequantizedView(self)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    @property
    def state(self):
        """``(keys, values, offset, group_size, bits)``, mlx-lm's layout."""
        return self.keys, self.values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v) -> None:
        keys, values, offset, group_size, bits = v
        self.bits, self.group_size = check_quant(int(bits), int(group_size))
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)
        self.offset = int(offset)

    @classmethod
    def from_state(cls, state) -> "QuantizedKVCache":
        obj = cls(int(state[3]), int(state[4]))
        obj.state = state
        return obj

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`)."""
        return ["quantized", self.bits, self.group_size, self.quantized_kv_start]

    def arrays(self) -> List[mx.array]:
        """The arrays the cache holds now (to evaluate after a forward pass)."""
        return [] if self.keys is None else list(self.keys + self.values)

    def to_mlx(self) -> Any:
        """mlx-lm's ``QuantizedKVCache`` holding these rows, sharing the arrays."""
        n = mlc.QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is not None and self.offset:
            n.keys, n.values = self.keys_and_values()
            n.offset = self.offset
        return n

    def adopt_length(self, length: int, quant: Any = None) -> bool:
        """Made from mlx-lm's class (`from_mlx`), which does not record the schedule its
        rows follow: take ``quant``'s (a `KVQuantization`) when the settings match. Whether
        it holds exactly ``length`` tokens."""
        if (quant is not None and self.quantized_kv_start < 0
                and (self.bits, self.group_size) == (quant.bits, quant.group_size)):
            self.quantized_kv_start = quant.start
        return self.offset == length and self.keys is not None

    #: The mlx-lm class this one stands for (`factory.convert` turns one into the other).
    mlx_class = mlc.QuantizedKVCache

    @classmethod
    def from_mlx(cls, c: Any) -> "QuantizedKVCache":
        """Ours holding what mlx-lm's ``QuantizedKVCache`` ``c`` holds, sharing its arrays (no copy)."""
        out = cls(c.group_size, c.bits)
        if c.keys is not None:
            out.keys, out.values = tuple(c.keys), tuple(c.values)
        out.offset = int(c.offset)
        return out

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> Any:
        """The caches stacked into a left-padded quantized batch cache
        (`BatchQuantizedKVCache`; mlx-lm's own quantized cache does not batch)."""
        return BatchQuantizedKVCache.merge(caches)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, int(n))
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the live buffers (growth padding included)."""
        return 0 if self.keys is None else sum(x.nbytes for x in self.keys + self.values)

    def __repr__(self) -> str:
        return f"QuantizedKVCache(bits={self.bits}, group_size={self.group_size}, offset={self.offset})"


class DequantizedView:
    """A `QuantizedKVCache` as a model sees a plain KV cache, for one forward pass.

    Rows are written to the cache quantized, as always (what it stores does not change),
    and attention reads every row dequantized through the model's plain attention path
    (MLX's fused attention over float rows) instead of mlx-lm's quantized one: the same
    attention over the same quantized rows (a quantized matmul is a matmul with the
    dequantized matrix), only summed in another order. On MLX's CPU build the quantized
    path is several times slower for a pass of many tokens (a 2,435-token prefill of
    SmolLM2: 155 s against 43 s), where dequantizing the rows once costs little; for a
    one-token pass it is the faster one. Every attribute but ``bits`` / ``group_size`` (whose presence selects mlx-lm's
    quantized path) is the cache's own.
    """

    def __init__(self, cache: "QuantizedKVCache") -> None:
        self.cache = cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        kq, vq = self.cache.update_and_fetch(keys, values)
        g, b = self.cache.group_size, self.cache.bits
        return (mx.dequantize(*kq, group_size=g, bits=b),
                mx.dequantize(*vq, group_size=g, bits=b))

    def __getattr__(self, name: str) -> Any:
        if name in ("bits", "group_size"):
            raise AttributeError(name)
        return getattr(self.cache, name)


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
