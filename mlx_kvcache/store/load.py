"""Loading an index's rows into a live trie: parked nodes now, data on first use (`lazy`).

Each row becomes a parked node (`PrefixTrie.recount`: on disk only, no memory held) whose
snapshots have the recorded kinds, offsets, shapes and dtypes, registered with the file
that holds them. Before anything is built, every file
the index lists is checked to be a plain name of this format, a regular file (a symlink,
FIFO or device is never opened) of the recorded size; a row that names anything else, a
file not in the index, an unknown parent, an edge that does not match its offsets or
layers that do not match the model is a damaged node: it is dropped with its subtree and
counted in one warning. Rows that could not be used are reported back so the next save
deletes them.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import mlx.core as mx
import numpy as np

from ..caches.snapshot import Snapshot
from ..prefix.node import TrieNode
from .format import NAME_DTYPE, FormatError, check_name, regular_size
from .index import decode_layers
from .lazy import Origin, warn


class Loaded:
    """What `install` did: tokens loaded, rows to delete, each node's saved use stamp."""

    def __init__(self) -> None:
        self.tokens = 0
        self.stale: Set[int] = set()
        self.stamps: Dict[int, int] = {}  # id(node) -> last_used in the index
        self.problems: List[str] = []


def _file_problems(d: Path, files: Dict[str, Tuple[int, int]]) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for name, (size, _) in files.items():
        try:
            check_name(name)
            have = regular_size(d / name)
            out[name] = None if have == size else \
                f"size {have} B, expected {size} B (truncated or replaced)"
        except FormatError as e:
            out[name] = str(e)
    return out


def install(store, d: Path, files: Dict[str, Tuple[int, int]], rows, adopt: bool) -> Loaded:
    """Add ``rows`` (parents first) under the live trie of ``store``. ``adopt``: the nodes
    keep the rows' ids (loading the store's own directory), so rows stay theirs."""
    trie = store.trie
    res = Loaded()
    bad_files = _file_problems(d, files)
    for name, (size, crc) in files.items():
        if bad_files[name] is None:
            store.verifier.set_file_info((d, name), size, crc)
    by_uid: Dict[int, TrieNode] = {0: trie.root}
    states = {0: hashlib.sha256()}
    skipped: Set[int] = set()
    added: List[Tuple[TrieNode, int, bool]] = []
    for uid, parent, blob, end, last_used, keep, layers in rows:
        uid = int(uid)
        try:
            if parent in skipped:
                raise LookupError  # below a dropped node: goes with it, silently
            node_parent = by_uid.get(int(parent))
            if node_parent is None:
                raise ValueError(f"node {uid}: unknown parent {parent}")
            if not isinstance(blob, bytes) or not blob or len(blob) % 8:
                raise ValueError(f"node {uid}: bad edge")
            toks = np.frombuffer(blob, dtype="<i8").tolist()
            if node_parent.end + len(toks) != int(end):
                raise ValueError(f"node {uid}: edge does not match its end offset")
            state = states[int(parent)].copy()
            state.update(blob)
            there = node_parent.children.get(toks[0])
            if there is not None:
                if there.uid == uid and list(there.tokens) == toks:
                    by_uid[uid], states[uid] = there, state  # this very node is live
                    continue
                raise LookupError  # the live trie already has this branch
            snaps, origins = _placeholders(store, d, uid, decode_layers(layers), files,
                                           bad_files, state)
            node = trie.add_child(node_parent, toks, snaps)
            trie.recount(node, parked=True)
        except LookupError:
            skipped.add(uid)
            res.stale.add(uid)
            continue
        except Exception as ex:
            res.problems.append(f"{type(ex).__name__}: {ex}")
            skipped.add(uid)
            res.stale.add(uid)
            continue
        if adopt:
            node.uid = uid
        for s, o in origins:
            store.verifier.register(s, o)
            store.holders[s] = node
        store.capturer.remember_state(node, state)
        if adopt:
            store.tier.note_row(node)
        by_uid[uid], states[uid] = node, state
        added.append((node, int(last_used), bool(keep)))
        res.stamps[id(node)] = int(last_used)
        if keep:
            store.keep.add(node)
        res.tokens += len(toks)
    _stamp(trie, added)
    if res.problems:
        warn(f"dropped {len(res.problems)} damaged node(s) of the prefix cache at {d} "
             f"with their subtrees (first: {res.problems[0]})")
    return res


def _stamp(trie, added: List[Tuple[TrieNode, int, bool]]) -> None:
    """Keep the saved least-recently-used order: as saved when the trie held nothing
    else, otherwise older than everything already there."""
    if not added:
        return
    if len(added) == sum(1 for _ in trie.nodes()):
        for node, stamp, _ in added:
            node.last_used = stamp
        trie.set_clock(max(s for _, s, _ in added))
        return
    base = trie.clock - len(added)
    for rank, (node, _, _) in enumerate(sorted(added, key=lambda x: x[1]), 1):
        node.last_used = base + rank


def _placeholders(store, d, uid, layers, files, bad_files, state):
    if not isinstance(layers, list) or len(layers) != store.trie.num_layers:
        raise ValueError(f"node {uid}: {len(layers)} layers, expected {store.trie.num_layers}")
    snaps: List[Optional[Snapshot]] = []
    origins = []
    for i, ent in enumerate(layers):
        if ent is None:
            snaps.append(None)
            continue
        fname = check_name(ent["file"])
        if fname not in files:
            raise ValueError(f"node {uid}: file {fname} is not in the index")
        if bad_files[fname] is not None:
            raise ValueError(f"snapshot file {fname}: {bad_files[fname]}")
        arrays = {str(name): mx.zeros([int(x) for x in shape], NAME_DTYPE[dtype])
                  for name, (shape, dtype) in ent["shapes"].items()}
        s = Snapshot.from_arrays(str(ent["kind"]), arrays,
                                 {k: int(v) for k, v in ent["meta"].items()})
        s.park()  # the zeros above were never evaluated: nothing was allocated
        sl = ent.get("slice")
        if sl is not None:
            lo, hi = int(sl[0]), int(sl[1])
            if not lo < hi:
                raise ValueError(f"node {uid}: empty slice {sl}")
            sl = (lo, hi)
        snaps.append(s)
        origins.append((s, Origin(d, fname, i, False, state, sl)))
    return snaps, origins


def new_holders() -> "weakref.WeakKeyDictionary":
    """Placeholder snapshot -> its node (to drop the node when its file turns out bad)."""
    return weakref.WeakKeyDictionary()
