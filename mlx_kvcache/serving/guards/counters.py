"""What the guards count: requests refused before their answer started, by reason, and
how long requests waited for the generation thread to take them.

One `GuardCounters` per server: the app hands the same one to the memory guard (whose
admission line refuses for memory and times each request's wait: `admission`), to the
lifecycle (which refuses new requests while the server stops) and to the prompt cache,
whose reading of every counter (`cache.counters.Reading`) is what ``GET /v1/cache``'s
``counters`` and ``GET /metrics`` both show. Counted from any thread, read from any
thread (one lock; a count is an increment, a reading a copy).

No counter here is kept per cache namespace: a namespace's counts would tell whoever
reads them how much of its prompts other clients share (the leak namespaces exist to
close), its name is a client's secret (``cache_salt``) or derived from its API key, and
every new namespace would be a new time series (docs/serving.md, "Counters").
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Dict, Tuple

__all__ = ["GuardCounters", "QUEUE_WAIT_BUCKETS", "Refusal", "WaitReading"]


class Refusal(str, Enum):
    """Why a request was refused before its answer started."""

    #: 503: it waited ``--memory-wait`` for memory, or nothing running could free any.
    MEMORY = "memory"
    #: 400: it can never fit the memory limit (its prompt, or decoding its images).
    MEMORY_NEVER_FITS = "memory_never_fits"
    #: 503: it arrived while the server stops.
    STOPPING = "stopping"
    #: 400: its prompt is longer than the model's context.
    CONTEXT = "context"
    #: 400 / 413: the request itself is malformed (its body, a field, a template refusal).
    BAD_INPUT = "bad_input"


#: Upper bounds (seconds) of the queue-wait histogram's buckets: from a request taken at
#: the generation loop's next step to one that waited the memory guard's default 120 s.
QUEUE_WAIT_BUCKETS: Tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                         2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class WaitReading:
    """The queue-wait histogram at one moment: ``cumulative[i]`` requests waited at most
    ``bounds[i]`` seconds (Prometheus's ``le`` buckets; ``count`` is the ``+Inf`` one),
    ``seconds`` in all."""

    bounds: Tuple[float, ...]
    cumulative: Tuple[int, ...]
    count: int
    seconds: float


class GuardCounters:
    """Refusals by `Refusal`, and each request's wait between being queued and being
    taken by the generation thread."""

    def __init__(self, buckets: Tuple[float, ...] = QUEUE_WAIT_BUCKETS) -> None:
        self._mu = threading.Lock()
        self._refusals: Dict[Refusal, int] = {r: 0 for r in Refusal}
        self._bounds = tuple(sorted(float(b) for b in buckets))
        self._in_bucket = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._waits = 0
        self._waited = 0.0

    def refused(self, reason: Refusal) -> None:
        """Count one request refused for ``reason``."""
        with self._mu:
            self._refusals[reason] += 1

    def refusals(self, reason: Refusal) -> int:
        """Requests refused for ``reason`` so far."""
        with self._mu:
            return self._refusals[reason]

    def by_reason(self) -> Dict[str, int]:
        """Every reason's count, by its name (each reason listed, counted or not)."""
        with self._mu:
            return {r.value: n for r, n in self._refusals.items()}

    def waited(self, seconds: float) -> None:
        """Count one request taken after waiting ``seconds`` in the queue."""
        seconds = max(float(seconds), 0.0)
        with self._mu:
            self._in_bucket[bisect.bisect_left(self._bounds, seconds)] += 1
            self._waits += 1
            self._waited += seconds

    def queue_wait(self) -> WaitReading:
        """The queue-wait histogram now."""
        with self._mu:
            cumulative, n = [], 0
            for c in self._in_bucket[:-1]:
                n += c
                cumulative.append(n)
            return WaitReading(self._bounds, tuple(cumulative), self._waits, self._waited)
