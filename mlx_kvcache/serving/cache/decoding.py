"""A batch request's decoding counters, from the engine to the prompt cache's log line.

When a row of mlx-lm's batch ends, the engine (`engine.lookup_batch`) hands its
`RequestStats` (tokens proposed by prompt lookup and accepted, forward passes) over
here under the cache list it ends with — the very list mlx-lm then inserts — and the
prompt cache takes them back at that insert (`take`) for the request's ``[cache]`` line
and ``GET /v1/cache``. Generation thread only; bounded (a row whose insert never comes
is forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

from ...prefix.stats import RequestStats

__all__ = ["ended", "take", "note", "summary"]

#: Rows ended and not inserted yet, at most.
PENDING = 64

_ended: "OrderedDict[int, Tuple[Any, RequestStats]]" = OrderedDict()


def ended(prompt_cache: Any, stats: RequestStats) -> None:
    """A batch row ended with the cache list ``prompt_cache``; its counters ``stats``."""
    _ended[id(prompt_cache)] = (prompt_cache, stats)
    while len(_ended) > PENDING:
        _ended.popitem(last=False)


def take(prompt_cache: Any) -> Optional[RequestStats]:
    """The counters of the row that ended with ``prompt_cache`` (once), or None."""
    hit = _ended.pop(id(prompt_cache), None)
    return hit[1] if hit is not None and hit[0] is prompt_cache else None


def note(st: RequestStats) -> str:
    """The ``[cache]`` line's part for a request's proposals: what prompt lookup and a
    draft model proposed and the model accepted, and the forward passes the answer took
    (and saved: one a token without proposals). Empty when nothing was proposed."""
    if not st.drafted_tokens:
        return ""
    out = ""
    own = ((st.lookup_drafted_tokens, st.lookup_accepted_tokens, "lookup drafted"),
           (st.drafted_tokens - st.lookup_drafted_tokens,
            st.accepted_tokens - st.lookup_accepted_tokens, "drafted"))
    for drafted, accepted, what in own:
        if drafted:
            out += f" | {what} {drafted} accepted {accepted}"
    if st.target_passes:
        out += f" | {st.target_passes} passes (saved {st.passes_saved})"
    return out


def summary(st: RequestStats) -> Dict[str, int]:
    """A request's proposals and passes, for ``GET /v1/cache``'s recent requests."""
    return {"drafted_tokens": st.drafted_tokens, "accepted_tokens": st.accepted_tokens,
            "lookup_drafted_tokens": st.lookup_drafted_tokens,
            "lookup_accepted_tokens": st.lookup_accepted_tokens,
            "forward_passes": st.target_passes, "passes_saved": st.passes_saved}
