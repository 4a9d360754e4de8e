"""Invariant checks and a readable dump of a `PrefixTrie` (tests and debugging)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .trie import PrefixTrie


def check_invariants(trie: "PrefixTrie") -> None:
    """Raise ``AssertionError`` naming the first broken invariant."""
    root = trie.root
    L = trie.num_layers
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
        if node.last_used > trie.clock:
            raise AssertionError(f"{node!r} last_used {node.last_used} > clock {trie.clock}")
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
        if node._acct != node_bytes:
            raise AssertionError(
                f"{node!r}: accounted {node._acct} B but its snapshots hold {node_bytes} B"
            )
        total += node_bytes
        if node is not root:
            if node._owner is not trie:
                raise AssertionError(f"{node!r} does not report its changes to this trie")
            row = labels.setdefault(node.label, [0, 0])
            row[0] += 1
            row[1] += node_bytes
    if total != trie.nbytes:
        raise AssertionError(f"nbytes counter {trie.nbytes} != {total} held by snapshots")
    if trie.node_count != len(seen) - 1:
        raise AssertionError(f"node counter {trie.node_count} != {len(seen) - 1} nodes")
    counted = trie.label_stats()
    recount = {k: (v[0], v[1]) for k, v in labels.items()}
    if counted != recount:
        raise AssertionError(f"label counters {counted} != {recount} recounted")
    trie.candidates.check()


def dump(trie: "PrefixTrie") -> str:
    """One line per node: ``[start,end) Nt bytes age in_use layers``.

    ``layers`` has one character per layer: ``K`` a KV (delta) snapshot, ``S`` a
    whole-state snapshot, ``.`` none.
    """
    lines = [f"root: {trie.nbytes} B, clock {trie.clock}"]

    # Iterative: a long-lived trie can be deeper than Python's recursion limit.
    stack = [(trie.root.children[k], 1) for k in sorted(trie.root.children, reverse=True)]
    while stack:
        c, depth = stack.pop()
        layers = "".join(
            "." if s is None else ("K" if s.needs_base else "S") for s in c.snapshots
        )
        lines.append(
            f"{'  ' * depth}[{c.start},{c.end}) {len(c.tokens)}t {c.nbytes}B "
            f"age={trie.clock - c.last_used} in_use={c.in_use} {layers}"
        )
        stack.extend((c.children[k], depth + 1) for k in sorted(c.children, reverse=True))
    return "\n".join(lines)
