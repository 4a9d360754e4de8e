"""Where a request lands and where its prefill stops: the trie-level restore rules.

KV layers reach any token the trie or the live cache holds (node after node, each KV
snapshot extending the prefix below it); rotating layers reach a node end holding their
window, or any point while the window never wrapped; recurrent layers reach only a node
end holding their state, and so do layers of classes the package does not know (their
`GenericCache` adapters). Full-attention layers under a ``kv_bits`` schedule and chunked
attention have rules of their own (`reach`). A request lands on the deepest offset every
layer reaches (`plan_restore`), and schedules a branch-point snapshot where it fell short
(`stops`). The per-class rules these build on are each cache class's ``restore``
(docs/design.md).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..caches.chunked import ChunkedKVCache
from ..caches.kv import KVCache, KVSnapshot
from ..caches.quantized import QuantizedKVCache
from ..caches.rotating import RotatingKVCache, RotatingSnapshot
from . import reach
from .agreement import SOLO, Agreement
from .live import LiveSet
from .node import TrieNode
from .tokens import common_prefix

log = logging.getLogger("mlx_kvcache")


@dataclass
class Plan:
    """Where a request landed and where its prefill must stop."""

    prompt_tokens: int
    matched: int
    restored: int
    reason: Optional[str]
    #: Offsets (ascending, in ``(restored, prompt_tokens - 1]``) where prefill must stop
    #: so the caches can be snapshotted there.
    stops: List[int] = field(default_factory=list)
    #: Restored tokens that came from nodes held on disk only (the rest from memory).
    from_disk: int = 0


def reach_table(leaves, path: List[TrieNode], live_common: int, top: int, quants=None):
    """Per layer, what it can reach at or below ``top`` (computed once per request).

    Returns, per layer, either ``("kv", limit)`` — every offset up to ``limit`` — or
    ``("points", ends, any_below)`` — exactly the offsets in ``ends``, plus any offset up
    to ``any_below`` (an unwrapped window) — or one of `reach`'s entries (full attention
    under a ``kv_bits`` schedule, ``quants[i]``; chunked attention).
    """
    table = []
    for i, c in enumerate(leaves):
        quant = quants[i] if quants is not None else None
        if isinstance(c, (KVCache, QuantizedKVCache)) and (quant is not None or not isinstance(c, KVCache)):
            table.append(reach.kv_entry(c, i, path, live_common, top, quant))
            continue
        if isinstance(c, ChunkedKVCache):
            table.append(reach.chunked_entry(c, i, path, live_common, top))
            continue
        if isinstance(c, KVCache):
            limit = live_common
            for n in path:  # the trie pages in node after node above the live prefix
                if n.end <= limit:
                    continue
                if n.start > limit or not n.has_state(i) or not isinstance(n.snapshots[i], KVSnapshot):
                    break
                limit = min(n.end, top)
            table.append(("kv", max(limit, live_common)))
            continue
        ends = {0}
        any_below = 0
        if c.offset <= live_common:
            ends.add(c.offset)
            if isinstance(c, RotatingKVCache) and not c.wrapped:
                any_below = c.offset
        for n in path:
            if not n.has_state(i):
                continue
            s = n.snapshots[i]
            ends.add(n.end)
            if isinstance(s, RotatingSnapshot) and not s.wrapped:
                any_below = max(any_below, min(n.end, top))
        table.append(("points", ends, any_below))
    return table


def reachable(entry, t: int) -> bool:
    other = reach.reachable(entry, t)
    if other is not None:
        return other
    if entry[0] == "kv":
        return t <= entry[1]
    return t in entry[1] or t <= entry[2]


def restore_layer(c, i: int, t: int, path: List[TrieNode], live_common: int,
                  room: int = 0) -> bool:
    """Bring layer cache ``c`` (layer ``i``) to ``t`` from its live state and the path;
    ``room``: tokens the request will add next (a KV buffer is made that large at once)."""
    if t == 0:
        c.free()
        return True
    if isinstance(c, QuantizedKVCache):
        return reach.restore_quantized(c, i, t, path, live_common)
    if isinstance(c, ChunkedKVCache):
        return reach.restore_chunked(c, i, t, path, live_common)
    if t <= live_common and c.restore(None, t):
        return True
    if isinstance(c, KVCache):
        if not c.restore(None, min(live_common, t, c.offset)):
            return False
        chain = []  # the path's KV deltas from the live prefix up to t, restored in one copy
        for n in path:
            if n.end <= c.offset:
                continue
            if n.start >= t or not n.has_state(i) or not isinstance(n.snapshots[i], KVSnapshot):
                break
            chain.append(n.snapshots[i])
            if n.end >= t:
                break
        return c.restore_chain(chain, t, room=room) and c.offset == t
    for n in reversed(path):
        if n.has_state(i) and c.restore(n.snapshots[i], t):
            return True
    return False


def choose_target(live: LiveSet, tokens: np.ndarray, path: List[TrieNode], matched: int,
                  agree: Agreement = SOLO) -> Tuple[int, int, int, Optional[str]]:
    """``(target, top, live_common, reason)``: the deepest offset every layer reaches —
    on every rank, when the layers are spread over several (``agree``). ``tokens`` is
    the prompt as an array (`tokens.as_tokens`)."""
    n = len(tokens)
    live_common = min(common_prefix(live.tokens, tokens), n - 1)
    if not live.consistent(len(live.tokens)):
        live_common = 0
    top = max(matched, live_common)
    cands = {top, 0, live_common}
    cands.update(nd.end for nd in path if nd.end <= top)
    cands.update(reach.candidates(live.leaves, top))
    ordered = sorted(cands, reverse=True)
    table = reach_table(live.leaves, path, live_common, top, live.leaf_quant())
    blocked = [next((i for i, e in enumerate(table) if not reachable(e, t)), None) for t in ordered]
    ok = [int(b is None) for b in blocked]
    if agree.size > 1:
        ok = _agreed(agree, ordered, ok)
    reason = None
    if not ok[0]:
        i = blocked[0]
        name = getattr(live.leaves[i], "cls", type(live.leaves[i]).__name__) if i is not None else ""
        reason = (f"layer {i} ({name}) has no state at offset {top}"
                  if i is not None else f"another rank has no state at offset {top}")
        reason += "; restored to the deepest offset every layer reaches"
    t = next(t for t, good in zip(ordered, ok) if good)  # 0 is always reachable
    return t, top, live_common, (None if t >= top else reason)


#: Reachable bits per reduction in `_agreed` (with its header: 64 values a collective).
_AGREE_BITS = 58


def _agreed(agree: Agreement, ordered: List[int], ok: List[int]) -> List[int]:
    """The candidates every rank reaches. Ranks with identical tries list identical
    candidates; if they ever do not, all fall back to offset 0 (never a mismatch).

    One reduction of a fixed-size vector whatever the candidates: the list's length and a
    hash of it, each with its negation (so one ``all_min`` also yields the maximum: the
    ranks know whether they all listed the same), then the reachable bits. A path with
    more candidates than fit takes more reductions, only once every rank knows they all
    agree on the length (every rank issues the same collectives)."""
    n = len(ordered)
    digest = hashlib.blake2b(np.asarray(ordered, dtype=np.int64).tobytes(), digest_size=7)
    h = int.from_bytes(digest.digest(), "little")

    def bits(start: int) -> List[int]:
        part = list(ok[start: start + _AGREE_BITS])
        return part + [1] * (_AGREE_BITS - len(part))
    got = agree.all_min([n, -n, h, -h] + bits(0))
    if got[0] != -got[1] or got[2] != -got[3]:
        log.error("mlx_kvcache: ranks disagree on the prefix trie; recomputing from offset 0")
        return [int(t == 0) for t in ordered]
    out = got[4:]
    for start in range(_AGREE_BITS, n, _AGREE_BITS):
        out += agree.all_min(bits(start))
    return [int(v) for v in out[:n]]


def stops(n: int, restored: int, matched: int, *, whole_state: bool, pre_end_margin: int,
          snapshot_interval: int, extra: Sequence[int] = ()) -> List[int]:
    """Prefill offsets to snapshot at: a branch point where the restore fell short, a few
    tokens before the prompt's end, every ``snapshot_interval`` tokens (hybrid and
    sliding-window models only: KV layers reach any token from the end snapshot), and
    ``extra`` (e.g. chat message boundaries) on every model."""
    out = {s for s in extra if restored < s <= n - 1}
    if whole_state:
        out |= {n - 1, n - pre_end_margin}
        if restored < matched:
            out.add(matched)  # branch point: the next divergence here restores exactly
        if snapshot_interval > 0:
            out.update(range(snapshot_interval, n - 1, snapshot_interval))
    return sorted(s for s in out if restored < s <= n - 1)
