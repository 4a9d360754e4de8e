"""What a save must write: the changed nodes' rows and new files, captured from the trie.

`capture` runs inside the manager's critical section, after each request: it drains the
trie's change journal (`prefix.journal`) and, per changed node only, records its row —
parent, edge, use stamp, per layer either the file that already holds the snapshot or
the snapshot's raw bytes for a new file (shared with the immutable arrays, so they can
be written after the lock is released by a thread that runs no MLX). Work is proportional
to the nodes that changed, never to the size of the trie. A node that was only used
(``TOUCH``) and whose snapshots are all on disk costs one stamp.

Captures taken faster than the writer writes them are merged (`Delta.absorb`): later
row images replace earlier ones, so a slow disk never queues work.

With ``cold`` (``cold_bits``), full-attention KV layers are written compressed: as a
`QuantizedSnapshot` of the same rows (``cold`` in the file's layer entry), filled back
dequantized (`lazy`). The row still describes the layer as it is in RAM, so a parked
node looks the same either way; sliding-window, recurrent and other whole states are
written as they are.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from ..caches.rows import quantize_rows
from ..caches.snapshot import Snapshot
from ..prefix.journal import TOUCH
from .format import DTYPE_NAME, RawTensor, new_file_name, to_raw, token_bytes
from .lazy import Verifier


@dataclass
class Row:
    """A node's row as of the capture."""

    uid: int
    parent: int
    tokens: bytes
    end: int
    last_used: int
    keep: bool
    layers: List[Optional[dict]]
    node: "weakref.ref"


@dataclass
class NewFile:
    """A snapshot file to write: the new snapshots of one node."""

    name: str
    tensors: Dict[str, RawTensor]
    metadata: Dict[str, str]
    layers: Dict[str, dict] = field(default_factory=dict)
    snaps: List[Tuple["weakref.ref[Snapshot]", int]] = field(default_factory=list)

    def header(self) -> Dict[str, str]:
        """The file's metadata (the layers it holds included)."""
        return {**self.metadata, "layers": json.dumps(self.layers, separators=(",", ":"))}

    @property
    def estimate(self) -> int:
        """Bytes on disk, within a generous header allowance."""
        data = sum(raw.nbytes for raw, _, _ in self.tensors.values())
        return (data + 256 + sum(len(v) for v in self.metadata.values())
                + 256 * (len(self.tensors) + len(self.layers)))


class Delta:
    """Changes for one directory: rows to write, stamps to move, rows to delete, new files.

    ``cleared``: delete every row first. ``full``: ``rows`` are the whole trie, delete
    every other row.
    """

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.cleared = False
        self.full = False
        self.rows: Dict[int, Row] = {}
        self.touches: Dict[int, Tuple[int, bool, "weakref.ref"]] = {}
        self.deletes: Set[int] = set()
        self.files: Dict[str, NewFile] = {}

    def __bool__(self) -> bool:
        return bool(self.cleared or self.full or self.rows or self.touches or self.deletes)

    def absorb(self, newer: "Delta") -> "Delta":
        """This delta followed by ``newer``, as one (returns self)."""
        self.files.update(newer.files)
        if newer.cleared or newer.full:
            self.cleared = self.cleared or newer.cleared
            self.full = newer.full
            self.rows, self.touches, self.deletes = newer.rows, newer.touches, newer.deletes
            return self
        for uid in newer.deletes:
            self.rows.pop(uid, None)
            self.touches.pop(uid, None)
            self.deletes.add(uid)
        for uid, row in newer.rows.items():
            self.rows[uid] = row
            self.touches.pop(uid, None)
            self.deletes.discard(uid)
        for uid, t in newer.touches.items():
            if uid in self.rows:
                self.rows[uid].last_used, self.rows[uid].keep = t[0], t[1]
            else:
                self.touches[uid] = t
        return self

    def strip(self) -> "Delta":
        """Keep the row changes but no unwritten data (a failed write is retried with the
        next capture; its snapshots are captured again when their nodes change)."""
        self.files = {}
        return self


def _shapes(s: Snapshot) -> Dict[str, Tuple[List[int], str]]:
    return {n: [list(shape), DTYPE_NAME[dt]] for n, (shape, dt) in s.shapes().items()}


def cold_form(s: Snapshot, cold: Optional[Tuple[int, int]]):
    """``(arrays, entry)`` of ``s`` as written: a KV layer compressed when ``cold`` is
    ``(bits, group_size)`` and its head dims allow it (else a smaller group, else as it
    is); None when written as it is."""
    if cold is None or s.kind != "kv":
        return None
    bits, group = cold
    k, v = s.keys, s.values  # type: ignore[attr-defined]
    for g in (group, 32):
        if k.shape[-1] % g == 0 and v.shape[-1] % g == 0:
            kq, vq = quantize_rows(k, g, bits), quantize_rows(v, g, bits)
            arrays = {f"{x}.{p}": a for x, q in (("k", kq), ("v", vq))
                      for p, a in zip(("w", "scales", "biases"), q)}
            meta = {**s.meta(), "bits": bits, "group_size": g, "start": -1}
            return arrays, {"kind": "quantized", "meta": meta, "cold": 1}
    return None


class Capturer:
    """Turns journal entries into a `Delta` for directory ``d`` (one per store).

    ``cold``: ``(bits, group_size)`` to write KV layers compressed (None: as they are).
    ``on_row(node)`` is told of every node that gets a row."""

    def __init__(self, trie, keep: set, verifier: Verifier,
                 cold: Optional[Tuple[int, int]] = None, on_row=None) -> None:
        self.trie, self.keep, self.verifier = trie, keep, verifier
        self.cold = cold
        self.on_row = on_row
        # SHA-256 state of each node's token prefix: a node's prefix never changes (a split
        # or merge keeps the surviving object's end and everything above it), so it is
        # computed once per node and extended for its children.
        self._states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def prefix_state(self, node):
        """``hashlib`` state of the tokens from offset 0 to ``node.end`` (do not update it)."""
        root, chain = self.trie.root, []
        n = node
        while n is not root and n not in self._states:
            chain.append(n)
            n = n.parent
        h = hashlib.sha256() if n is root else self._states[n]
        for m in reversed(chain):
            h = h.copy()
            h.update(token_bytes(m.tokens))
            self._states[m] = h
        return h

    def remember_state(self, node, state) -> None:
        self._states[node] = state

    def on_disk(self, node, d: Path) -> bool:
        """Every snapshot of ``node`` is in a file of ``d`` (written or being written)."""
        v = self.verifier
        return all(s is None or s.closed or v.location(s, d) is not None for s in node.snapshots)

    def capture(self, d: Path, changed: Dict, delta: Delta) -> Delta:
        """Add the rows of ``changed`` (node -> journal flags) to ``delta``."""
        root = self.trie.root
        for node, flag in changed.items():
            if node is root:
                continue
            if node.detached:
                delta.deletes.add(node.uid)
                delta.rows.pop(node.uid, None)
                delta.touches.pop(node.uid, None)
                continue
            if flag == TOUCH and node.uid not in delta.rows and self.on_disk(node, d):
                delta.touches[node.uid] = (node.last_used, node in self.keep, weakref.ref(node))
                continue
            delta.touches.pop(node.uid, None)
            delta.deletes.discard(node.uid)
            delta.rows[node.uid] = self.row(node, d, delta)
        return delta

    def row(self, node, d: Path, delta: Delta) -> Row:
        v = self.verifier
        if self.on_row is not None:
            self.on_row(node)
        layers: List[Optional[dict]] = []
        new: Optional[NewFile] = None
        filled = False
        for i, s in enumerate(node.snapshots):
            if s is None or s.closed or v.is_bad(s):
                layers.append(None)
                continue
            where = v.location(s, d)
            if where is None:
                o = v.origin(s)
                if o is not None and not o.verified:
                    if not v.ensure(s):
                        layers.append(None)  # unreadable elsewhere: leave this layer out
                        continue
                    filled = True
                if new is None:
                    new = self._new_file(node)
                    delta.files[new.name] = new
                form = cold_form(s, self.cold)
                arrays, ent = form if form is not None else (s.to_arrays()[0], {"kind": s.kind, "meta": s.meta()})
                desc = {}
                for name, a in arrays.items():
                    key = f"L{i}.{name}"
                    new.tensors[key] = to_raw(a)
                    desc[name] = [key, list(a.shape), DTYPE_NAME[a.dtype]]
                new.layers[str(i)] = {**ent, "arrays": desc}
                new.snaps.append((weakref.ref(s), i))
                v.set_pending(s, d, new.name, i)
                where = (new.name, None)
            ent = {"kind": s.kind, "meta": s.meta(), "file": where[0], "shapes": _shapes(s)}
            if where[1] is not None:
                ent["slice"] = list(where[1])
            layers.append(ent)
        if filled:  # read from another directory to be written here: in RAM now
            self.trie.recount(node, parked=False)
        parent = node.parent
        return Row(node.uid, 0 if parent is self.trie.root else parent.uid,
                   token_bytes(node.tokens), node.end, node.last_used, node in self.keep,
                   layers, weakref.ref(node))

    def _new_file(self, node) -> NewFile:
        return NewFile(new_file_name(), {}, {
            "prefix_sha256": self.prefix_state(node).hexdigest(), "start": str(node.start),
            "end": str(node.end), "tokens": token_bytes(node.tokens).hex()})
