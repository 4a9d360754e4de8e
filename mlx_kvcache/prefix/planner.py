"""Where a request lands and where its prefill stops: the trie-level restore rules.

What one layer reaches along a trie path is its cache class's rule (`caches.reach`: KV
layers reach any token the trie or the live cache holds, rotating layers a node end
holding their window or any point while it never wrapped, recurrent layers and classes
the package does not know only a node end holding their state, and full attention under
a ``kv_bits`` schedule and chunked attention rules of their own). This module hands each
layer its path (`spans`), lands a request on the deepest offset every layer reaches
(`choose_target`), and schedules a branch-point snapshot where it fell short (`stops`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..caches.reach import Reach, Span
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


def spans(path: List[TrieNode], i: int) -> List[Span]:
    """Layer ``i``'s view of ``path``: each node's ``(start, end, snapshot)``, the
    snapshot None where the node holds no live one for that layer."""
    return [(n.start, n.end, n.snapshots[i] if n.has_state(i) else None) for n in path]


def reach_table(leaves, path: List[TrieNode], live_common: int, top: int,
                quants=None) -> List[Reach]:
    """Per layer, what it can reach at or below ``top`` (computed once per request; each
    class's ``reach``; ``quants[i]``: the ``kv_bits`` schedule layer ``i`` follows)."""
    return [c.reach(spans(path, i), live_common, top, quants[i] if quants is not None else None)
            for i, c in enumerate(leaves)]


def restore_layer(c, i: int, t: int, path: List[TrieNode], live_common: int,
                  room: int = 0) -> bool:
    """Bring layer cache ``c`` (layer ``i``) to ``t`` from its live state and the path;
    ``room``: tokens the request will add next (a KV buffer is made that large at once)."""
    if t == 0:
        c.free()
        return True
    return c.restore_along(spans(path, i), t, live_common, room)


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
    cands.update(t for c in live.leaves for t in c.targets(top))
    ordered = sorted(cands, reverse=True)
    table = reach_table(live.leaves, path, live_common, top, live.leaf_quant())
    blocked = [next((i for i, e in enumerate(table) if not e.reaches(t)), None) for t in ordered]
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
          snapshot_interval: int, extra: Sequence[int] = (), known: Sequence[int] = (),
          guess_end: bool = True) -> List[int]:
    """Prefill offsets to snapshot at: a branch point where the restore fell short, a few
    tokens before the prompt's end, every ``snapshot_interval`` tokens (hybrid and
    sliding-window models only: KV layers reach any token from the end snapshot), and
    ``extra`` (e.g. chat message boundaries, an agent's ``cache_control``) on every model.
    ``known``: offsets of this prompt where the trie already holds a whole state.

    Each stop costs a prefill pass and a snapshot now. The two guessed ones are taken only
    where they can pay for themselves (`guess_spacing` tokens of recompute saved): the
    branch point only that far above the restore, every known state and every stop below
    it (an agent's next turn lands one token short of it); the stop before the end, which
    stands in for where the request's input ends, also not that near a stop the request
    asked for or an interval stop (an agent route marks its input's end), and not at all
    with ``guess_end`` False: the caller knows the next request goes on past this prompt's
    end (a chat template that re-renders its generation prompt as the answer's turn)."""
    out = {s for s in extra if restored < s <= n - 1}
    if not whole_state:
        return sorted(out)
    out.add(n - 1)  # where a re-sent identical prompt restores (mlx-lm splits it off anyway)
    if snapshot_interval > 0:
        out.update(range(snapshot_interval, n - 1, snapshot_interval))
    out = {s for s in out if restored < s <= n - 1}
    gap = guess_spacing(pre_end_margin, snapshot_interval)
    floor = [restored] + [k for k in known if k <= n - 1]

    def below(g: int) -> int:
        return max([k for k in floor if k <= g] + [s for s in out if s < g])
    if restored < matched <= n - 1 and matched - below(matched) >= gap:
        out.add(matched)  # branch point: the next divergence here restores exactly
    g = n - pre_end_margin
    if guess_end and restored < g and g - below(g) >= gap and all(abs(s - g) >= gap for s in out if s != n - 1):
        out.add(g)
    return sorted(out)


def guess_spacing(pre_end_margin: int, snapshot_interval: int = 0) -> int:
    """Tokens a guessed stop must save a later request to be taken: four times the margin
    (16 by default) — less recompute than that costs less than the stop's own pass and
    snapshot — or half the snapshot interval where that is smaller (an interval that
    short asks for dense checkpoints: short prompts, tests)."""
    gap = 4 * max(int(pre_end_margin), 1)
    if snapshot_interval > 0:
        gap = min(gap, max(snapshot_interval // 2, 1))
    return gap
