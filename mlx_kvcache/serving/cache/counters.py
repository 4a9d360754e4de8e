"""What the server's prompt cache counts, the row each rank of a sharded model shares,
and the one reading of every counter that ``GET /v1/cache`` and ``GET /metrics`` show.

`FetchCounters` are the prompt cache's totals since the server started: the fetches
mlx-lm made, their prompt tokens and how many of those were restored (from memory, from
disk); they only grow (``DELETE /v1/cache`` counts itself, it does not reset them).
Kept on the generation thread, read from any thread (each one an int: a read sees the
value before or after an increment, never a torn one).

`RankCounters` is one rank's row of ``GET /v1/cache``'s ``ranks`` on a sharded model: the
bytes and nodes it holds, what it evicted, and its fetch totals, packed for the one small
gather that brings every rank's row to rank 0 (`gather`).

`Reading` is every counter of the server at one moment, typed (as vLLM's
``PrefixCacheStats``): the prompt cache's totals and what it holds, the tokens foresight
computed ahead, and the guards' refusals and queue wait (`guards.counters`). One reading
makes both ``GET /v1/cache``'s ``counters`` (`Reading.as_dict`) and the families of
``GET /metrics`` (`routes.metrics`), so the two always agree. Nothing is counted per
cache namespace (`guards.counters` says why).
"""

from __future__ import annotations

import struct
from dataclasses import asdict, astuple, dataclass, fields
from typing import Any, Dict, List

from ...prefix.agreement import Agreement
from ..guards.counters import WaitReading

__all__ = ["FetchCounters", "RankCounters", "Reading", "gather"]


@dataclass
class FetchCounters:
    """The prompt cache's totals: ``requests`` (its fetches: one per request mlx-lm ran),
    their ``prompt_tokens``, the ``cached_tokens`` restored instead of computed (of which
    ``disk_tokens`` were read back from the disk tier) and ``clears`` (``DELETE
    /v1/cache``)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    disk_tokens: int = 0
    clears: int = 0

    def fetched(self, prompt_tokens: int, from_disk: int) -> None:
        """One fetch of ``prompt_tokens``, ``from_disk`` of them read back from disk."""
        self.requests += 1
        self.prompt_tokens += int(prompt_tokens)
        self.disk_tokens += int(from_disk)

    def restored(self, tokens: int) -> None:
        """A fetch restored ``tokens`` of its prompt (the caches it hands out hold them)."""
        self.cached_tokens += int(tokens)


@dataclass(frozen=True)
class RankCounters:
    """One rank's row: what it holds (``bytes_held``, ``nodes``, ``disk_bytes``), what
    it evicted, and its fetch totals."""

    bytes_held: int = 0
    nodes: int = 0
    disk_bytes: int = 0
    evicted_bytes: int = 0
    requests: int = 0
    cached_tokens: int = 0
    disk_tokens: int = 0

    def pack(self) -> bytes:
        """The row as the gather carries it (fixed size: every rank sends as much)."""
        return _ROW.pack(*astuple(self))

    @classmethod
    def unpack(cls, data: bytes) -> "RankCounters":
        return cls(*_ROW.unpack(data))

    def as_dict(self, rank: int) -> Dict[str, Any]:
        """The row as ``GET /v1/cache`` lists it under ``ranks``."""
        return {**asdict(self), "rank": rank}


_ROW = struct.Struct("<" + "q" * len(fields(RankCounters)))


def gather(agree: Agreement, mine: RankCounters) -> List[RankCounters]:
    """Every rank's row, in rank order (one small gather; every rank calls it at the
    same point)."""
    return [RankCounters.unpack(b) for b in agree.all_gather(mine.pack())]


@dataclass(frozen=True)
class Reading:
    """Every counter of the server at one moment (`TriePromptCache.counters_now`).

    Totals since start: ``requests`` (prompt-cache fetches: one per request the model
    ran), ``prompt_tokens``, of which ``computed_tokens`` were computed and
    ``restored_tokens`` restored from the cache (``disk_tokens`` of those read back from
    the disk tier); ``ahead_tokens`` computed ahead by foresight while the client was busy
    (``ahead_used_tokens`` of them read by the request they were computed for);
    ``evicted_bytes`` dropped by the memory budget; ``clears`` (``DELETE /v1/cache``);
    ``refusals`` by reason (`guards.counters.Refusal`); ``queue_wait``, the seconds each
    request waited to be taken by the generation thread. Now: ``ram_bytes`` (what the
    memory budget counts: snapshots and the caches lent to running requests),
    ``disk_bytes`` (the disk tier), ``nodes`` (the trie's)."""

    requests: int
    prompt_tokens: int
    computed_tokens: int
    restored_tokens: int
    disk_tokens: int
    ahead_tokens: int
    ahead_used_tokens: int
    evicted_bytes: int
    clears: int
    ram_bytes: int
    disk_bytes: int
    nodes: int
    refusals: Dict[str, int]
    queue_wait: WaitReading

    def as_dict(self) -> Dict[str, Any]:
        """``GET /v1/cache``'s ``counters``: the fields by name, the queue wait as
        ``{"buckets": [[upper bound, requests at most that long], ...], "count",
        "seconds"}``."""
        out = asdict(self)
        w = self.queue_wait
        out["queue_wait"] = {"buckets": [[b, n] for b, n in zip(w.bounds, w.cumulative)],
                             "count": w.count, "seconds": w.seconds}
        return out
