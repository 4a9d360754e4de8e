"""Layer 2: a compressed prefix trie whose nodes hold one snapshot per cache layer.

Each node owns a compressed edge of token ids ending at an absolute offset, and one
`Snapshot` per cache layer (or ``None`` where that layer holds nothing there):

* a ``needs_base`` (KV) snapshot covers exactly the node's edge ``[start, end)``;
* a whole-state snapshot (rotating window, recurrent) is the state at ``end``.

The trie knows nothing about models or generation. It only rearranges nodes and asks the
per-layer ``ops`` to split or merge snapshots when the node boundaries move. It keeps
exact running counters — bytes held, nodes, nodes and bytes per label — and its eviction
candidates in order (`eviction.Candidates`), so nothing a request does costs time that
grows with the trie. Edges are `Tokens` (read-only int64 arrays): a lookup compares
whole edges at once, O(edges) Python work however long the prompt.

Ownership: a snapshot handed to the trie (``add_child``, ``set_snapshots``) belongs to it
and is closed when dropped; ``take_snapshots`` hands ownership back. A call that raises
``ValueError`` for bad arguments changes nothing and takes ownership of nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..caches.snapshot import Snapshot
from . import eviction
from .journal import STRUCT, TOUCH, Journal
from .node import LayerOps, TrieNode, live_bytes
from .tokens import Tokens, as_tokens, common_prefix

__all__ = ["LayerOps", "TrieNode", "PrefixTrie"]


class PrefixTrie:
    """Compressed token trie of per-layer snapshots, with exact byte accounting and LRU eviction.

    ``ops[i]`` splits and merges the snapshots of layer ``i``. Not thread-safe: the
    manager changes it only inside its short critical sections.
    """

    def __init__(self, ops: Sequence[LayerOps]):
        self.ops: List[LayerOps] = list(ops)
        self.num_layers: int = len(self.ops)
        self._clock = 0
        self._nbytes = 0
        self._count = 0
        self._parked = 0
        self._serial = 0
        #: label -> [nodes, bytes]
        self._labels: Dict[Optional[str], List[int]] = {}
        self.root = TrieNode(Tokens(), 0, None, [None] * self.num_layers)
        self.root.uid = 0
        #: The eviction candidates, kept in order as the trie changes.
        self.candidates = eviction.Candidates(self)
        #: Told about every changed node when set (see `journal`); None: no tracking.
        self.journal: Optional[Journal] = None
        #: A second tier that keeps copies of snapshots (`eviction.Tier`, the disk): with
        #: one, eviction parks nodes it holds a copy of instead of dropping them.
        self.tier: Optional["eviction.Tier"] = None

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
        row[1] += sign * node.counted

    def _new(self, tokens: Tokens, end: int, parent: TrieNode, last_used: int) -> TrieNode:
        """A node linked into the counters (its caller links it into the tree)."""
        self._serial += 1
        node = TrieNode(tokens, end, parent, [None] * self.num_layers, last_used, self._serial)
        node.order = self.candidates
        self._count += 1
        self._count_label(node, +1)
        return node

    def _set(self, node: TrieNode, snapshots: List[Optional[Snapshot]]) -> None:
        """Install ``snapshots`` on ``node`` and fix the counters (no closing)."""
        self._count_label(node, -1)
        self._nbytes -= node.counted
        node.snapshots = snapshots
        self._parked -= node.parked
        node.parked = False
        node.counted = live_bytes(snapshots)
        self._nbytes += node.counted
        self._count_label(node, +1)
        self._reindex(node)
        self._changed(node)

    def recount(self, node: TrieNode, parked: Optional[bool] = None) -> int:
        """Count ``node``'s bytes again after its snapshots were parked or filled behind
        the trie's back (``parked``: set its flag too; no journal entry: nothing about it
        changed). Returns the change in bytes."""
        if node.detached:
            return 0
        before = node.counted
        self._count_label(node, -1)
        if parked is not None:
            self._parked += int(parked) - int(node.parked)
            node.parked = parked
        node.counted = live_bytes(node.snapshots)
        self._nbytes += node.counted - before
        self._count_label(node, +1)
        self._reindex(node)
        return node.counted - before

    def _detach(self, node: TrieNode) -> None:
        """Drop ``node`` from accounting and mark it dead; its snapshots must already be gone."""
        self._count_label(node, -1)
        self._nbytes -= node.counted
        self._count -= 1
        self._parked -= node.parked
        node.parked = False
        node.counted = 0
        node.snapshots = [None] * self.num_layers
        node.parent = None
        node.children = {}
        node.detached = True
        node.order = None
        self._changed(node)

    def _close_all(self, snapshots: Sequence[Optional[Snapshot]]) -> None:
        for s in snapshots:
            if s is not None:
                s.close()

    # -- validation --------------------------------------------------------------------
    def _require_attached(self, node: TrieNode) -> None:
        if node.detached:
            raise ValueError(f"{node!r} is no longer in the trie")

    def _require_not_root(self, node: TrieNode, what: str) -> None:
        if node is self.root:
            raise ValueError(f"cannot {what} the root")
        self._require_attached(node)

    def _check_snapshots(
        self, snapshots: Sequence[Optional[Snapshot]], start: int, end: int
    ) -> List[Optional[Snapshot]]:
        snapshots = list(snapshots)
        if len(snapshots) != self.num_layers:
            raise ValueError(f"{len(snapshots)} snapshots for {self.num_layers} layers")
        for i, s in enumerate(snapshots):
            if s is None:
                continue
            if s.closed:
                raise ValueError(f"layer {i}: snapshot {s!r} is closed")
            if s.needs_base:
                if (s.from_offset, s.to_offset) != (start, end):
                    raise ValueError(
                        f"layer {i}: {s!r} must span the node's edge [{start}, {end})"
                    )
            elif s.to_offset != end:
                raise ValueError(f"layer {i}: whole-state {s!r} must end at the node's end {end}")
        return snapshots

    # -- lookup ------------------------------------------------------------------------
    def find(self, tokens: Any) -> Tuple[List[TrieNode], int]:
        """Longest match of ``tokens`` (any token sequence or 1-D array) from the root.

        Returns ``(path, matched)``: the nodes walked (root excluded) and how many leading
        tokens match. The walk stops at a partially matched edge, which is still the last
        element of ``path``; ``matched`` then ends inside that node's edge. Because children
        are keyed by their first token, at most one child can match at each step, so the
        "full edge beats a longer partial match" rule holds by construction. Each edge is
        compared in one vectorised step: O(edges) Python work, O(tokens) in C.
        """
        toks = as_tokens(tokens)
        path: List[TrieNode] = []
        node, pos, n = self.root, 0, len(toks)
        while pos < n:
            child = node.children.get(int(toks[pos]))
            if child is None:
                break
            edge = child.tokens.array
            k = len(edge)
            m = common_prefix(edge, toks[pos:pos + k])
            path.append(child)
            pos += m
            if m < k:
                break
            node = child
        return path, pos

    def nodes(self) -> Iterator[TrieNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_to(self, node: TrieNode) -> List[TrieNode]:
        """Nodes from just below the root down to ``node`` (empty for the root)."""
        self._require_attached(node)
        path: List[TrieNode] = []
        while node is not self.root:
            path.append(node)
            if node.parent is None:
                raise ValueError(f"{node!r} is not linked to this trie's root")
            node = node.parent
        path.reverse()
        return path

    def tokens_to(self, node: TrieNode) -> List[int]:
        """The token sequence from offset 0 to ``node.end``."""
        out: List[int] = []
        for n in self.path_to(node):
            out.extend(n.tokens.tolist())
        return out

    # -- structure ---------------------------------------------------------------------
    def add_child(
        self, parent: TrieNode, tokens: Sequence[int], snapshots: Sequence[Optional[Snapshot]]
    ) -> TrieNode:
        """Attach a new child edge below ``parent``; the trie takes ownership of ``snapshots``.

        Raises ``ValueError`` (taking nothing) for an empty edge, a sibling with the same
        first token, a wrong number of snapshots or snapshots that do not fit the edge.
        """
        self._require_attached(parent)
        # The trie's own copy: the caller's array (often a view of a whole prompt) must
        # neither be kept alive by the edge nor change it.
        toks = Tokens.copy_of(tokens)
        if not len(toks):
            raise ValueError("a child edge needs at least one token")
        if toks[0] in parent.children:
            raise ValueError(f"{parent!r} already has a child starting with token {toks[0]}")
        end = parent.end + len(toks)
        snaps = self._check_snapshots(snapshots, parent.end, end)
        child = self._new(toks, end, parent, self.tick())
        parent.children[toks[0]] = child
        self._set(child, snaps)
        return child

    def split(self, node: TrieNode, at: int) -> TrieNode:
        """Cut ``node``'s edge at the absolute offset ``at`` and return the new upper half.

        The new parent holds ``[start, at)`` and the head of every snapshot; ``node`` keeps
        its identity, its children and the tail ``[at, end)``, so references to it stay
        valid (a path list taken earlier misses the new parent: rebuild it with `path_to`).
        Whole-state layers have no state at ``at``, so the new parent gets ``None`` there.
        The new parent starts unpinned (``in_use == 0``).
        """
        self._require_not_root(node, "split")
        start = node.start
        if not start < at < node.end:
            raise ValueError(f"split point {at} is not strictly inside [{start}, {node.end})")
        heads: List[Optional[Snapshot]] = []
        tails: List[Optional[Snapshot]] = []
        old = node.snapshots
        try:
            for i, s in enumerate(old):
                if s is None:
                    heads.append(None)
                    tails.append(None)
                    continue
                h, t = self.ops[i].split(s, at)
                heads.append(h)
                tails.append(t)
        except BaseException:
            # The layers split so far already consumed their inputs; drop everything so
            # the node stays consistent (no state) rather than half-split.
            self._close_all(heads + tails + list(old[len(heads):]))
            self._set(node, [None] * self.num_layers)
            raise
        k = at - start
        edge = node.tokens.array
        grand = node.parent
        assert grand is not None
        # Copies, so neither half keeps the other's tokens alive once it is evicted.
        upper = self._new(Tokens.copy_of(edge[:k]), at, grand, node.last_used)
        grand.children[node.tokens[0]] = upper
        node.tokens = Tokens.copy_of(edge[k:])
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self._set(upper, heads)
        self._set(node, tails)
        return upper

    def _merge_layer(self, i: int, a: Optional[Snapshot], b: Optional[Snapshot]) -> Optional[Snapshot]:
        if a is not None and b is not None:
            return self.ops[i].merge(a, b)
        if a is None and b is None:
            return None
        if b is not None and not b.needs_base:
            return b  # whole state at the child's end is still valid at the merged end
        # A KV delta missing one half cannot span the merged edge; a whole state at the
        # node's end is no longer at a node end. Either way nothing valid survives.
        (a if a is not None else b).close()  # type: ignore[union-attr]
        return None

    def merge_with_child(self, node: TrieNode) -> TrieNode:
        """Fold ``node`` into its only child and return the survivor, **the child object**.

        The child keeps its identity (a running request may hold the deeper node), gets
        ``node``'s tokens prepended and takes ``node``'s place under the grandparent. Its
        ``end`` and children are unchanged; ``last_used`` and ``in_use`` become the larger
        of the two (a request pins its whole path, so the pins coincide rather than add).
        ``node`` is detached and must not be used again. Per layer, both snapshots go to
        ``ops[i].merge``; a KV layer missing either half ends with no snapshot, a
        whole-state layer keeps the child's.
        """
        self._require_not_root(node, "merge")
        if len(node.children) != 1:
            raise ValueError(f"{node!r} has {len(node.children)} children, need exactly one")
        (child,) = node.children.values()
        old_a, old_b = node.snapshots, child.snapshots
        merged: List[Optional[Snapshot]] = []
        try:
            for i in range(self.num_layers):
                merged.append(self._merge_layer(i, old_a[i], old_b[i]))
        except BaseException:
            done = len(merged)
            self._close_all(merged + list(old_a[done + 1:]) + list(old_b[done + 1:]))
            self._set(node, [None] * self.num_layers)
            self._set(child, [None] * self.num_layers)
            raise
        grand = node.parent
        assert grand is not None
        child.tokens = node.tokens + child.tokens
        child.parent = grand
        grand.children[child.tokens[0]] = child
        child.last_used = max(child.last_used, node.last_used)
        child.in_use = max(child.in_use, node.in_use)
        self._detach(node)
        self._set(child, merged)  # re-indexes the child under its new key
        return child

    def remove(self, leaf: TrieNode) -> None:
        """Unlink an unpinned leaf and close its snapshots."""
        self._require_not_root(leaf, "remove")
        if leaf.children:
            raise ValueError(f"{leaf!r} has children; only leaves can be removed")
        if leaf.in_use:
            raise ValueError(f"{leaf!r} is in use")
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.tokens[0]]
        self._close_all(leaf.snapshots)
        self._detach(leaf)
        if parent is not self.root:
            self._reindex(parent)  # one child fewer: it may have become a candidate

    def set_snapshots(self, node: TrieNode, snapshots: Sequence[Optional[Snapshot]]) -> None:
        """Replace ``node``'s snapshots; old ones not passed again are closed."""
        self._require_not_root(node, "set snapshots on")
        snaps = self._check_snapshots(snapshots, node.start, node.end)
        keep = {id(s) for s in snaps if s is not None}
        old = node.snapshots
        self._set(node, snaps)
        self._close_all([s for s in old if s is not None and id(s) not in keep])

    def take_snapshots(self, node: TrieNode) -> List[Optional[Snapshot]]:
        """Detach ``node``'s snapshots and hand them, unclosed, to the caller."""
        self._require_attached(node)
        old = node.snapshots
        self._set(node, [None] * self.num_layers)
        return old

    def clear(self) -> None:
        """Close every snapshot and drop every node but the root."""
        for node in list(self.nodes()):
            self._close_all(node.snapshots)
            self._detach(node)
        self.root.children = {}
        self._nbytes = 0
        self._count = 0
        self._parked = 0
        self._labels = {}
        self.candidates.clear()
        if self.journal is not None:
            self.journal.cleared()

    # -- eviction (its own module) and diagnostics ---------------------------------------
    def evict(self, max_bytes: int) -> int:
        """Free snapshots until ``nbytes <= max_bytes``; see `eviction.evict`."""
        return eviction.evict(self, max_bytes)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        root = self.root
        L = self.num_layers
        if root.tokens or root.end != 0 or root.parent is not None:
            raise AssertionError(f"root must have an empty edge at 0 and no parent: {root!r}")
        if len(root.snapshots) != L or any(s is not None for s in root.snapshots):
            raise AssertionError("root must hold no snapshots")
        total = 0
        labels: dict = {}
        stack = [root]
        seen = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                raise AssertionError(f"{node!r} reached twice (cycle or shared child)")
            seen.add(id(node))
            if node.detached:
                raise AssertionError(f"detached {node!r} still linked in the trie")
            if node.in_use < 0:
                raise AssertionError(f"{node!r} has negative in_use")
            if node.last_used > self.clock:
                raise AssertionError(f"{node!r} last_used {node.last_used} > clock {self.clock}")
            if len(node.snapshots) != L:
                raise AssertionError(f"{node!r} has {len(node.snapshots)} snapshots for {L} layers")
            for key, child in node.children.items():
                where = f"child {child!r} of {node!r}"
                if child.parent is not node:
                    raise AssertionError(f"{where}: parent pointer is {child.parent!r}")
                if not child.tokens:
                    raise AssertionError(f"{where}: empty edge on a non-root node")
                if child.tokens[0] != key:
                    raise AssertionError(
                        f"{where}: keyed under {key} but its edge starts with {child.tokens[0]}"
                    )
                if child.start != node.end:
                    raise AssertionError(f"{where}: starts at {child.start}, parent ends at {node.end}")
                stack.append(child)
            if node is not root and len(node.tokens) != node.end - node.start:
                raise AssertionError(f"{node!r}: edge length does not match its offsets")
            node_bytes = 0
            for i, s in enumerate(node.snapshots):
                if s is None:
                    continue
                if s.closed:
                    raise AssertionError(f"{node!r} layer {i}: holds closed snapshot {s!r}")
                if s.needs_base:
                    if (s.from_offset, s.to_offset) != (node.start, node.end):
                        raise AssertionError(
                            f"{node!r} layer {i}: {s!r} does not span [{node.start}, {node.end})"
                        )
                elif s.to_offset != node.end:
                    raise AssertionError(
                        f"{node!r} layer {i}: whole-state {s!r} does not end at {node.end}"
                    )
                if node.parked and not s.parked:
                    raise AssertionError(f"{node!r} layer {i}: parked node holds resident {s!r}")
                node_bytes += s.nbytes
            if node.counted != node_bytes:
                raise AssertionError(
                    f"{node!r}: accounted {node.counted} B but its snapshots hold {node_bytes} B"
                )
            total += node_bytes
            if node is not root:
                if node.order is not self.candidates:
                    raise AssertionError(f"{node!r} does not report its changes to this trie")
                row = labels.setdefault(node.label, [0, 0])
                row[0] += 1
                row[1] += node_bytes
        if total != self.nbytes:
            raise AssertionError(f"nbytes counter {self.nbytes} != {total} held by snapshots")
        if self.node_count != len(seen) - 1:
            raise AssertionError(f"node counter {self.node_count} != {len(seen) - 1} nodes")
        counted = self.label_stats()
        recount = {k: (v[0], v[1]) for k, v in labels.items()}
        if counted != recount:
            raise AssertionError(f"label counters {counted} != {recount} recounted")
        self.candidates.check()

    def dump(self) -> str:
        """One line per node: ``[start,end) Nt bytes age in_use layers``.

        ``layers`` has one character per layer: ``K`` a KV (delta) snapshot, ``S`` a
        whole-state snapshot, ``.`` none.
        """
        lines = [f"root: {self.nbytes} B, clock {self.clock}"]

        # Iterative: a long-lived trie can be deeper than Python's recursion limit.
        stack = [(self.root.children[k], 1) for k in sorted(self.root.children, reverse=True)]
        while stack:
            c, depth = stack.pop()
            layers = "".join(
                "." if s is None else ("K" if s.needs_base else "S") for s in c.snapshots
            )
            lines.append(
                f"{'  ' * depth}[{c.start},{c.end}) {len(c.tokens)}t {c.nbytes}B "
                f"age={self.clock - c.last_used} in_use={c.in_use} {layers}"
            )
            stack.extend((c.children[k], depth + 1) for k in sorted(c.children, reverse=True))
        return "\n".join(lines)
