"""The prefix-cache manager (layer 3): what to restore, where to snapshot, what to keep.

It owns one model's live caches and the trie of their snapshots, but never runs the
model: the generation layer asks it to `begin` a request (restore the caches for a
prompt and get the offsets to stop at), to `checkpoint` when the caches reach one, and
to `finish` with the tokens the caches absorbed.

The restore rules (docs/design.md) live in `_reachable` and `_restore_layer`:
KV layers reach any token the trie or the live cache holds; rotating layers reach a
node end holding their window (any point while the window never wrapped); recurrent
layers only a node end holding their state. A request lands on the deepest offset
every layer reaches, and schedules a branch-point snapshot where it fell short.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx

from ..caches.factory import leaf_caches
from ..caches.kv import KVCache
from ..caches.recurrent import RecurrentCache
from ..caches.rotating import RotatingKVCache, RotatingSnapshot
from .trie import PrefixTrie, TrieNode

log = logging.getLogger("mlx_kvcache")


@dataclass
class Plan:
    """What `PrefixManager.begin` did for a prompt."""

    prompt_tokens: int
    matched: int
    restored: int
    reason: Optional[str]
    #: Offsets (ascending, in ``(restored, prompt_tokens - 1]``) where prefill must stop
    #: so the caches can be snapshotted there.
    stops: List[int] = field(default_factory=list)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def default_max_bytes(fraction: float = 0.2) -> int:
    """A fraction of the machine's memory (unified memory on Apple silicon)."""
    total = 0
    try:
        if mx.metal.is_available():
            total = int(mx.metal.device_info().get("memory_size", 0))
    except Exception:  # pragma: no cover - device query is best effort
        total = 0
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover
            total = 16 << 30
    return int(total * fraction)


class PrefixManager:
    """Live caches + trie for one model; one request at a time (callers serialise).

    Args:
        caches: the model's cache list (from `mlx_kvcache.make_prompt_cache`).
        max_bytes: budget for every byte of snapshots the trie holds.
        pre_end_margin: snapshot this many tokens before a prompt's end (hybrid and
            sliding-window models), so a retried answer or a re-rendered assistant
            turn still lands on a snapshot.
        snapshot_interval: also snapshot every this many prompt tokens (hybrid and
            sliding-window models), bounding the recompute after any divergence.
        merge_below: a plain node shorter than this is merged into its single new child
            (cheap, avoids a chain of tiny nodes); longer ones stay until eviction.
    """

    def __init__(
        self,
        caches: List,
        *,
        max_bytes: int,
        pre_end_margin: int = 4,
        snapshot_interval: int = 2048,
        merge_below: int = 256,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.caches = caches
        self.leaves = leaf_caches(caches)
        self.trie = PrefixTrie(self.leaves)
        self.max_bytes = int(max_bytes)
        self.pre_end_margin = int(pre_end_margin)
        self.snapshot_interval = int(snapshot_interval)
        self.merge_below = int(merge_below)
        #: Whether some layer can only come back from a snapshot at a node end.
        self.whole_state = any(not isinstance(c, KVCache) for c in self.leaves)
        #: Tokens the live caches hold (their common offset is its length).
        self.live_tokens: List[int] = []
        # Nodes that are deliberate restore points (never merged away except by eviction).
        self._keep: set = set()

    # -- consistency ---------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return min((c.offset for c in self.leaves), default=0)

    def consistent(self, length: int) -> bool:
        """True when every layer holds exactly ``length`` tokens and no recurrent layer
        has a half-applied write (an interrupted forward pass)."""
        for c in self.leaves:
            if c.offset != length:
                return False
            if isinstance(c, RecurrentCache) and c._dirty:
                return False
        return True

    def reset_live(self) -> None:
        """Forget the live state (the trie keeps every snapshot)."""
        for c in self.leaves:
            c.free()
        self.live_tokens = []

    # -- begin: restore ------------------------------------------------------------------
    def _reach_table(self, path: List[TrieNode], live_common: int, top: int):
        """Per layer, what it can reach at or below ``top`` (computed once per request).

        Returns, per layer, either ``("kv", limit)`` — every offset up to ``limit`` —
        or ``("points", ends, any_below)`` — exactly the offsets in ``ends``, plus any
        offset up to ``any_below`` (an unwrapped window).
        """
        table = []
        for i, c in enumerate(self.leaves):
            if isinstance(c, KVCache):
                limit = live_common
                for n in path:  # the trie pages in node after node above the live prefix
                    if n.end <= limit:
                        continue
                    if n.start > limit or not n.has_state(i):
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

    @staticmethod
    def _reachable(entry, t: int) -> bool:
        if entry[0] == "kv":
            return t <= entry[1]
        return t in entry[1] or t <= entry[2]

    def _restore_layer(self, i: int, t: int, path: List[TrieNode], live_common: int) -> bool:
        c = self.leaves[i]
        if t == 0:
            c.free()
            return True
        if t <= live_common and c.restore(None, t):
            return True
        if isinstance(c, KVCache):
            if not c.restore(None, min(live_common, t)):
                return False
            for n in path:
                if n.end <= c.offset:
                    continue
                if n.start >= t or not c.restore(n.snapshots[i], min(n.end, t)):
                    break
            return c.offset == t
        for n in reversed(path):
            if n.has_state(i) and c.restore(n.snapshots[i], t):
                return True
        return False

    def begin(self, tokens: Sequence[int], extra_stops: Sequence[int] = ()) -> Plan:
        """Restore the live caches for ``tokens`` and plan the prefill's snapshot stops.

        Always leaves at least one prompt token to evaluate (the model needs logits).
        ``extra_stops`` adds snapshot offsets (e.g. chat message boundaries).
        """
        tokens = list(tokens)
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt is empty")
        path, matched = self.trie.find(tokens)
        if matched >= n:
            # Full hit: hold back the last token so it produces the first logits.
            path, matched = self.trie.find(tokens[: n - 1])
        live_common = min(_common_prefix(self.live_tokens, tokens), n - 1)
        if not self.consistent(len(self.live_tokens)):
            live_common = 0
        top = max(matched, live_common)
        cands = {top, 0, live_common}
        cands.update(nd.end for nd in path if nd.end <= top)
        table = self._reach_table(path, live_common, top)
        target, reason = 0, None
        for t in sorted(cands, reverse=True):
            blocked = next((i for i, e in enumerate(table) if not self._reachable(e, t)), None)
            if blocked is None:
                target = t
                break
            if t == top:
                c = self.leaves[blocked]
                reason = (
                    f"layer {blocked} ({type(c).__name__}) has no state at offset {top}; "
                    f"restored to the deepest offset every layer reaches"
                )
        ok = all(self._restore_layer(i, target, path, live_common) for i in range(len(self.leaves)))
        if not ok or not self.consistent(target):
            log.warning("restore to offset %d failed; recomputing the prompt from scratch", target)
            reason = f"restore to offset {target} failed unexpectedly; recomputed from 0"
            self.reset_live()
            target = 0
        self.live_tokens = tokens[:target]
        for nd in path:
            if nd.end <= target:
                self.trie.touch(nd)
        if target >= top:
            reason = None
        stops = sorted(set(self._stops(n, target, top)) | {s for s in extra_stops if target < s <= n - 1})
        return Plan(n, max(matched, target), target, reason, stops)

    def _stops(self, n: int, restored: int, matched: int) -> List[int]:
        if not self.whole_state:
            return []  # KV layers reach any token: the request's end snapshot covers it all
        stops = {n - 1, n - self.pre_end_margin}
        if restored < matched:
            stops.add(matched)  # branch point: the next divergence here restores exactly
        if self.snapshot_interval > 0:
            stops.update(range(self.snapshot_interval, n - 1, self.snapshot_interval))
        return sorted(s for s in stops if restored < s <= n - 1)

    # -- recording -----------------------------------------------------------------------
    def checkpoint(self, tokens: Sequence[int], keep: bool = True) -> Optional[TrieNode]:
        """Record the live state (which holds exactly ``tokens``) as a trie node end.

        Splits an edge where the point falls inside one, adds a child for tokens the trie
        lacks, and fills in the snapshots of layers that have none at that node.
        """
        seq = list(tokens)
        o = len(seq)
        if o == 0:
            return None
        if not self.consistent(o):
            raise RuntimeError(
                f"caches are not all at offset {o}: {[c.offset for c in self.leaves]}"
            )
        self.live_tokens = seq
        path, m = self.trie.find(seq)
        node = path[-1] if path else self.trie.root
        if path and node.end > m:
            node = self.trie.split(node, m)  # the point (or the divergence) is inside the edge
        if m == o:
            missing = [i for i in range(len(self.leaves)) if not node.has_state(i)]
            if missing:
                snaps = list(node.snapshots)
                for i in missing:
                    snaps[i] = self.leaves[i].snapshot(node.start)
                self.trie.set_snapshots(node, snaps)
        else:
            snaps = [c.snapshot(m) for c in self.leaves]
            parent = node
            node = self.trie.add_child(parent, seq[m:], snaps)
            if (
                parent is not self.trie.root
                and len(parent.children) == 1
                and parent not in self._keep
                and len(parent.tokens) < self.merge_below
            ):
                node = self.trie.merge_with_child(parent)
        self.trie.touch(node)
        if keep and self.whole_state:
            self._keep.add(node)
        return node

    def finish(self, tokens: Sequence[int], pending: Sequence[int] = ()) -> int:
        """End a request whose caches absorbed ``tokens``; record them and enforce the budget.

        ``pending`` are tokens of a forward pass that an interruption may or may not have
        let every layer absorb. A live state that cannot be made consistent (a recurrent
        layer half-way through a write) is dropped; the snapshots already taken stay.
        Returns the bytes evicted.
        """
        seq = list(tokens)
        if pending and self.consistent(len(seq) + len(pending)):
            seq += list(pending)
        elif not self.consistent(len(seq)):
            # Layers that ran ahead can rewind if they are KV (or an unwrapped window).
            for c in self.leaves:
                if c.offset != len(seq):
                    c.restore(None, len(seq))
        if seq and self.consistent(len(seq)):
            self.checkpoint(seq)
        else:
            if seq:
                log.info("discarding an interrupted live state at %s", [c.offset for c in self.leaves])
            self.reset_live()
        return self.enforce_budget()

    def enforce_budget(self) -> int:
        freed = self.trie.evict(self.max_bytes)
        if freed:
            self._keep.difference_update([n for n in self._keep if n.detached])
        return freed

    def clear(self) -> None:
        """Drop every snapshot and the live state."""
        self.trie.clear()
        self._keep.clear()
        self.reset_live()
