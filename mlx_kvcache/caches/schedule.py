"""`KVQuantization`: when and how full-attention layers switch to quantized rows.

The settings are mlx-lm's (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``); the
switch point is not. mlx-lm converts a cache after the first prefill *chunk* whose end
reaches ``quantized_kv_start``, so its answers depend on how the prompt was chunked — and
so on any reuse. Here the schedule is canonical and chunk-independent:

* rows at positions ``p < start`` are computed with an unquantized cache;
* the cache converts exactly when its offset reaches ``start`` (prefill stops there), and
  every later row is written quantized, attending to quantized rows.

An answer then never depends on chunking or on where a restore landed, and every row the
trie stores is valid for every later request with the same ``(bits, group_size, start)``.
Which stored rows serve which restore target follows (`serves_below` / `serves_above`):

* an unquantized (`KVSnapshot`) row was computed before any switch, so it serves targets
  ``t <= start`` as it is and targets ``t > start`` after quantization (what the switch
  itself does to it: rows are quantized one by one) — but only if it lies below ``start``;
* a quantized (`QuantizedSnapshot`) row serves only targets ``t > start``, and only with
  the same ``(bits, group_size, start)``: below ``start`` the cold run holds the original
  rows, which dequantized rows are not.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, List, Optional

from .kv import KVCache, KVSnapshot
from .quantized import QuantizedKVCache, QuantizedSnapshot, check_quant
from .snapshot import CacheError, Snapshot


@dataclass(frozen=True)
class KVQuantization:
    """Quantized KV for full-attention layers from token ``start`` on.

    Only `KVCache` layers convert (as in mlx-lm, whose rotating caches refuse and whose
    recurrent and chunked caches have no quantized form); the others stay in full precision.
    """

    bits: int
    group_size: int = 64
    start: int = 5000

    def __post_init__(self) -> None:
        check_quant(self.bits, self.group_size)
        if isinstance(self.start, bool) or not isinstance(self.start, numbers.Integral) or self.start < 0:
            raise CacheError(f"quantized_kv_start must be an int >= 0, got {self.start!r}")

    @classmethod
    def of(cls, bits: Optional[int], group_size: int = 64, start: int = 5000) -> Optional["KVQuantization"]:
        """The schedule for mlx-lm-style arguments (None when ``bits`` is None)."""
        return None if bits is None else cls(bits, group_size, start)

    def signature(self) -> List[Any]:
        return ["quantized", self.bits, self.group_size, self.start]

    # -- the reuse rules --------------------------------------------------------------
    def serves_below(self, snap: Snapshot) -> bool:
        """Whether ``snap``'s rows may serve a target ``t <= start`` (unquantized rows only)."""
        return isinstance(snap, KVSnapshot)

    def serves_above(self, snap: Snapshot) -> int:
        """How far ``snap``'s rows may serve a target ``t > start``: its end, or ``start``
        for unquantized rows reaching past it, or -1 (not at all)."""
        if isinstance(snap, QuantizedSnapshot):
            ok = (snap.bits, snap.group_size, snap.start) == (self.bits, self.group_size, self.start)
            return snap.to_offset if ok else -1
        if isinstance(snap, KVSnapshot):
            return min(snap.to_offset, self.start)
        return -1

    def owns(self, c: QuantizedKVCache) -> bool:
        """Whether a live quantized cache follows this schedule (its rows serve ``t > start``)."""
        return (c.bits, c.group_size, c.quantized_kv_start) == (self.bits, self.group_size, self.start)

    # -- the switch -------------------------------------------------------------------
    def quantize(self, c: KVCache) -> QuantizedKVCache:
        """``c``'s rows quantized, as a cache following this schedule."""
        q = c.to_quantized(group_size=self.group_size, bits=self.bits)
        q.quantized_kv_start = self.start
        return q

    def convert(self, caches: List[Any]) -> bool:
        """Replace, in place, every top-level `KVCache` whose offset reached ``start`` by its
        quantized form (call before every forward pass). True when something changed."""
        changed = False
        for i, c in enumerate(caches):
            if type(c) is KVCache and c.offset >= self.start:
                caches[i] = self.quantize(c)
                changed = True
        return changed

    def align(self, caches: List[Any], target: int) -> bool:
        """Before a restore to ``target``: give each convertible layer the class that target
        needs — quantized past ``start``, unquantized at or below it (a live quantized
        cache's rows cannot serve there, so it is replaced by an empty `KVCache`).
        True when something changed."""
        changed = False
        for i, c in enumerate(caches):
            if target > self.start and type(c) is KVCache:
                if c.offset > self.start:  # unquantized rows past start are not this schedule's
                    c.restore(None, self.start)
                caches[i] = self.quantize(c)
                changed = True
            elif target <= self.start and isinstance(c, QuantizedKVCache):
                caches[i] = KVCache()
                changed = True
            elif isinstance(c, QuantizedKVCache) and not self.owns(c):
                caches[i] = QuantizedKVCache(self.group_size, self.bits, self.start)
                changed = True
        return changed
