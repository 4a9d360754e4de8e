"""`TrieNode`: one compressed edge of the prefix trie and the per-layer snapshots at its end.

A ``needs_base`` (KV) snapshot covers exactly the node's edge ``[start, end)``; a
whole-state snapshot (rotating window, recurrent) is the state at ``end``.
"""

from __future__ import annotations

import random
from typing import List, Optional, Sequence

from ..caches.snapshot import Snapshot

# Node ids are random 63-bit numbers, not a per-trie counter: two processes saving into
# one directory, or a trie loaded into a live one, never hand out the same id.
_UIDS = random.SystemRandom()


def _as_tokens(tokens: Sequence[int]) -> List[int]:
    # numpy / mx arrays compare element-wise, which breaks the slice equality in `find`.
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()  # type: ignore[union-attr]
    return [int(t) for t in tokens]


def _live_bytes(snapshots: Sequence[Optional[Snapshot]]) -> int:
    return sum(s.nbytes for s in snapshots if s is not None)


class TrieNode:
    """One compressed edge of the trie and the per-layer snapshots at it.

    Nodes are created and rearranged only by `PrefixTrie`; read their fields freely, but
    change ``tokens``, ``end``, ``parent``, ``children`` or ``snapshots`` only through the
    trie, or its byte count and invariants break.
    """

    __slots__ = (
        "tokens", "end", "parent", "children", "last_used", "snapshots", "in_use",
        "detached", "_acct", "uid", "parked", "__weakref__",
    )

    def __init__(
        self,
        tokens: List[int],
        end: int,
        parent: Optional["TrieNode"],
        snapshots: List[Optional[Snapshot]],
        last_used: int = 0,
    ):
        self.tokens: List[int] = tokens
        self.end: int = end
        self.parent: Optional[TrieNode] = parent
        #: Keyed by the child's first token, which makes sibling first tokens unique.
        self.children: dict[int, TrieNode] = {}
        self.last_used: int = last_used
        self.snapshots: List[Optional[Snapshot]] = snapshots
        #: Pin count of running requests; eviction never touches a pinned node.
        self.in_use: int = 0
        #: True once the trie dropped this object (removed, merged away, cleared).
        self.detached: bool = False
        # Bytes this node contributed to the trie's counter when its snapshots were last
        # set; the counter subtracts exactly this, even if a snapshot was closed behind the
        # trie's back (check_invariants reports that case).
        self._acct: int = 0
        #: Identity that outlives a save and a restart (the disk store keys rows by it);
        #: nonzero, the same object keeps it through splits and merges.
        self.uid: int = _UIDS.getrandbits(63) or 1
        #: Its snapshots are parked (`PrefixTrie.park`): their data lives in another tier
        #: (the disk) and the node holds no memory until they are filled again.
        self.parked: bool = False

    @property
    def start(self) -> int:
        """Absolute offset of the first token of the edge."""
        return self.end - len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes the node's snapshots hold now."""
        return _live_bytes(self.snapshots)

    def has_state(self, layer: int) -> bool:
        """Whether ``layer`` has a (live) snapshot at this node."""
        s = self.snapshots[layer]
        return s is not None and not s.closed

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        held = sum(1 for s in self.snapshots if s is not None)
        gone = " detached" if self.detached else (" parked" if self.parked else "")
        return (
            f"TrieNode([{self.start},{self.end}) {len(self.tokens)}t "
            f"{held}/{len(self.snapshots)} snaps in_use={self.in_use}{gone})"
        )

