"""The one log line per request a server writes: prompt, cached, prefilled and answer
tokens (``[cache] ...``), kept from the request's fetch to its final insert."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional

from ..prefix.stats import human_bytes


@dataclass
class Fetch:
    """What a fetch did, kept until the request's final insert logs it."""

    prompt: List[int]
    matched: int
    cached: int
    reason: Optional[str]


class RequestLog:
    """The fetches whose requests have not ended yet (at most ``limit``, oldest dropped)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._fetches: "OrderedDict[int, Fetch]" = OrderedDict()
        self._seq = 0

    def fetched(self, prompt: List[int], matched: int, cached: int, reason: Optional[str]) -> None:
        self._seq += 1
        self._fetches[self._seq] = Fetch(prompt, matched, cached, reason)
        while len(self._fetches) > self.limit:
            self._fetches.popitem(last=False)

    def final_of(self, tokens: List[int]) -> Optional[int]:
        """The fetch whose prompt ``tokens`` extend (the request's final insert), if any."""
        for key, f in reversed(self._fetches.items()):
            if len(tokens) >= len(f.prompt) and tokens[: len(f.prompt)] == f.prompt:
                return key
        return None

    def line(self, key: int, tokens: List[int], held: int, max_bytes: int, where: str = "") -> str:
        """The request's line (its fetch is forgotten): ``tokens`` are prompt plus answer."""
        f = self._fetches.pop(key)
        line = (f"[cache] {where}prompt {len(f.prompt)} tok | cached {f.cached} | prefilled "
                f"{len(f.prompt) - f.cached} | answer {len(tokens) - len(f.prompt)} tok | "
                f"held {human_bytes(held)} of {human_bytes(max_bytes)}")
        if f.matched > f.cached + 1 and f.reason:
            line += f" (matched {f.matched}: {f.reason})"
        return line
