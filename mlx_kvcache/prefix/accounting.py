"""The running counters of a `PrefixTrie` (a mixin): bytes held, nodes, parked nodes,
nodes and bytes per label, the logical clock — and the few bookkeeping methods every
change of a node goes through, so the counters stay exact and the eviction candidates
in order without ever walking the trie."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..caches.snapshot import Snapshot
from .journal import STRUCT, TOUCH
from .node import TrieNode, _live_bytes
from .tokens import Tokens

__all__ = ["TrieAccounting"]


class TrieAccounting:
    """Expects `PrefixTrie`'s ``num_layers``, ``root``, ``candidates``, ``journal`` and
    the counter fields it initialises (``_clock``, ``_nbytes``, ``_count``, ``_parked``,
    ``_serial``, ``_labels``)."""

    # -- counters ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by every snapshot in the trie (running counter, exact)."""
        return self._nbytes

    @property
    def node_count(self) -> int:
        """Nodes in the trie, the root excluded (running counter, exact)."""
        return self._count

    @property
    def parked_count(self) -> int:
        """Parked nodes (their data in another tier: `recount`), a running counter."""
        return self._parked

    def label_stats(self) -> Dict[Optional[str], Tuple[int, int]]:
        """``{label: (nodes, bytes)}`` over every node (running counters, O(labels))."""
        return {k: (v[0], v[1]) for k, v in self._labels.items() if v[0]}

    def set_label(self, node: TrieNode, label: Optional[str]) -> None:
        """Tag ``node`` (counted per label by `label_stats`). A node made by a split starts
        unlabelled; a merge keeps the surviving child's label."""
        self._require_attached(node)
        self._count_label(node, -1)
        node.label = label
        self._count_label(node, +1)

    @property
    def clock(self) -> int:
        """Current value of the logical clock (last value `tick` returned)."""
        return self._clock

    def tick(self) -> int:
        """Advance and return the logical clock.

        A counter rather than wall time: LRU order stays total and tests stay deterministic.
        """
        self._clock += 1
        return self._clock

    def set_clock(self, value: int) -> None:
        """Move the logical clock forward to ``value`` (ranks of a sharded model align
        theirs after loading)."""
        self._clock = max(self._clock, int(value))

    def touch(self, node: TrieNode) -> None:
        """Mark ``node`` as used now."""
        node.last_used = self.tick()
        self._changed(node, TOUCH)

    def _changed(self, node: TrieNode, flag: int = STRUCT) -> None:
        if self.journal is not None:
            self.journal.note(node, flag)

    # -- bookkeeping: every change of a node goes through these ------------------------
    def _reindex(self, node: TrieNode) -> None:
        """``node``'s eviction key or eligibility may have changed."""
        self.candidates.push(node)

    def _count_label(self, node: TrieNode, sign: int) -> None:
        row = self._labels.setdefault(node.label, [0, 0])
        row[0] += sign
        row[1] += sign * node._acct

    def _new(self, tokens: Tokens, end: int, parent: TrieNode, last_used: int) -> TrieNode:
        """A node linked into the counters (its caller links it into the tree)."""
        self._serial += 1
        node = TrieNode(tokens, end, parent, [None] * self.num_layers, last_used, self._serial)
        node._owner = self
        self._count += 1
        self._count_label(node, +1)
        return node

    def _set(self, node: TrieNode, snapshots: List[Optional[Snapshot]]) -> None:
        """Install ``snapshots`` on ``node`` and fix the counters (no closing)."""
        self._count_label(node, -1)
        self._nbytes -= node._acct
        node.snapshots = snapshots
        self._parked -= node.parked
        node.parked = False
        node._acct = _live_bytes(snapshots)
        self._nbytes += node._acct
        self._count_label(node, +1)
        self._reindex(node)
        self._changed(node)

    def recount(self, node: TrieNode, parked: Optional[bool] = None) -> int:
        """Count ``node``'s bytes again after its snapshots were parked or filled behind
        the trie's back (``parked``: set its flag too; no journal entry: nothing about it
        changed). Returns the change in bytes."""
        if node.detached:
            return 0
        before = node._acct
        self._count_label(node, -1)
        if parked is not None:
            self._parked += int(parked) - int(node.parked)
            node.parked = parked
        node._acct = _live_bytes(node.snapshots)
        self._nbytes += node._acct - before
        self._count_label(node, +1)
        self._reindex(node)
        return node._acct - before

    def _detach(self, node: TrieNode) -> None:
        """Drop ``node`` from accounting and mark it dead; its snapshots must already be gone."""
        self._count_label(node, -1)
        self._nbytes -= node._acct
        self._count -= 1
        self._parked -= node.parked
        node.parked = False
        node._acct = 0
        node.snapshots = [None] * self.num_layers
        node.parent = None
        node.children = {}
        node.detached = True
        node._owner = None
        self._changed(node)
