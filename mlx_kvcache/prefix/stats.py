"""Per-request and cumulative reuse statistics."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class RequestStats:
    """What one request reused and computed.

    ``matched_tokens`` is the longest prompt prefix found in the trie;
    ``restored_tokens`` what the caches were actually brought to (lower when a
    recurrent or wrapped-window layer has no state at the match point, or when a full
    hit holds back one token); ``reason`` says why restored < matched.
    """

    prompt_tokens: int = 0
    matched_tokens: int = 0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    #: Restored tokens that came from the disk tier (nodes held on disk only, read and
    #: checked for this request); ``ram_tokens`` the rest.
    disk_tokens: int = 0
    reason: Optional[str] = None
    snapshots_taken: int = 0
    #: Planned prefill snapshots left out because the byte budget had no room for them.
    snapshots_skipped: int = 0
    #: Seconds from the request's start to the first generated token.
    time_to_first_token: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    #: Bytes the cache holds (snapshots and live caches) after the request / while it runs.
    cache_bytes: int = 0
    finish_reason: Optional[str] = None
    #: Speculative decoding: tokens proposed (by prompt lookup or a draft model) and how
    #: many of them the target accepted; ``lookup_*``: prompt lookup's share.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookup_drafted_tokens: int = 0
    lookup_accepted_tokens: int = 0
    #: Forward passes of the target while decoding (one per generated token in plain
    #: decoding), rollback replays included.
    target_passes: int = 0
    #: Tokens fed to the target a second time because a layer that cannot rewind was
    #: restored from its pre-verify snapshot.
    replayed_tokens: int = 0
    #: Where reuse stopped and why: the divergence, the text on both sides of it, the rule
    #: that cost tokens (`mlx_kvcache.prefix.explain.Reuse`; None without a trie).
    reuse: Optional[Any] = None

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not recomputed (same as ``restored_tokens``)."""
        return self.restored_tokens

    @property
    def ram_tokens(self) -> int:
        """Restored tokens that were in memory."""
        return self.restored_tokens - self.disk_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 without drafting)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def passes_saved(self) -> int:
        """Forward passes of the target that plain decoding would have run more (one per
        generated token): what accepted proposals saved, less what rollback replays cost."""
        return max(0, self.generated_tokens - self.target_passes) if self.target_passes else 0


@dataclass
class CacheStats:
    """Totals over every request a `PrefixCache` served, and what it holds now.

    ``bytes_held`` is everything ``max_bytes`` bounds: ``snapshot_bytes`` (the trie's
    snapshots in memory) plus ``live_bytes`` (the caches requests run on, and the idle set
    kept for the next turn). ``disk_bytes`` is the disk tier (``max_disk_bytes``), whose
    nodes ``disk_nodes`` are on disk only; ``disk_tokens`` counts restored tokens that
    came from there, ``demoted_bytes`` / ``promoted_bytes`` what moved between the tiers.
    """

    requests: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    disk_tokens: int = 0
    snapshots_taken: int = 0
    snapshots_skipped: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookup_drafted_tokens: int = 0
    lookup_accepted_tokens: int = 0
    passes_saved: int = 0
    evicted_bytes: int = 0
    bytes_held: int = 0
    snapshot_bytes: int = 0
    live_bytes: int = 0
    nodes: int = 0
    max_bytes: int = 0
    disk_bytes: int = 0
    max_disk_bytes: Optional[int] = None
    disk_nodes: int = 0
    demoted_bytes: int = 0
    promoted_bytes: int = 0

    @property
    def ram_tokens(self) -> int:
        """Restored tokens that were in memory."""
        return self.restored_tokens - self.disk_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens restored instead of recomputed."""
        return self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, r: RequestStats) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.matched_tokens += r.matched_tokens
        self.restored_tokens += r.restored_tokens
        self.disk_tokens += r.disk_tokens
        self.prefilled_tokens += r.prefilled_tokens
        self.generated_tokens += r.generated_tokens
        self.snapshots_taken += r.snapshots_taken
        self.snapshots_skipped += r.snapshots_skipped
        self.drafted_tokens += r.drafted_tokens
        self.accepted_tokens += r.accepted_tokens
        self.lookup_drafted_tokens += r.lookup_drafted_tokens
        self.lookup_accepted_tokens += r.lookup_accepted_tokens
        self.passes_saved += r.passes_saved


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (for status lines and logs)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(s: str) -> int:
    """'512M', '2GiB', '1.5g', '4GB', '1000000' -> bytes: K/M/G/T and KiB/MiB/GiB/TiB are
    powers of 1024, KB/MB/GB/TB powers of 1000 (every byte option of ``chat`` and ``serve``
    reads sizes this way). Raises ``argparse.ArgumentTypeError`` naming the value."""
    import argparse

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {s!r} (try 512M, 2G, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
