"""The disk as the trie's second tier: demotion, promotion, and nodes the disk lets go.

Every node the trie holds is in RAM, on disk, or both; the index says what is on disk and
nothing says what is in RAM (a row means "this node is on disk"). A node on disk only is
*parked* (`Snapshot.park`, `PrefixTrie.recount`): its snapshots keep their kinds, offsets and shapes, hold no
memory, and wait for their files (`lazy.Verifier`), exactly like a node loaded at start.

* **Demotion** (`DiskTier.demote`, called by the memory budget's eviction through
  `prefix.eviction.Tier`): a node every snapshot of which is in a committed file of this
  directory (it was written in the background when it was recorded) is parked — its
  arrays are freed, its files are registered again to be checked when filled. Nothing is
  written: each snapshot reaches the disk once.
* **Promotion** (`DiskTier.before_request`): the parked nodes on a request's path are
  read (all their files at once on a small pool), checked, filled and counted again;
  the memory budget then demotes others. A file that turns out bad drops its node with
  its subtree — recomputed, never served.
* **Disk eviction** stays in the writer (`save.evict`, least recently used rows first);
  it reports the ids it deleted (`evicted`) and the next capture (`settle`) removes
  those nodes from the trie when they are parked, or keeps them when they are in RAM (their
  row comes back when something below them is written).

On the ranks of a sharded model every structural decision is agreed: whether to park
(`prefix.manager`: every rank has the files), which nodes a disk eviction removes (any
rank's disk let go of them: they are useless to all, so all drop them, named by their
token prefix's SHA-256), which path node is bad (`before_request`).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Set, Tuple

from ..prefix.agreement import Agreement, any_rank
from ..prefix.journal import STRUCT
from ..prefix.node import TrieNode
from ..prefix.trie import PrefixTrie
from .delta import Capturer
from .lazy import Verifier, warn


class DiskTier:
    """The disk tier of one `PersistentStore` (its `trie.tier`), built from the parts of
    the store it works with: the trie, the file checker, the capturer (a node's prefix
    digest), the ranks' agreement, the manager's restore points (``keep``), the
    placeholder holders and the store's directory."""

    def __init__(self, trie: PrefixTrie, verifier: Verifier, capturer: Capturer,
                 agree: Agreement, keep: set, holders: "weakref.WeakKeyDictionary",
                 directory: Callable[[], Path]) -> None:
        self.trie, self.verifier, self.capturer = trie, verifier, capturer
        self.agree, self.keep, self.holders, self.directory = agree, keep, holders, directory
        #: Persistent node id -> node, for nodes that have (had) a row.
        self.by_uid: "weakref.WeakValueDictionary[int, TrieNode]" = weakref.WeakValueDictionary()
        #: Prefix digest -> node (sharded models only: ranks name nodes by their tokens).
        self.by_digest: "weakref.WeakValueDictionary[bytes, TrieNode]" = weakref.WeakValueDictionary()
        #: Nodes in RAM whose row the disk budget deleted.
        self.rowless: "weakref.WeakSet[TrieNode]" = weakref.WeakSet()
        self._mu = threading.Lock()
        self._evicted: Set[int] = set()
        #: Cumulative bytes parked (moved out of RAM) and filled back from disk.
        self.demoted_bytes = 0
        self.promoted_bytes = 0
        self._await_writes: Callable[[], bool] = lambda: False

    # -- the memory budget's side (prefix.eviction.Tier) ----------------------------------
    def demotable(self, node: TrieNode) -> bool:
        """Every snapshot of ``node`` is in a committed file of this store's directory."""
        d = self.directory()
        v = self.verifier
        return all(s is None or s.closed or v.written(s, d) for s in node.snapshots)

    def set_writer(self, await_writes: Callable[[], bool]) -> None:
        """``await_writes()``: waits (bounded) for the captures submitted so far to be
        written; whether any were pending (the background writer's owner wires it)."""
        self._await_writes = await_writes

    def await_copies(self) -> bool:
        """The captures being written now, on disk (bounded); whether any were pending."""
        return self._await_writes()

    def demote(self, node: TrieNode) -> int:
        """Park ``node``: free its arrays, register its files to be checked when filled."""
        prefix = self.capturer.prefix_state(node)
        for s in node.snapshots:
            if s is not None and not s.closed and not s.parked:
                self.verifier.park(s, prefix)
                self.holders[s] = node
        freed = -self.trie.recount(node, parked=True)
        self.demoted_bytes += freed
        return freed

    # -- promotion ---------------------------------------------------------------------
    def before_request(self, tokens) -> List[Tuple[int, int]]:
        """Fill the parked nodes a restore for ``tokens`` may read (checked); drop the
        first bad node with its subtree. Returns the ``(start, end)`` of each node that
        came from disk. Call with the trie's lock held, right before restoring."""
        trie = self.trie
        path: List[TrieNode] = []
        bad = 0
        try:
            path, _ = trie.find(tokens)
            cold = [n for n in path if n.parked]
            self.verifier.prefetch(s for n in cold for s in n.snapshots)
            L = trie.num_layers
            ok = self.verifier.ensure_all([s for n in path for s in n.snapshots])
            bad = next((i for i in range(len(path)) if not all(ok[i * L:(i + 1) * L])), len(path))
        except Exception as e:  # never break a request
            warn(f"prefix cache check failed ({type(e).__name__}: {e}); continuing")
            bad, cold = 0, []
        if self.agree.size > 1:  # a file bad on any rank is bad on all of them
            bad = self.agree.all_min([bad])[0]
        spans = []
        for i, n in enumerate(path):
            if n.detached:
                continue
            if i < bad and n.parked:
                trie.recount(n, parked=False)
                self.promoted_bytes += n.nbytes
                spans.append((n.start, n.end))
            else:
                trie.recount(n)  # partly filled before a failure
        if bad < len(path):
            self.drop_subtree(path[bad])
        return spans

    def drop_subtree(self, node: TrieNode) -> None:
        """Remove ``node`` and everything below it from the trie (a bad file, a row the
        disk let go of); a pinned node only loses its state. Call with the trie's lock held."""
        if node.detached:
            return
        order = [node]
        i = 0
        while i < len(order):
            order.extend(order[i].children.values())
            i += 1
        for n in reversed(order):
            if n.in_use:
                # Pinned by a critical section in progress: drop its state, keep the node.
                self.trie.set_snapshots(n, [None] * self.trie.num_layers)
                continue
            self.trie.remove(n)
            self.keep.discard(n)

    # -- rows and the disk budget ------------------------------------------------------
    def note_row(self, node: TrieNode) -> None:
        """``node`` is getting a row (captured)."""
        self.by_uid[node.uid] = node
        self.rowless.discard(node)
        if self.agree.size > 1:
            self.by_digest[self.capturer.prefix_state(node).digest()] = node

    def evicted(self, uids: Iterable[int]) -> None:
        """The writer deleted these rows for the disk budget (any thread)."""
        with self._mu:
            self._evicted.update(uids)

    def settle(self, changed: Dict[TrieNode, int]) -> None:
        """At a capture (trie lock held): remove the nodes the disk let go that are
        parked, keep the others (in RAM, no longer on disk), and have every ancestor of a
        changed node that lost its row captured again (``changed`` gets it)."""
        with self._mu:
            uids, self._evicted = self._evicted, set()
        gone = [n for n in (self.by_uid.get(u) for u in uids) if n is not None and not n.detached]
        if self.agree.size > 1 and any_rank(self.agree, bool(gone)):
            gone = self._agreed(gone)
        for n in gone:
            if n.detached:
                continue
            if n.parked:
                self.drop_subtree(n)
            else:
                self.rowless.add(n)
        if self.rowless:
            for n in list(changed):
                p = n.parent
                while p is not None and p in self.rowless and not p.detached:
                    changed[p] = STRUCT
                    self.rowless.discard(p)
                    p = p.parent

    def _agreed(self, mine: List[TrieNode]) -> List[TrieNode]:
        # Parked nodes any rank's disk let go of: their shard is gone there, so the node
        # is useless to every rank. Named by token-prefix digest (ids differ by rank).
        cap = self.capturer
        blob = b"".join(cap.prefix_state(n).digest() for n in mine if n.parked)
        out: Dict[int, TrieNode] = {id(n): n for n in mine}
        for b in self.agree.all_gather(blob):
            for i in range(0, len(b), 32):
                n = self.by_digest.get(b[i:i + 32])
                if n is not None and not n.detached:
                    out[id(n)] = n
        return sorted(out.values(), key=lambda n: n.end)
