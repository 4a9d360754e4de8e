"""What the server's prompt cache counts, and the row each rank of a sharded model shares.

`FetchCounters` are the prompt cache's totals since the server started: the fetches
mlx-lm made, their prompt tokens and how many of those were restored (from memory, from
disk); they only grow (``DELETE /v1/cache`` counts itself, it does not reset them).
Kept on the generation thread, read from any thread (each one an int: a read sees the
value before or after an increment, never a torn one).

`RankCounters` is one rank's row of ``GET /v1/cache``'s ``ranks`` on a sharded model: the
bytes and nodes it holds, what it evicted, and its fetch totals, packed for the one small
gather that brings every rank's row to rank 0 (`gather`).
"""

from __future__ import annotations

import struct
from dataclasses import asdict, astuple, dataclass, fields
from typing import Any, Dict, List

from ...prefix.agreement import Agreement

__all__ = ["FetchCounters", "RankCounters", "gather"]


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

    @property
    def ram_tokens(self) -> int:
        """Restored tokens that were in memory."""
        return self.cached_tokens - self.disk_tokens

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens restored instead of computed."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
