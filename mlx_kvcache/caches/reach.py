"""How far one layer can be brought back along a stored prefix: the restore reach each
cache kind reports to whoever stores its snapshots (the prefix trie).

The caller describes a prefix as *spans*: for one layer, in order from offset 0, each
stretch ``[start, end)`` of the prefix and the layer's snapshot at it (None where the
layer keeps none there). A KV-family snapshot covers its span exactly; a whole-state
snapshot (window, recurrent, a model's own class) is the state at ``end``. Nothing here
knows what holds the spans.

Each cache class answers, from its live state and the spans (docs/design.md, "Restore
reachability"):

* ``reach(spans, live_common, top, quant)`` — a `Reach`: the offsets at or below ``top``
  it can be restored to (``live_common``: how many of the request's tokens its live state
  shares; ``quant``: the `KVQuantization` schedule the layer follows, or None);
* ``restore_along(spans, t, live_common, room)`` — do it; False when ``t`` is unreachable;
* ``targets(top)`` — restore targets worth trying besides span ends (a chunk boundary);
* ``snapshot_rows(tokens)`` — how many tokens' worth of rows a snapshot at ``tokens`` holds;
* ``any_offset`` (class attribute) — a restore reaches every offset below a snapshot's end
  from the rows stored (plain KV): a prefill needs no periodic snapshots for this layer;
* ``interval_cap`` — snapshots at least this often keep every row the layer needs
  (0: no limit);
* ``quantizable`` — the ``kv_bits`` switch converts this layer (full attention).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Set, Tuple

from .snapshot import Snapshot

#: ``(start, end, snapshot or None)``: one stretch of a stored prefix, for one layer.
Span = Tuple[int, int, Optional[Snapshot]]


class Reach:
    """The offsets one layer can be restored to (at or below the request's ``top``)."""

    def reaches(self, t: int) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


class UpTo(Reach):
    """Every offset up to ``limit`` (full attention: rows paged in span after span)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def reaches(self, t: int) -> bool:
        return t <= self.limit


class Points(Reach):
    """Exactly the offsets in ``ends``, plus any offset up to ``any_below`` (a window that
    never wrapped)."""

    def __init__(self, ends: Set[int], any_below: int) -> None:
        self.ends, self.any_below = ends, any_below

    def reaches(self, t: int) -> bool:
        return t in self.ends or t <= self.any_below


class Scheduled(Reach):
    """Full attention under a ``kv_bits`` schedule switching at ``start``: any
    ``t <= min(kv_limit, start)`` from unquantized rows, any ``start < t <= q_limit`` from
    rows valid for the schedule (unquantized rows below ``start``, quantized rows of the
    same bits / group size / start)."""

    def __init__(self, kv_limit: int, start: int, q_limit: int) -> None:
        self.kv_limit, self.start, self.q_limit = kv_limit, start, q_limit

    def reaches(self, t: int) -> bool:
        return t == 0 or (t <= self.start and t <= self.kv_limit) or (
            self.start < t <= self.q_limit)


class Runs(Reach):
    """Chunked attention: any chunk boundary, and any ``t`` whose chunk rows
    ``[t - t % size, t)`` lie inside one run ``[lo, hi]`` of rows held."""

    def __init__(self, size: int, runs: List[List[int]]) -> None:
        self.size, self.runs = size, runs

    def reaches(self, t: int) -> bool:
        lo = t - t % self.size
        return lo == t or any(a <= lo and t <= b for a, b in self.runs)


def walk(spans: Sequence[Span], limit: int, top: int, serves: Callable[[Snapshot], int]) -> int:
    """How far contiguous rows reach from ``limit``, span after span; ``serves(snapshot)``
    is how far a span's rows may count (its end, or less; -1: not at all)."""
    for start, end, s in spans:
        if end <= limit:
            continue
        if start > limit or s is None:
            break
        hi = serves(s)
        if hi <= start:
            break
        limit = min(hi, end, top)
        if hi < end:
            break
    return limit


def scheduled_reach(spans: Sequence[Span], top: int, quant, live_kv: int, live_q: int) -> Scheduled:
    """The reach of a full-attention layer under the schedule ``quant`` (a
    `KVQuantization`), whose live rows serve unquantized up to ``live_kv`` and for the
    schedule up to ``live_q``."""
    kv_limit = walk(spans, live_kv, top, lambda s: s.to_offset if quant.serves_below(s) else -1)
    q_limit = walk(spans, live_q, top, quant.serves_above)
    return Scheduled(max(kv_limit, live_kv), quant.start, max(q_limit, live_q))


def chain(spans: Sequence[Span], base: int, t: int, kind: Optional[type] = None) -> List[Snapshot]:
    """The snapshots of the spans from ``base`` up to ``t`` (contiguous, each of class
    ``kind`` when given), to restore in one copy."""
    out: List[Snapshot] = []
    for start, end, s in spans:
        if end <= base:
            continue
        if start >= t or s is None or (kind is not None and not isinstance(s, kind)):
            break
        out.append(s)
        if end >= t:
            break
    return out


def whole_state_reach(offset: int, spans: Sequence[Span], live_common: int, top: int,
                      live_any: bool = False,
                      unwrapped: Callable[[Snapshot], bool] = lambda s: False) -> Points:
    """The reach of a layer that comes back only from a whole state: its live offset (when
    inside the shared prefix), and every span end holding its snapshot; ``live_any`` /
    ``unwrapped(snapshot)``: the live state / a snapshot also reaches any offset below
    (a window that never wrapped)."""
    ends = {0}
    any_below = 0
    if offset <= live_common:
        ends.add(offset)
        if live_any:
            any_below = offset
    for _, end, s in spans:
        if s is None:
            continue
        ends.add(end)
        if unwrapped(s):
            any_below = max(any_below, min(end, top))
    return Points(ends, any_below)


def restore_whole_state(cache, spans: Sequence[Span], t: int, live_common: int) -> bool:
    """Bring a whole-state layer to ``t``: its live state when it reaches, else the
    deepest span's snapshot that restores there."""
    if t <= live_common and cache.restore(None, t):
        return True
    for _, _, s in reversed(spans):
        if s is not None and cache.restore(s, t):
            return True
    return False


class WholeState:
    """The kind rules of a layer whose state comes back only whole, from a snapshot taken
    exactly there (recurrent state, a model's own class; a window refines them): reached
    at the span ends holding a state and at its live offset, one state's size at any
    offset. Expects ``offset`` and ``restore`` of the cache class."""

    any_offset = False
    interval_cap = 0
    quantizable = False

    def reach(self, spans: Sequence[Span], live_common: int, top: int, quant=None) -> Reach:
        """The span ends holding a state, and the live offset."""
        return whole_state_reach(self.offset, spans, live_common, top)  # type: ignore[attr-defined]

    def restore_along(self, spans: Sequence[Span], t: int, live_common: int, room: int = 0) -> bool:
        return restore_whole_state(self, spans, t, live_common)

    def targets(self, top: int) -> List[int]:
        return []

    def snapshot_rows(self, tokens: int) -> int:
        """One state, the same size at any offset."""
        return 1
