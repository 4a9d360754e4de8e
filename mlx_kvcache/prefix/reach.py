"""Trie-level reach and restore for the kinds beyond plain KV, window and recurrent
layers: full-attention layers under a `KVQuantization` schedule, and chunked attention.

Reach-table entries (see `planner.reach_table`), per layer:

* ``("kvq", kv_limit, start, q_limit)`` — a full-attention layer under a quantization
  schedule: any ``t <= min(kv_limit, start)`` from unquantized rows, any
  ``start < t <= q_limit`` from rows valid for the schedule (unquantized rows below
  ``start``, quantized rows of the same bits / group size / start);
* ``("chunked", chunk_size, runs)`` — a chunked-attention layer: any chunk boundary,
  and any ``t`` whose chunk rows ``[t - t % C, t)`` lie inside one run ``[lo, hi]`` of
  rows held by the live cache or the path's snapshots.

The rules themselves are the schedule's (`caches.schedule`) and the chunked cache's
(`caches.chunked`); this module applies them along a trie path.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from ..caches.chunked import ChunkedKVCache, ChunkedSnapshot
from ..caches.kv import KVCache, KVSnapshot
from ..caches.quantized import QuantizedKVCache
from ..caches.schedule import KVQuantization
from .node import TrieNode


def _walk(path: List[TrieNode], i: int, limit: int, top: int,
          serves: Callable[[object], int]) -> int:
    """How far contiguous rows reach from ``limit``, node after node along ``path``;
    ``serves(snapshot)`` is how far a node's rows may count (its end, or less)."""
    for n in path:
        if n.end <= limit:
            continue
        if n.start > limit or not n.has_state(i):
            break
        hi = serves(n.snapshots[i])
        if hi <= n.start:
            break
        limit = min(hi, n.end, top)
        if hi < n.end:
            break
    return limit


def kv_entry(c, i: int, path: List[TrieNode], live_common: int, top: int,
             quant: Optional[KVQuantization]):
    """The reach of a full-attention layer (`KVCache` or `QuantizedKVCache`)."""
    if quant is None:
        live = min(live_common, c.offset) if isinstance(c, KVCache) else 0
        limit = _walk(path, i, live, top, lambda s: s.to_offset if isinstance(s, KVSnapshot) else -1)
        return ("kv", max(limit, live))
    if isinstance(c, QuantizedKVCache):
        live_kv, live_q = 0, (min(live_common, c.offset) if quant.owns(c) else 0)
    else:
        live_kv = min(live_common, c.offset)
        live_q = min(live_kv, quant.start)
    kv_limit = _walk(path, i, live_kv, top, lambda s: s.to_offset if quant.serves_below(s) else -1)
    q_limit = _walk(path, i, live_q, top, quant.serves_above)
    return ("kvq", max(kv_limit, live_kv), quant.start, max(q_limit, live_q))


def chunked_entry(c: ChunkedKVCache, i: int, path: List[TrieNode], live_common: int, top: int):
    """The reach of a chunked-attention layer: the runs of rows it can assemble."""
    spans = []
    live = min(live_common, c.offset)
    if c.keys is not None and c.start_position < live:
        spans.append((c.start_position, live))
    for n in path:
        if n.start >= top:
            break
        if n.has_state(i) and isinstance(n.snapshots[i], ChunkedSnapshot):
            lo, hi = n.snapshots[i].rows_from, min(n.end, top)
            if lo < hi:
                spans.append((lo, hi))
    runs: List[List[int]] = []
    for lo, hi in sorted(spans):
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return ("chunked", c.chunk_size, runs)


def candidates(leaves, top: int) -> List[int]:
    """Restore targets worth trying besides node ends: the last chunk boundary at or below
    ``top`` (a chunked layer needs no rows there). Structural only, so every rank of a
    sharded model lists the same."""
    return sorted({top - top % c.chunk_size for c in leaves if isinstance(c, ChunkedKVCache)})


def reachable(entry, t: int) -> Optional[bool]:
    """Whether an entry of this module's kinds reaches ``t`` (None: not one of them)."""
    kind = entry[0]
    if kind == "kvq":
        _, kv_limit, start, q_limit = entry
        return t == 0 or (t <= start and t <= kv_limit) or (start < t <= q_limit)
    if kind == "chunked":
        _, size, runs = entry
        lo = t - t % size
        return lo == t or any(a <= lo and t <= b for a, b in runs)
    return None


def restore_quantized(c: QuantizedKVCache, i: int, t: int, path: List[TrieNode],
                      live_common: int) -> bool:
    """Bring a quantized layer to ``t`` from its live rows and the path's KV-family
    snapshots (unquantized rows are quantized as they are copied; the cache refuses rows
    its schedule does not allow)."""
    base = min(live_common, c.offset, t)
    if not c.restore(None, base):
        return False
    chain = []
    for n in path:
        if n.end <= base:
            continue
        if n.start >= t or not n.has_state(i):
            break
        chain.append(n.snapshots[i])
        if n.end >= t:
            break
    return c.restore_chain(chain, t) and c.offset == t


def restore_chunked(c: ChunkedKVCache, i: int, t: int, path: List[TrieNode],
                    live_common: int) -> bool:
    """Bring a chunked layer to ``t``: a chunk boundary, or the chunk's rows from the
    live cache (below ``live_common``) and the path's snapshots."""
    if t % c.chunk_size == 0:
        return c._assemble([], t)
    snaps = [n.snapshots[i] for n in path
             if n.start < t and n.has_state(i) and isinstance(n.snapshots[i], ChunkedSnapshot)]
    return c.restore_rows(snaps, t, min(live_common, t)) and c.offset == t
