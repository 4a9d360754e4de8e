"""Layer 2: a compressed prefix trie whose nodes hold one snapshot per cache layer.

Each node owns a compressed edge of token ids ending at an absolute offset, and one
`Snapshot` per cache layer (or ``None`` where that layer holds nothing there):

* a ``needs_base`` (KV) snapshot covers exactly the node's edge ``[start, end)``;
* a whole-state snapshot (rotating window, recurrent) is the state at ``end``.

The trie knows nothing about models or generation. It only rearranges nodes and asks the
per-layer ``ops`` to split or merge snapshots when the node boundaries move, and it keeps an
exact running count of the bytes it holds so the manager can enforce a byte budget.

Ownership: a snapshot handed to the trie (``add_child``, ``set_snapshots``) belongs to it
and is closed when dropped; ``take_snapshots`` hands ownership back. A call that raises
``ValueError`` for bad arguments changes nothing and takes ownership of nothing.
"""

from __future__ import annotations

import heapq
from typing import Iterator, List, Optional, Protocol, Sequence, Tuple

from .snapshot import Snapshot

__all__ = ["LayerOps", "TrieNode", "PrefixTrie"]


class LayerOps(Protocol):
    """What the trie needs from one cache layer (the cache objects themselves qualify)."""

    def split(self, snapshot: Snapshot, at: int) -> Tuple[Optional[Snapshot], Optional[Snapshot]]:
        """``[a, c)`` -> ``([a, at), [at, c))``; takes ownership of ``snapshot``."""
        ...

    def merge(self, parent: Snapshot, child: Snapshot) -> Optional[Snapshot]:
        """Adjacent ``[a, b)`` + ``[b, c)`` -> ``[a, c)``; takes ownership of both."""
        ...


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
        "detached", "_acct",
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
        gone = " detached" if self.detached else ""
        return (
            f"TrieNode([{self.start},{self.end}) {len(self.tokens)}t "
            f"{held}/{len(self.snapshots)} snaps in_use={self.in_use}{gone})"
        )


class PrefixTrie:
    """Compressed token trie of per-layer snapshots, with exact byte accounting and LRU eviction.

    ``ops[i]`` splits and merges the snapshots of layer ``i``. Not thread-safe: callers
    serialise access (the manager runs one request at a time).
    """

    def __init__(self, ops: Sequence[LayerOps]):
        self.ops: List[LayerOps] = list(ops)
        self.num_layers: int = len(self.ops)
        self._clock = 0
        self._nbytes = 0
        self.root = TrieNode([], 0, None, [None] * self.num_layers)

    # -- clock / bytes -----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by every snapshot in the trie (running counter, exact)."""
        return self._nbytes

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

    def touch(self, node: TrieNode) -> None:
        """Mark ``node`` as used now."""
        node.last_used = self.tick()

    def _set(self, node: TrieNode, snapshots: List[Optional[Snapshot]]) -> None:
        """Install ``snapshots`` on ``node`` and fix the byte counter (no closing)."""
        self._nbytes -= node._acct
        node.snapshots = snapshots
        node._acct = _live_bytes(snapshots)
        self._nbytes += node._acct

    def _detach(self, node: TrieNode) -> None:
        """Drop ``node`` from accounting and mark it dead; its snapshots must already be gone."""
        self._nbytes -= node._acct
        node._acct = 0
        node.snapshots = [None] * self.num_layers
        node.parent = None
        node.children = {}
        node.detached = True

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
    def find(self, tokens: Sequence[int]) -> Tuple[List[TrieNode], int]:
        """Longest match of ``tokens`` from the root.

        Returns ``(path, matched)``: the nodes walked (root excluded) and how many leading
        tokens match. The walk stops at a partially matched edge, which is still the last
        element of ``path``; ``matched`` then ends inside that node's edge. Because children
        are keyed by their first token, at most one child can match at each step, so the
        "full edge beats a longer partial match" rule holds by construction.
        """
        toks = _as_tokens(tokens)
        path: List[TrieNode] = []
        node, pos, n = self.root, 0, len(toks)
        while pos < n:
            child = node.children.get(toks[pos])
            if child is None:
                break
            edge = child.tokens
            k = len(edge)
            if toks[pos:pos + k] == edge:
                path.append(child)
                pos += k
                node = child
                continue
            m = 1  # the first token matched through the dict key
            limit = min(k, n - pos)
            while m < limit and edge[m] == toks[pos + m]:
                m += 1
            path.append(child)
            pos += m
            break
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
            out.extend(n.tokens)
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
        toks = _as_tokens(tokens)
        if not toks:
            raise ValueError("a child edge needs at least one token")
        if toks[0] in parent.children:
            raise ValueError(f"{parent!r} already has a child starting with token {toks[0]}")
        end = parent.end + len(toks)
        snaps = self._check_snapshots(snapshots, parent.end, end)
        child = TrieNode(toks, end, parent, [None] * self.num_layers, self.tick())
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
        upper = TrieNode(node.tokens[:k], at, node.parent, [None] * self.num_layers, node.last_used)
        grand = node.parent
        assert grand is not None
        grand.children[node.tokens[0]] = upper
        node.tokens = node.tokens[k:]
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
        self._set(child, merged)
        self._detach(node)
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

    # -- eviction ----------------------------------------------------------------------
    def _evictable(self, node: TrieNode) -> bool:
        return (
            not node.detached
            and node is not self.root
            and node.in_use == 0
            and len(node.children) <= 1
        )

    @staticmethod
    def _evict_key(node: TrieNode) -> Tuple[int, int, int]:
        # Oldest first; on a tie the deeper node (so a chain is eaten from its tip), then
        # the bigger one (frees the most).
        return (node.last_used, -node.end, -node.nbytes)

    def evict(self, max_bytes: int) -> int:
        """Free snapshots until ``nbytes <= max_bytes`` or no candidate is left.

        Candidates: unpinned non-root nodes with at most one child, so branch points
        (shared prefixes) survive until only one branch is left. Leaves are removed;
        single-child nodes are merged into their child (frees whole-state snapshots; for
        KV it frees nothing but shortens the chain so the leaf can go next). Each step
        drops one node, so the loop ends. Returns the bytes freed.
        """
        before = self._nbytes
        if before <= max_bytes:
            return 0
        heap: List[Tuple[Tuple[int, int, int], int, TrieNode]] = []
        seq = 0

        def push(n: TrieNode) -> None:
            nonlocal seq
            if self._evictable(n):
                heapq.heappush(heap, (self._evict_key(n), seq, n))
                seq += 1

        for n in self.nodes():
            push(n)
        # Entries go stale when a node changes; every change below pushes a fresh entry,
        # so a popped entry whose key no longer matches is simply dropped.
        while heap and self._nbytes > max_bytes:
            key, _, n = heapq.heappop(heap)
            if not self._evictable(n) or key != self._evict_key(n):
                continue
            parent = n.parent
            assert parent is not None
            if n.children:
                push(self.merge_with_child(n))
            else:
                self.remove(n)
                push(parent)
        return before - self._nbytes

    # -- diagnostics -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        root = self.root
        L = self.num_layers
        if root.tokens or root.end != 0 or root.parent is not None:
            raise AssertionError(f"root must have an empty edge at 0 and no parent: {root!r}")
        if len(root.snapshots) != L or any(s is not None for s in root.snapshots):
            raise AssertionError("root must hold no snapshots")
        total = 0
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
            if node.last_used > self._clock:
                raise AssertionError(f"{node!r} last_used {node.last_used} > clock {self._clock}")
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
                node_bytes += s.nbytes
            if node._acct != node_bytes:
                raise AssertionError(
                    f"{node!r}: accounted {node._acct} B but its snapshots hold {node_bytes} B"
                )
            total += node_bytes
        if total != self._nbytes:
            raise AssertionError(f"nbytes counter {self._nbytes} != {total} held by snapshots")

    def dump(self) -> str:
        """One line per node: ``[start,end) Nt bytes age in_use layers``.

        ``layers`` has one character per layer: ``K`` a KV (delta) snapshot, ``S`` a
        whole-state snapshot, ``.`` none.
        """
        lines = [f"root: {self._nbytes} B, clock {self._clock}"]

        # Iterative: a long-lived trie can be deeper than Python's recursion limit.
        stack = [(self.root.children[k], 1) for k in sorted(self.root.children, reverse=True)]
        while stack:
            c, depth = stack.pop()
            layers = "".join(
                "." if s is None else ("K" if s.needs_base else "S") for s in c.snapshots
            )
            lines.append(
                f"{'  ' * depth}[{c.start},{c.end}) {len(c.tokens)}t {c.nbytes}B "
                f"age={self._clock - c.last_used} in_use={c.in_use} {layers}"
            )
            stack.extend((c.children[k], depth + 1) for k in sorted(c.children, reverse=True))
        return "\n".join(lines)
