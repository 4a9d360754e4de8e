"""The byte budget of a `PrefixManager` (a mixin): what it holds, what a record will add,
and eviction — also, on the ranks of a sharded model, agreed step by step.

``max_bytes`` counts every byte held: the trie's snapshots and every live set, lent to a
request or idle. The idle live set goes first (the trie holds its tokens too), then the
least recently used snapshots.
"""

from __future__ import annotations

from typing import List

from .agreement import any_rank, every
from .eviction import evict_one
from .live import LiveSet
from .node import TrieNode


class Budget:
    """Byte accounting and eviction; expects ``trie``, ``max_bytes``, ``agree``, ``keep``,
    ``evicted_bytes``, ``_idle``, ``_lent`` and ``run`` from `PrefixManager`."""

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the trie's snapshots."""
        return self.trie.nbytes

    @property
    def live_bytes(self) -> int:
        """Bytes of every live set, lent to a request or idle."""
        sets = set(self._lent)
        if self._idle is not None:
            sets.add(self._idle)
        return sum(s.nbytes for s in sets)

    @property
    def nbytes(self) -> int:
        """Everything the manager holds: snapshots and live caches."""
        return self.snapshot_bytes + self.live_bytes

    def _evict(self, target: int) -> None:
        target = max(target, 0)
        if self.agree.size == 1:
            freed = self.trie.evict(target)
        else:
            # Ranks hold different bytes (pipeline shards are uneven), so "still over" is
            # decided by all of them, one step at a time, on the same node each step.
            freed = 0
            while any_rank(self.agree, self.trie.nbytes > target):
                step = evict_one(self.trie, self._agreed_demotable)
                if not every(self.agree, step is not None):
                    break
                freed += step
        if freed:
            self.evicted_bytes += freed

    def _agreed_demotable(self, node: TrieNode) -> bool:
        # Whether a file is on disk is rank-local (each rank writes its own shard when
        # it gets to it): park only where every rank can, so the tries stay alike.
        return every(self.agree, self.trie.tier.demotable(node))

    def _evict_to_count(self, n: int) -> None:
        """Evict, one least-recently-used node at a time, until at most ``n`` nodes hold
        memory (parked nodes hold none; O(log n) per node evicted)."""
        while any_rank(self.agree, self.trie.node_count - self.trie.parked_count > max(n, 0)):
            step = evict_one(self.trie, self._agreed_demotable)
            if not every(self.agree, step is not None):
                break
            self.evicted_bytes += step

    def enforce_budget(self) -> None:
        """Fit ``max_bytes``: drop the idle live set first (the trie holds its tokens too),
        then evict least recently used snapshots. Lent live sets cannot be dropped."""
        self.run(self._enforce)

    def _enforce(self) -> None:
        if not any_rank(self.agree, self.nbytes > self.max_bytes):
            return
        if self._idle is not None:
            self._idle.reset()
            self._idle = None
        self._evict(self.max_bytes - self.live_bytes)

    def _make_room(self, need: int) -> bool:
        """Evict so ``need`` more bytes fit; False when they cannot."""
        budget = self.max_bytes - self.live_bytes
        if self.trie.nbytes + need > budget and self._idle is not None:
            self._idle.reset()
            self._idle = None
            budget = self.max_bytes - self.live_bytes
        if any_rank(self.agree, self.trie.nbytes + need > budget):
            self._evict(budget - need)
        return every(self.agree, self.trie.nbytes + need <= budget)

    def _need(self, live: LiveSet, path: List[TrieNode], m: int, o: int) -> int:
        """Bytes the snapshots of a record at ``o`` (trie match ``m``) will add."""
        if m < o:
            return sum(c.snapshot_nbytes(m) for c in live.leaves)
        node = path[-1]  # holds ``o`` inside or at the end of its edge
        need = 0
        for i, c in enumerate(live.leaves):
            kv = getattr(c, "delta_snapshots", False)
            if not node.has_state(i):
                need += c.snapshot_nbytes(node.start if kv else 0)
            elif node.end != o and not kv:  # the split's upper half needs a whole state
                need += c.snapshot_nbytes(0)
        return need
