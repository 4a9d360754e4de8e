"""LRU eviction over a `PrefixTrie`, never touching pinned nodes or live branch points.

The candidates are kept in order as the trie changes (`Candidates`), so a request that
finds the budget full pays O(log n) per victim, not a scan of every node. Two orders:

* `evict` (one process): oldest first; on a tie the deeper node (a chain is eaten from
  its tip), then the bigger one (frees the most);
* `evict_one` (the ranks of a sharded model, one agreed step at a time): oldest, deeper,
  longer edge, smaller first token — structure and use only, never bytes, which differ
  between ranks.

Both end with the node's creation serial, so the order is total and the same on every
rank. Through the trie's own operations two nodes never share ``(last_used, end)``
(nodes that share a ``last_used`` came from splitting one node, so they lie on one
path), which makes the later keys matter only for ``last_used`` values set by hand.
"""

from __future__ import annotations

import heapq
import weakref
from typing import Callable, Iterator, List, Optional, Protocol, Tuple

from .node import TrieNode


class Tier(Protocol):
    """A second tier that holds copies of snapshots (the disk store). With one, eviction
    *parks* a node every snapshot of which has a copy there: its arrays go, its place in
    the trie stays (so a branch point may go too), and a request that needs it fills it
    from the copy. A node without a copy is dropped as without a tier."""

    def demotable(self, node: TrieNode) -> bool:
        """Every snapshot of ``node`` has a copy in this tier."""
        ...

    def demote(self, node: TrieNode) -> int:
        """Park ``node`` (its copies registered, `PrefixTrie.recount` told); bytes freed."""
        ...

    def await_copies(self) -> bool:
        """Wait (bounded) for copies being written to this tier now; whether any were.
        Eviction asks once before it drops a node without a copy: a node captured at the
        end of a request whose write has not finished yet is then parked, not lost."""
        ...


class Evictable(Protocol):
    """What eviction reads and calls of a trie (`PrefixTrie` is one): the trie holds its
    `Candidates`, so this module names the trie's face instead of importing it."""

    root: TrieNode
    tier: Optional[Tier]
    candidates: "Candidates"

    @property
    def nbytes(self) -> int: ...

    @property
    def node_count(self) -> int: ...

    def nodes(self) -> Iterator[TrieNode]: ...

    def merge_with_child(self, node: TrieNode) -> TrieNode: ...

    def remove(self, leaf: TrieNode) -> None: ...


def evictable(trie: Evictable, node: TrieNode) -> bool:
    """Unpinned, still attached, not the root, and at most one child — with a tier, any
    node holding memory (not parked): the step parks it where the tier has a copy."""
    if node.detached or node is trie.root or node.in_use != 0:
        return False
    if trie.tier is not None:
        return not node.parked
    return len(node.children) <= 1


def _key(node: TrieNode) -> Tuple[int, int, int]:
    # Oldest first; on a tie the deeper node (so a chain is eaten from its tip), then
    # the bigger one (frees the most).
    return (node.last_used, -node.end, -node.counted)


def _invariant_key(node: TrieNode) -> Tuple[int, int, int, int]:
    # Only what every rank of a sharded model agrees on (never bytes, which differ).
    t = node.tokens
    return (node.last_used, -node.end, -len(t), t[0] if len(t) else -1)


# (key, creation serial, push order, the node — weakly: a dropped node's tokens must
# not stay alive in a stale entry)
_Entry = Tuple[tuple, int, int, "weakref.ref[TrieNode]"]


class Candidates:
    """A trie's eviction candidates, in both orders, kept up to date as it changes.

    Two heaps with lazy invalidation: the trie calls `push` whenever a node's key or its
    eligibility may have changed (its snapshots, edge, use time, pins, or a child
    removed), and an entry is checked against the node's current key when it reaches the
    top; stale ones are dropped there. Every node that is a candidate therefore has an
    entry with its current key, and the first valid entry is the first candidate. The
    heaps are rebuilt when stale entries outnumber live nodes (amortised O(1) per push).
    Entries hold nodes weakly, so a node the trie dropped is freed at once.
    """

    def __init__(self, trie: Evictable) -> None:
        self.trie = trie
        self._lru: List[_Entry] = []
        self._inv: List[_Entry] = []
        self._seq = 0

    def push(self, node: TrieNode) -> None:
        if not evictable(self.trie, node):
            return  # whatever makes it a candidate again pushes it again
        self._seq += 1
        ref = weakref.ref(node)
        heapq.heappush(self._lru, (_key(node), node.serial, self._seq, ref))
        heapq.heappush(self._inv, (_invariant_key(node), node.serial, self._seq, ref))
        if len(self._lru) > 2 * self.trie.node_count + 64:
            self.rebuild()

    def rebuild(self) -> None:
        """Only current entries, one per candidate (O(n))."""
        self._lru, self._inv = [], []
        for n in self.trie.nodes():
            if evictable(self.trie, n):
                self._seq += 1
                ref = weakref.ref(n)
                self._lru.append((_key(n), n.serial, self._seq, ref))
                self._inv.append((_invariant_key(n), n.serial, self._seq, ref))
        heapq.heapify(self._lru)
        heapq.heapify(self._inv)

    def clear(self) -> None:
        self._lru, self._inv = [], []

    def _pop(self, heap: List[_Entry], key: Callable[[TrieNode], tuple]) -> Optional[TrieNode]:
        while heap:
            k, _, _, ref = heapq.heappop(heap)
            node = ref()
            if node is not None and evictable(self.trie, node) and key(node) == k:
                return node
        return None

    def pop_lru(self) -> Optional[TrieNode]:
        """The first candidate in `evict`'s order, or None."""
        return self._pop(self._lru, _key)

    def pop_invariant(self) -> Optional[TrieNode]:
        """The first candidate in `evict_one`'s (rank-invariant) order, or None."""
        return self._pop(self._inv, _invariant_key)

    def check(self) -> None:
        """Raise ``AssertionError`` unless every candidate has a current entry in both heaps."""
        for heap, key, name in ((self._lru, _key, "LRU"), (self._inv, _invariant_key, "invariant")):
            held = {(id(n), k) for k, _, _, n in ((k, s, q, r()) for k, s, q, r in heap)
                    if n is not None and not n.detached}
            for n in self.trie.nodes():
                if evictable(self.trie, n) and (id(n), key(n)) not in held:
                    raise AssertionError(f"{n!r} is an eviction candidate missing from the "
                                         f"{name} order")


def _step(trie: Evictable, victim: TrieNode, demote: bool) -> bool:
    """Park ``victim`` or drop it; False when neither can be done (a branch point the
    tier has no copy of: it stays a candidate for later)."""
    if demote:
        trie.tier.demote(victim)  # type: ignore[union-attr]
    elif len(victim.children) > 1:
        return False
    elif victim.children:
        trie.merge_with_child(victim)
    else:
        trie.remove(victim)
    return True


def evict(trie: Evictable, max_bytes: int) -> int:
    """Free snapshots until ``trie.nbytes <= max_bytes`` or no candidate is left.

    Candidates: unpinned non-root nodes with at most one child, so branch points
    (shared prefixes) survive until only one branch is left. Leaves are removed;
    single-child nodes are merged into their child (frees whole-state snapshots; for
    KV it frees nothing but shortens the chain so the leaf can go next). Each step
    drops one node, so the loop ends. With a tier, nodes it holds copies of are parked
    instead (any node, branch points included); before the first node without a copy
    is dropped, the tier finishes the writes in progress (`Tier.await_copies`). Returns
    the bytes freed. O(log n) per step.
    """
    before = trie.nbytes
    kept: List[TrieNode] = []
    waited = False
    while trie.nbytes > max_bytes:
        victim = trie.candidates.pop_lru()
        if victim is None:
            break
        tier = trie.tier
        park = tier is not None and tier.demotable(victim)
        if tier is not None and not park and not waited:
            waited = True  # once a call: a write in progress, not one never started
            wrote = tier.await_copies()
            if not evictable(trie, victim):  # (a capture may drop a bad parked subtree)
                continue
            park = wrote and tier.demotable(victim)
        if not _step(trie, victim, park):
            kept.append(victim)
    for n in kept:  # (their copies may be written by the next call)
        trie.candidates.push(n)
    return before - trie.nbytes


def evict_one(trie: Evictable,
              demote: Optional[Callable[[TrieNode], bool]] = None) -> Optional[int]:
    """One eviction step on the least recently used candidate, chosen from structure and
    use alone (the same node on every rank of a sharded model); the bytes it freed, or
    None when nothing is evictable. With a tier, ``demote(node)`` says whether to park it
    (whether a copy is on disk is rank-local: agree on it). O(log n)."""
    kept: List[TrieNode] = []
    freed: Optional[int] = None
    while freed is None:
        victim = trie.candidates.pop_invariant()
        if victim is None:
            break
        before = trie.nbytes
        park = trie.tier is not None and demote is not None and demote(victim)
        if _step(trie, victim, park):
            freed = before - trie.nbytes
        else:
            kept.append(victim)
    for n in kept:
        trie.candidates.push(n)
    return freed
