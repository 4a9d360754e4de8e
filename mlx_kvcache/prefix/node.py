"""`TrieNode`: one compressed edge of the prefix trie and the per-layer snapshots at its end,
and `LayerOps`, what the trie asks of a layer when node boundaries move.

A ``needs_base`` (KV) snapshot covers exactly the node's edge ``[start, end)``; a
whole-state snapshot (rotating window, recurrent) is the state at ``end``.
"""

from __future__ import annotations

import random
from typing import List, Optional, Protocol, Sequence, Tuple

from ..caches.snapshot import Snapshot
from .tokens import Tokens

# Node ids are random 63-bit numbers, not a per-trie counter: two processes saving into
# one directory, or a trie loaded into a live one, never hand out the same id.
_UIDS = random.SystemRandom()


class LayerOps(Protocol):
    """What the trie needs from one cache layer (the cache objects themselves qualify)."""

    def split(self, snapshot: Snapshot, at: int) -> Tuple[Optional[Snapshot], Optional[Snapshot]]:
        """``[a, c)`` -> ``([a, at), [at, c))``; takes ownership of ``snapshot``."""
        ...

    def merge(self, parent: Snapshot, child: Snapshot) -> Optional[Snapshot]:
        """Adjacent ``[a, b)`` + ``[b, c)`` -> ``[a, c)``; takes ownership of both."""
        ...


class Order(Protocol):
    """An eviction order a node tells when its key may have changed (`eviction.Candidates`)."""

    def push(self, node: "TrieNode") -> None:
        ...


def live_bytes(snapshots: Sequence[Optional[Snapshot]]) -> int:
    """Bytes the snapshots in ``snapshots`` (None where a layer holds none) hold now."""
    return sum(s.nbytes for s in snapshots if s is not None)


class TrieNode:
    """One compressed edge of the trie and the per-layer snapshots at it.

    Nodes are created and rearranged only by `PrefixTrie`; read their fields freely, but
    change ``tokens``, ``end``, ``parent``, ``children``, ``snapshots``, ``counted`` or
    ``order`` only through the trie, or its counters and invariants break. ``last_used`` and ``in_use`` may be set
    directly (a loader restoring LRU order, a caller pinning a node): the trie's eviction
    order follows.

    ``tokens`` is a `Tokens` (a read-only int64 array that reads like a tuple of ints):
    use ``len``, indexing, ``list(node.tokens)`` or ``np.asarray(node.tokens)``.
    """

    __slots__ = (
        "tokens", "end", "parent", "children", "_last_used", "snapshots", "_in_use",
        "detached", "counted", "uid", "parked", "order", "serial", "label", "__weakref__",
    )

    def __init__(
        self,
        tokens: Tokens,
        end: int,
        parent: Optional["TrieNode"],
        snapshots: List[Optional[Snapshot]],
        last_used: int = 0,
        serial: int = 0,
    ):
        self.tokens: Tokens = tokens
        self.end: int = end
        self.parent: Optional[TrieNode] = parent
        #: Keyed by the child's first token, which makes sibling first tokens unique.
        self.children: dict[int, TrieNode] = {}
        self._last_used: int = last_used
        self.snapshots: List[Optional[Snapshot]] = snapshots
        self._in_use: int = 0
        #: True once the trie dropped this object (removed, merged away, cleared).
        self.detached: bool = False
        #: Bytes this node contributed to the trie's counter when its snapshots were last
        #: set (the trie's to change); the counter subtracts exactly this, even if a
        #: snapshot was closed behind the trie's back (check_invariants reports that case).
        self.counted: int = 0
        #: Identity that outlives a save and a restart (the disk store keys rows by it);
        #: nonzero, the same object keeps it through splits and merges.
        self.uid: int = _UIDS.getrandbits(63) or 1
        #: Its snapshots are parked (`PrefixTrie.recount`): their data lives in another tier
        #: (the disk) and the node holds no memory until they are filled again.
        self.parked: bool = False
        #: The eviction order of the trie holding this node, told of changes to
        #: ``last_used`` / ``in_use`` (the trie's to set; None once detached).
        self.order: Optional[Order] = None
        #: Creation order within the trie: the last tie-break of the eviction order (the
        #: same on every rank, which creates nodes in the same order).
        self.serial: int = serial
        #: A caller's tag (e.g. the server's segment type); the trie counts nodes and
        #: bytes per label (`PrefixTrie.label_stats`).
        self.label: Optional[str] = None

    @property
    def last_used(self) -> int:
        """Logical time of the last use (the trie's clock)."""
        return self._last_used

    @last_used.setter
    def last_used(self, value: int) -> None:
        self._last_used = int(value)
        if self.order is not None:
            self.order.push(self)

    @property
    def in_use(self) -> int:
        """Pin count of running requests; eviction never touches a pinned node."""
        return self._in_use

    @in_use.setter
    def in_use(self, value: int) -> None:
        self._in_use = int(value)
        if self.order is not None:
            self.order.push(self)

    @property
    def start(self) -> int:
        """Absolute offset of the first token of the edge."""
        return self.end - len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes the node's snapshots hold now."""
        return live_bytes(self.snapshots)

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
