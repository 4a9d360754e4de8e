"""The byte budget of a `PrefixManager` (a mixin): what it holds, what a record will add,
and eviction — also, on the ranks of a sharded model, agreed (in one collective).

``max_bytes`` counts every byte held: the trie's snapshots and every live set, lent to a
request or idle. The idle live set goes first (the trie holds its tokens too), then the
least recently used snapshots.

On the ranks of a sharded model every eviction step takes the same node everywhere (the
victim is chosen from structure and use alone, `eviction.evict_one`), so "evict until
every rank fits" needs no collective per step: each rank evicts until it fits on its own,
then all catch up with the rank that needed the most steps (one ``all_max``). The result
is the step-by-step agreement's, at the cost of one collective.

With a disk tier a step may park its node instead (its data stays on disk), and whether
this rank's copy is written yet is rank-local: there each step agrees on it (park only
where every rank can), one collective per step, so the tries keep one shape.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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
        elif self.trie.tier is not None:
            # Parking is agreed node by node ("still over" then needs every rank too).
            freed = 0
            while any_rank(self.agree, self.trie.nbytes > target):
                step = evict_one(self.trie, self._demote())
                if not every(self.agree, step is not None):
                    break
                freed += step
        else:
            # Ranks hold different bytes (pipeline shards are uneven): evict until every
            # rank fits, agreed in one collective (see the module doc).
            steps, freed = self._evict_steps(target)
            freed += self._evict_steps(None, self.agree.all_max([steps])[0] - steps)[1]
        self._evicted(freed)

    def _demote(self) -> Optional[Callable[[TrieNode], bool]]:
        """Whether an eviction step parks its node (a disk tier holds its copy)."""
        tier = self.trie.tier
        if tier is None:
            return None
        if self.agree.size == 1:
            return tier.demotable
        # Whether a file is on disk is rank-local (each rank writes its own shard when
        # it gets to it): park only where every rank can, so the tries stay alike.
        return lambda node: every(self.agree, tier.demotable(node))

    def _evict_steps(self, target: Optional[int], limit: Optional[int] = None) -> Tuple[int, int]:
        """Eviction steps here until the snapshots fit ``target`` (None: no target), at
        most ``limit`` steps or until nothing is evictable: ``(steps, bytes freed)``."""
        steps = freed = 0
        while (target is None or self.trie.nbytes > target) and (limit is None or steps < limit):
            step = evict_one(self.trie)  # no tier here (see `_evict`)
            if step is None:  # at the same step on every rank: the tries have one shape
                break
            steps += 1
            freed += step
        return steps, freed

    def _evicted(self, freed: int) -> None:
        if freed:
            self.evicted_bytes += freed

    def _evict_to_count(self, n: int) -> None:
        """Evict, one least-recently-used node at a time, until at most ``n`` nodes hold
        memory (parked nodes hold none; O(log n) per node evicted). The counts are the
        same on every rank: no agreement beyond a tier's parking."""
        demote = self._demote()
        while self.trie.node_count - self.trie.parked_count > max(n, 0):
            step = evict_one(self.trie, demote)
            if step is None:
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
        """Evict so ``need`` more bytes fit; False when they cannot (on some rank)."""
        budget = self.max_bytes - self.live_bytes
        if self.trie.nbytes + need > budget and self._idle is not None:
            self._idle.reset()
            self._idle = None
            budget = self.max_bytes - self.live_bytes
        if self.agree.size == 1 or self.trie.tier is not None:
            if any_rank(self.agree, self.trie.nbytes + need > budget):
                self._evict(budget - need)
            return every(self.agree, self.trie.nbytes + need <= budget)
        # One collective: the most steps any rank needed, and whether some rank cannot
        # fit even with nothing evictable left (then it cannot after more steps either).
        steps, freed = self._evict_steps(budget - need)
        most, short = self.agree.all_max([steps, int(self.trie.nbytes + need > budget)])
        freed += self._evict_steps(None, most - steps)[1]
        self._evicted(freed)
        return not short

    def over_budget(self, limit: Optional[int] = None) -> bool:
        """Whether this rank holds more than the budget (or its snapshots more than
        ``limit``): read-only, no agreement (see `settle`)."""
        return self.nbytes > self.max_bytes or (limit is not None and self.trie.nbytes > limit)

    def settle(self, limit: Optional[int] = None) -> None:
        """Fit the budget — and ``limit``, this rank's own ceiling for the snapshots —
        now, agreed with the other ranks in one collective (with ``defer_budget``, the
        caller's once-a-turn enforcement; every rank must call it at the same point)."""
        def fit() -> None:
            target = self.max_bytes - self.live_bytes
            self._evict(target if limit is None else min(target, limit))
        self.run(fit)

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
