"""LRU eviction over a `PrefixTrie`, never touching pinned nodes or live branch points."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, List, Optional, Tuple

from .node import TrieNode

if TYPE_CHECKING:  # pragma: no cover
    from .trie import PrefixTrie


def evictable(trie: "PrefixTrie", node: TrieNode) -> bool:
    """Unpinned, still attached, not the root, and at most one child."""
    return (
        not node.detached
        and node is not trie.root
        and node.in_use == 0
        and len(node.children) <= 1
    )


def _key(node: TrieNode) -> Tuple[int, int, int]:
    # Oldest first; on a tie the deeper node (so a chain is eaten from its tip), then
    # the bigger one (frees the most).
    return (node.last_used, -node.end, -node.nbytes)


def evict(trie: "PrefixTrie", max_bytes: int) -> int:
    """Free snapshots until ``trie.nbytes <= max_bytes`` or no candidate is left.

    Candidates: unpinned non-root nodes with at most one child, so branch points
    (shared prefixes) survive until only one branch is left. Leaves are removed;
    single-child nodes are merged into their child (frees whole-state snapshots; for
    KV it frees nothing but shortens the chain so the leaf can go next). Each step
    drops one node, so the loop ends. Returns the bytes freed.
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
        parent = n.parent
        assert parent is not None
        if n.children:
            push(trie.merge_with_child(n))
        else:
            trie.remove(n)
            push(parent)
    return before - trie.nbytes


def _invariant_key(node: TrieNode) -> Tuple[int, int, int, int]:
    # Only what every rank of a sharded model agrees on (never bytes, which differ).
    return (node.last_used, -node.end, -len(node.tokens), node.tokens[0] if node.tokens else -1)


def evict_one(trie: "PrefixTrie") -> Optional[int]:
    """One eviction step on the least recently used candidate, chosen from structure and
    use alone (the same node on every rank of a sharded model); the bytes it freed, or
    None when nothing is evictable."""
    victim = min((n for n in trie.nodes() if evictable(trie, n)), key=_invariant_key, default=None)
    if victim is None:
        return None
    before = trie.nbytes
    if victim.children:
        trie.merge_with_child(victim)
    else:
        trie.remove(victim)
    return before - trie.nbytes
