"""The rows of a full-attention layer, as snapshots hold them: `KVSnapshot` (plain rows)
and `QuantizedSnapshot` (quantized rows), the settings `mx.quantize` accepts, row-wise
quantization, and the split and merges of row deltas. A quantized snapshot, like a plain
one, is a delta of rows ``[a, b)`` that splits at any token and merges by concatenation
(quantization groups run along the head dimension, so every token's row is quantized on
its own).

Both cache classes of such a layer (`kv.KVCache`, `quantized.QuantizedKVCache`) restore,
merge and split both kinds of rows — a layer's nodes hold plain rows below the schedule's
switch and quantized rows above it — so the two snapshot kinds live here, below both."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import mlx.core as mx

from .buffers import SnapshotKV
from .checks import check_offset, check_snapshot
from .snapshot import CacheError, Snapshot, compact

#: Bit widths and group sizes `mx.quantize` accepts for the affine mode.
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_PARTS = ("w", "scales", "biases")

Triple = Tuple[mx.array, mx.array, mx.array]


def check_quant(bits: Any, group_size: Any) -> Tuple[int, int]:
    """``(bits, group_size)`` as ints, or `CacheError` naming what `mx.quantize` refuses."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise CacheError(f"kv bits must be one of {BITS}, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise CacheError(f"kv group size must be one of {GROUP_SIZES}, got {group_size!r}")
    return bits, group_size


class KVSnapshot(SnapshotKV, Snapshot):
    """Keys/values of the tokens ``[from_offset, to_offset)``, in their own compact buffers.

    A delta: restoring it needs the cache to already hold everything below ``from_offset``.
    """

    kind = "kv"
    needs_base = True

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            k, v = arrays["keys"], arrays["values"]
            a, b = int(meta["from_offset"]), int(meta["to_offset"])
        except KeyError as e:
            raise CacheError(f"kv snapshot is missing {e}") from None
        if k.ndim != 4 or v.ndim != 4 or k.shape[2] != b - a or v.shape[2] != b - a:
            raise CacheError(
                f"kv snapshot arrays {tuple(k.shape)} / {tuple(v.shape)} do not cover [{a}, {b})"
            )
        return cls(a, b, {"keys": k, "values": v})


def quantize_rows(x: mx.array, group_size: int, bits: int) -> Triple:
    """``x`` ``[B, H, L, D]`` quantized row by row (what mlx-lm's ``to_quantized`` does)."""
    if x.shape[-1] % group_size:
        raise CacheError(f"head dim {x.shape[-1]} is not a multiple of the kv group size {group_size}")
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))  # type: ignore[return-value]


class QuantizedSnapshot(Snapshot):
    """Quantized keys/values of the tokens ``[from_offset, to_offset)`` in compact buffers,
    with the quantization they were made with.

    ``start`` is the ``quantized_kv_start`` of the schedule that computed the rows (-1:
    unknown, e.g. rows quantized by mlx-lm's own chunk-dependent conversion).
    """

    kind = "quantized"
    needs_base = True

    def __init__(self, from_offset, to_offset, arrays, bits: int, group_size: int, start: int):
        super().__init__(from_offset, to_offset, arrays)
        self.bits, self.group_size, self.start = int(bits), int(group_size), int(start)

    @property
    def keys(self) -> Triple:
        return tuple(self._get("k." + p) for p in _PARTS)  # type: ignore[return-value]

    @property
    def values(self) -> Triple:
        return tuple(self._get("v." + p) for p in _PARTS)  # type: ignore[return-value]

    def meta(self):
        return {**super().meta(), "bits": self.bits, "group_size": self.group_size,
                "start": self.start}

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            a, b = int(meta["from_offset"]), int(meta["to_offset"])
            bits, group, start = int(meta["bits"]), int(meta["group_size"]), int(meta["start"])
            parts = {f"{s}.{p}": arrays[f"{s}.{p}"] for s in "kv" for p in _PARTS}
        except KeyError as e:
            raise CacheError(f"quantized snapshot is missing {e}") from None
        check_quant(bits, group)
        for name, x in parts.items():
            if x.ndim != 4 or x.shape[2] != b - a:
                raise CacheError(f"quantized snapshot array {name} {tuple(x.shape)} does not "
                                 f"cover [{a}, {b})")
        return cls(a, b, parts, bits, group, start)


def pack_rows(kq: Triple, vq: Triple) -> dict:
    """The arrays of a `QuantizedSnapshot` holding the quantized keys ``kq`` and values ``vq``."""
    return {**{"k." + p: x for p, x in zip(_PARTS, kq)}, **{"v." + p: x for p, x in zip(_PARTS, vq)}}


def split_rows(snapshot: QuantizedSnapshot, at: int):
    """`QuantizedSnapshot` ``[a, c)`` -> ``[a, at)``, ``[at, c)`` (rows are independent)."""
    check_snapshot(snapshot, QuantizedSnapshot, "QuantizedKVCache.split")
    at = check_offset("at", at)
    a, c = snapshot.from_offset, snapshot.to_offset
    if at <= a:
        return None, snapshot
    if at >= c:
        return snapshot, None
    r = at - a
    xs = snapshot.keys + snapshot.values
    head = [compact(x[..., :r, :]) for x in xs]
    tail = [compact(x[..., r:, :]) for x in xs]
    mx.eval(head, tail)
    snapshot.close()
    q = (snapshot.bits, snapshot.group_size, snapshot.start)
    return (QuantizedSnapshot(a, at, pack_rows(tuple(head[:3]), tuple(head[3:])), *q),
            QuantizedSnapshot(at, c, pack_rows(tuple(tail[:3]), tuple(tail[3:])), *q))


def merge_rows(parent: Snapshot, child: Snapshot) -> Optional[Snapshot]:
    """Merge adjacent KV-family snapshots where at least one is quantized; closes both.

    Two quantized ones with the same settings concatenate. Unquantized rows followed by
    quantized rows become quantized rows (quantized with the child's settings) when the
    unquantized rows all lie below the child's ``start`` — exactly what the schedule's
    conversion makes of them. Anything else (quantized rows followed by unquantized ones,
    other settings, unquantized rows past ``start``) has no valid merged form: None.
    """
    for s in (parent, child):
        check_snapshot(s, (QuantizedSnapshot, KVSnapshot), "QuantizedKVCache.merge")
    if parent.to_offset != child.from_offset:
        raise CacheError(f"cannot merge non-adjacent snapshots [{parent.from_offset}, "
                         f"{parent.to_offset}) and [{child.from_offset}, {child.to_offset})")
    out = None
    if isinstance(child, QuantizedSnapshot):
        q = (child.bits, child.group_size, child.start)
        if isinstance(parent, QuantizedSnapshot):
            ok = (parent.bits, parent.group_size, parent.start) == q
            head = parent.keys + parent.values
        else:
            ok = 0 <= child.start and parent.to_offset <= child.start
            head = None
            if ok:
                head = quantize_rows(parent.keys, child.group_size, child.bits) + \
                    quantize_rows(parent.values, child.group_size, child.bits)
        if ok:
            xs = [mx.concatenate([h, t], axis=2) for h, t in zip(head, child.keys + child.values)]
            mx.eval(xs)
            out = QuantizedSnapshot(parent.from_offset, child.to_offset,
                                    pack_rows(tuple(xs[:3]), tuple(xs[3:])), *q)
    parent.close()
    child.close()
    return out
