"""A change journal for a `PrefixTrie`: which nodes changed since it was last drained.

The trie tells an attached journal about every node whose structure or snapshots changed
(added, split, merged, removed, snapshots set or taken: `STRUCT`) and every node that was
used (`TOUCH`), and when it was cleared. Whoever keeps a copy of the trie elsewhere (the
disk store) drains it after each request and updates only those nodes, so the work is
proportional to what changed, never to the size of the trie. The journal knows nothing
of disks: it holds node objects and flags; the drainer reads the nodes' current state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from .node import TrieNode

#: The node was used (its ``last_used`` moved) and nothing else about it changed.
TOUCH = 1
#: The node's edge, parent, children or snapshots changed, or it left the trie.
STRUCT = 2

__all__ = ["Journal", "TOUCH", "STRUCT"]


class Journal:
    """Nodes changed since the last `drain`, in the order they first changed.

    Args:
        limit: past this many pending entries the journal stops listing nodes and says
            so (``overflowed``): the drainer must then compare the whole trie once. Bounds
            the memory of a journal nobody drains for a long time.
    """

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = int(limit)
        self._changed: Dict["TrieNode", int] = {}
        self._cleared = False
        self._overflowed = False

    def note(self, node: "TrieNode", flag: int) -> None:
        """Record that ``node`` changed (``flag``: `TOUCH` or `STRUCT`)."""
        if self._overflowed:
            return
        ch = self._changed
        ch[node] = ch.get(node, 0) | flag
        if len(ch) > self.limit:
            ch.clear()
            self._overflowed = True

    def cleared(self) -> None:
        """Every node left the trie at once (`PrefixTrie.clear`)."""
        self._changed.clear()
        self._cleared = True

    def __len__(self) -> int:
        return len(self._changed)

    def drain(self) -> Tuple[Dict["TrieNode", int], bool, bool]:
        """``(changed, cleared, overflowed)`` since the last drain, and start afresh.

        ``cleared``: the trie was cleared before the changes listed (which happened
        after it). ``overflowed``: changes were lost; compare the whole trie.
        """
        out = (self._changed, self._cleared, self._overflowed)
        self._changed, self._cleared, self._overflowed = {}, False, False
        return out
