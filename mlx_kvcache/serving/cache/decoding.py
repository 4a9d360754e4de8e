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
from typing import Any, Optional, Tuple

from ...prefix.stats import RequestStats

__all__ = ["ended", "take"]

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
