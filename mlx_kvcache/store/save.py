"""Saving a trie: capture what to write (under the caller's lock), then write it (outside).

`capture` is quick and reads the trie: per node its tokens, LRU stamp and, per layer,
either a reference to the file that already holds the snapshot or the snapshot's raw
bytes (shared with the immutable arrays, so they can be written after the lock is
released, by a thread that runs no MLX). `write` does the I/O:

1. leave out least recently used leaves until the directory's estimated size fits
   ``max_disk_bytes``;
2. free space first: files no new index will reference are deleted before anything new is
   written — behind an interim index that references only files that stay — so a full
   disk recovers instead of failing every save;
3. write each node's new snapshots to one fresh file (temporary name, fsync, rename);
   a failed write (e.g. ENOSPC) leaves those layers out instead of failing the save;
4. replace the index last, the same way.

A save killed at any point leaves an index whose every file is intact. Snapshots are
immutable, so a file once written is referenced, never rewritten.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..caches.snapshot import Snapshot
from .format import (
    DTYPE_NAME, FORMAT_VERSION, INDEX, MAGIC, RawTensor, encode_file, encode_index, fsync_dir,
    snapshot_files, to_raw, write_atomic,
)
from .lazy import Origin, Verifier


@dataclass
class LayerPlan:
    """One layer's snapshot at a node: already on disk (``file``) or to be written."""

    kind: str
    meta: Dict[str, int]
    shapes: Dict[str, Tuple[List[int], str]]
    file: Optional[str] = None
    keys: Optional[Dict[str, str]] = None
    arrays: Optional[Dict[str, RawTensor]] = None
    snap: Optional["weakref.ref[Snapshot]"] = None


@dataclass
class NodePlan:
    id: int
    parent: int
    tokens: List[int]
    end: int
    last_used: int
    keep: bool
    prefix: str
    layers: List[Optional[LayerPlan]] = field(default_factory=list)

    def entry(self) -> Dict[str, Any]:
        """The node's index entry (layers without a file are ``null``)."""
        return {
            "id": self.id, "parent": self.parent, "tokens": self.tokens, "end": self.end,
            "last_used": self.last_used, "keep": self.keep, "prefix": self.prefix,
            "layers": [None if lp is None or lp.file is None else {
                "kind": lp.kind, "meta": lp.meta, "file": lp.file,
                "arrays": {n: [lp.keys[n], list(s), dt] for n, (s, dt) in lp.shapes.items()},
            } for lp in self.layers],
        }


def _shapes(s: Snapshot) -> Dict[str, Tuple[List[int], str]]:
    arrays = s._arrays or {}  # noqa: SLF001 - shapes only, no data read
    return {n: (list(a.shape), DTYPE_NAME[a.dtype]) for n, a in arrays.items()}


def capture(trie, keep: set, verifier: Verifier, d: Path) -> List[NodePlan]:
    """What a save of ``trie`` into ``d`` must write; call with the trie's lock held."""
    ids = {id(trie.root): 0}
    digests = {id(trie.root): hashlib.sha256()}
    plans: List[NodePlan] = []
    on_disk = set(snapshot_files(d))  # one directory listing, not a stat per snapshot
    for n in trie.nodes():  # parents before children
        ids[id(n)] = len(ids)
        h = digests[id(n.parent)].copy()
        h.update(np.asarray(n.tokens, dtype=np.int64).tobytes())
        digests[id(n)] = h
        plan = NodePlan(ids[id(n)], ids[id(n.parent)], list(n.tokens), n.end, n.last_used,
                        n in keep, h.hexdigest())
        for s in n.snapshots:
            if s is None or s.closed or verifier.is_bad(s):
                plan.layers.append(None)
                continue
            o = verifier.origin(s)
            lp = LayerPlan(s.kind, s.meta(), _shapes(s), snap=weakref.ref(s))
            if o is not None and o.dir == d and o.file in on_disk:
                lp.file, lp.keys = o.file, dict(o.keys)
            elif o is not None and not o.verified and not verifier.ensure(s):
                lp = None  # unreadable elsewhere: leave this layer out
            else:
                lp.arrays = {name: to_raw(a) for name, a in s.to_arrays()[0].items()}
            plan.layers.append(lp)
        plans.append(plan)
    return plans


def _new_tensors(plan: NodePlan) -> Dict[str, RawTensor]:
    return {f"L{i}.{name}": a for i, lp in enumerate(plan.layers)
            if lp is not None and lp.arrays is not None for name, a in lp.arrays.items()}


def within_budget(plans: List[NodePlan], d: Path, verifier: Verifier,
                  max_disk_bytes: Optional[int], fixed: int) -> List[NodePlan]:
    """The plans to keep: least recently used leaves go until the estimate fits.

    Per node: its index entry (measured on a stand-in with the same field widths), its new
    file (data plus a generous header estimate) and every file it references (a file
    shared by several nodes counts for each: the safe side). ``fixed`` is the rest of
    the index.
    """
    if max_disk_bytes is None:
        return plans
    big = 10 ** len(str(len(plans) + 1))
    cost: Dict[int, int] = {}
    for p in plans:
        stand_in = NodePlan(big, big, p.tokens, p.end, p.last_used, True, p.prefix, [
            None if lp is None else LayerPlan(lp.kind, lp.meta, lp.shapes, f"n{'0' * 20}.safetensors",
                                              lp.keys or {k: f"L{i}.{k}" for k in lp.shapes})
            for i, lp in enumerate(p.layers)])
        c = len(json.dumps(stand_in.entry(), separators=(",", ":"))) + 1
        refs = {lp.file for lp in p.layers if lp is not None and lp.file is not None}
        c += sum((verifier.file_info((d, f)) or (0, 0))[0] + 80 for f in refs)
        new = _new_tensors(p)
        if new:
            c += sum(r.nbytes for r, _, _ in new.values()) + 200 + 120 * len(new)
        cost[p.id] = c
    total = fixed + sum(cost.values())
    children: Dict[int, int] = {}
    for p in plans:
        children[p.parent] = children.get(p.parent, 0) + 1
    by_id = {p.id: p for p in plans}
    heap = [(p.last_used, -p.end, p.id) for p in plans if not children.get(p.id)]
    heapq.heapify(heap)
    dropped = set()
    while heap and total > max_disk_bytes:
        _, _, pid = heapq.heappop(heap)
        dropped.add(pid)
        total -= cost[pid]
        parent = by_id[pid].parent
        if parent in by_id:
            children[parent] -= 1
            if children[parent] == 0:
                q = by_id[parent]
                heapq.heappush(heap, (q.last_used, -q.end, q.id))
    return [p for p in plans if p.id not in dropped]


def _index_body(plans: List[NodePlan], header: Dict[str, Any], verifier: Verifier,
                d: Path) -> Dict[str, Any]:
    files = {}
    for p in plans:
        for lp in p.layers:
            if lp is not None and lp.file is not None:
                size, crc = verifier.file_info((d, lp.file)) or (0, 0)
                files[lp.file] = {"size": size, "crc32": crc}
    return {"format": MAGIC, "version": FORMAT_VERSION, **header, "saved_at": time.time(),
            "files": dict(sorted(files.items())), "nodes": [p.entry() for p in plans]}


def _on_disk_index_files(d: Path) -> set:
    """Files the index now on disk references (best effort: an unreadable index references none)."""
    try:
        return set(json.loads((d / INDEX).read_bytes()).get("files", {}))
    except Exception:
        return set()


def write(d: Path, plans: List[NodePlan], verifier: Verifier, header: Dict[str, Any]) -> Tuple[int, List[str]]:
    """Write ``plans`` into ``d`` (steps 2-4 of the module doc); the caller holds the
    directory lock. Returns (bytes on disk, problems met)."""
    problems: List[str] = []
    keep_files = {lp.file for p in plans for lp in p.layers if lp is not None and lp.file}
    doomed = [f for f in snapshot_files(d) if f not in keep_files]
    if set(doomed) & _on_disk_index_files(d):
        # The current index references files about to go: replace it first by one that
        # references only files that stay (new layers not written yet are left out).
        interim = [NodePlan(p.id, p.parent, p.tokens, p.end, p.last_used, p.keep, p.prefix,
                            [lp if lp is not None and lp.file else None for lp in p.layers])
                   for p in plans]
        try:
            write_atomic(d / INDEX, [encode_index(_index_body(interim, header, verifier, d))])
        except OSError:
            (d / INDEX).unlink(missing_ok=True)  # no index is a valid, empty cache
    for f in doomed:
        try:
            os.unlink(d / f)
        except OSError:
            pass
        verifier.forget_file((d, f))
    for p in plans:
        tensors = _new_tensors(p)
        if not tensors:
            continue
        fname = f"n{uuid.uuid4().hex[:20]}.safetensors"
        try:
            blob = encode_file(tensors, {"prefix_sha256": p.prefix})
            size, crc = write_atomic(d / fname, [blob])
        except OSError as e:
            problems.append(f"{type(e).__name__}: {e}")
            for i, lp in enumerate(p.layers):
                if lp is not None and lp.arrays is not None:
                    p.layers[i] = None
            continue
        verifier.set_file_info((d, fname), size, crc)
        for i, lp in enumerate(p.layers):
            if lp is None or lp.arrays is None:
                continue
            lp.file, lp.keys = fname, {name: f"L{i}.{name}" for name in lp.arrays}
            lp.arrays = None
            s = lp.snap() if lp.snap is not None else None
            if s is not None and not s.closed:
                verifier.register(s, Origin(d, fname, lp.keys, True, p.prefix))
    blob = encode_index(_index_body(plans, header, verifier, d))
    write_atomic(d / INDEX, [blob])
    fsync_dir(d)
    files = {lp.file for p in plans for lp in p.layers if lp is not None and lp.file}
    return len(blob) + sum((verifier.file_info((d, f)) or (0, 0))[0] for f in files), problems
