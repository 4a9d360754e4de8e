"""LRU eviction over a `PrefixTrie`, never touching pinned nodes or live branch points.

With a second tier (`Tier`, the disk store) eviction *parks* a node whose snapshots all
have a copy there: its arrays go, its place in the trie stays, and a later request that
needs it fills it from the copy. Parking changes no structure, so any resident node may
be parked, branch points included; a node without a copy is dropped as without a tier
(a leaf removed, a single-child node merged into its child).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, List, Optional, Protocol, Tuple

from .node import TrieNode

if TYPE_CHECKING:  # pragma: no cover
    from .trie import PrefixTrie


class Tier(Protocol):
    """Where parked snapshots live (the disk store implements it)."""

    def demotable(self, node: TrieNode) -> bool:
        """Every snapshot of ``node`` has a copy this tier can fill it from."""
        ...

    def demote(self, node: TrieNode) -> int:
        """Register the copies and park ``node`` (`PrefixTrie.park`); the bytes freed."""
        ...


def evictable(trie: "PrefixTrie", node: TrieNode) -> bool:
    """Unpinned, still attached, not the root, and at most one child — or, with a
    tier, holding memory (not parked): the step then parks it where it has a copy."""
    if node.detached or node is trie.root or node.in_use != 0:
        return False
    if trie.tier is not None:
        return not node.parked
    return len(node.children) <= 1


def _key(node: TrieNode) -> Tuple[int, int, int]:
    # Oldest first; on a tie the deeper node (so a chain is eaten from its tip), then
    # the bigger one (frees the most).
    return (node.last_used, -node.end, -node.nbytes)


def _step(trie: "PrefixTrie", victim: TrieNode, demote: bool) -> Optional[TrieNode]:
    """Park ``victim`` (``demote``) or drop it. Returns the node whose candidacy changed
    (the parked victim, the merged survivor, a removed leaf's parent), or None when
    neither is possible (a branch point without a copy in the tier)."""
    if demote:
        trie.tier.demote(victim)  # type: ignore[union-attr]
        return victim
    if len(victim.children) > 1:
        return None
    if victim.children:
        return trie.merge_with_child(victim)
    parent = victim.parent
    trie.remove(victim)
    return parent


def evict(trie: "PrefixTrie", max_bytes: int) -> int:
    """Free snapshots until ``trie.nbytes <= max_bytes`` or no candidate is left.

    Candidates: unpinned non-root nodes with at most one child, so branch points
    (shared prefixes) survive until only one branch is left. Leaves are removed;
    single-child nodes are merged into their child (frees whole-state snapshots; for
    KV it frees nothing but shortens the chain so the leaf can go next). With a tier,
    nodes it holds copies of are parked instead. Each step drops or parks one node, so
    the loop ends. Returns the bytes freed.
    """
    before = trie.nbytes
    if before <= max_bytes:
        return 0
    heap: List[Tuple[Tuple[int, int, int], int, TrieNode]] = []
    seq = 0

    def push(n: TrieNode) -> None:
        nonlocal seq
        if evictable(trie, n):
            heapq.heappush(heap, (_key(n), seq, n))
            seq += 1

    for n in trie.nodes():
        push(n)
    # Entries go stale when a node changes; every change below pushes a fresh entry,
    # so a popped entry whose key no longer matches is simply dropped.
    while heap and trie.nbytes > max_bytes:
        key, _, n = heapq.heappop(heap)
        if not evictable(trie, n) or key != _key(n):
            continue
        changed = _step(trie, n, trie.tier is not None and trie.tier.demotable(n))
        if changed is not None:
            push(changed)
    return before - trie.nbytes


def _invariant_key(node: TrieNode) -> Tuple[int, int, int, int]:
    # Only what every rank of a sharded model agrees on (never bytes, which differ).
    return (node.last_used, -node.end, -len(node.tokens), node.tokens[0] if node.tokens else -1)


def evict_one(trie: "PrefixTrie",
              demote: Optional[Callable[[TrieNode], bool]] = None) -> Optional[int]:
    """One eviction step on the least recently used candidate, chosen from structure and
    use alone (the same node on every rank of a sharded model); the bytes it freed, or
    None when nothing is evictable. ``demote(node)`` says whether to park it (with a
    tier; on a sharded model every rank must answer alike: agree on it)."""
    for victim in sorted((n for n in trie.nodes() if evictable(trie, n)), key=_invariant_key):
        before = trie.nbytes
        park = trie.tier is not None and demote is not None and demote(victim)
        if _step(trie, victim, park) is not None:
            return before - trie.nbytes
    return None
