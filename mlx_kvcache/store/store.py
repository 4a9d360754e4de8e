"""Layer 4: a prefix trie on disk, keyed by model identity (see ``format`` for the layout).

`PersistentStore` loads a saved trie into a live one (lazily: ``lazy``) and saves the
live one incrementally (``save``). Loading is fail-open: a missing, truncated, edited,
other-model, other-layers or other-version index is ignored as a whole with one
``RuntimeWarning`` starting ``"mlx_kvcache: "``; a bad snapshot file drops its node with
its subtree when first needed. A missing index is the normal first start: no warning.
Nothing here raises into a request.

A build never writes into a directory whose index has a newer format version, and never
touches another version's directory; a cache written by the format-1 builds (directly
under the root) is reported once and left alone. Placeholders count their full size
against the memory budget (as if resident), so the budget holds whatever gets verified
later. One writer per directory: two processes saving to one directory lose each other's
nodes (the loser sees a "missing" warning, never wrong output).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..caches.snapshot import Snapshot
from ..prefix.agreement import SOLO, Agreement
from ..prefix.node import TrieNode
from ..prefix.trie import PrefixTrie
from . import save as _save
from .agreed import agree_loaded
from .format import (
    FORMAT_VERSION, INDEX, MAGIC, NAME_DTYPE, DirLock, FormatError, decode_index,
    disk_usage, fsync_dir, prefix_digest, snapshot_files, version_dir,
)
from .lazy import GuardedOps, Origin, Verifier, warn

__all__ = ["PersistentStore"]


class PersistentStore:
    """Saves a trie under ``root`` and loads it back.

    Args:
        trie: the live trie (its per-layer ops get wrapped so disk-backed snapshots are
            verified before a split or merge reads them).
        signature: `mlx_kvcache.caches.layer_signature` of the model's caches.
        root: cache root; this model's files go to ``root/v<N>/<fingerprint[:16]>``.
        fingerprint: `model_fingerprint` of the model (and tokenizer).
        max_disk_bytes: budget for this model's directory (files + index); the least
            recently used leaves are left out of a save until it fits. ``None``: no limit.
        keep: the manager's set of deliberate restore points (saved as a flag per node).
        agree: the ranks of a sharded model load and drop nodes together (`agreed`).
    """

    def __init__(self, trie: PrefixTrie, signature: List[Any], root, fingerprint: str,
                 max_disk_bytes: Optional[int] = None, keep: Optional[set] = None,
                 agree: Agreement = SOLO):
        self.trie = trie
        self.signature = signature
        self.fingerprint = fingerprint
        self.root = Path(root).expanduser()
        self.max_disk_bytes = None if max_disk_bytes is None else int(max_disk_bytes)
        self.keep = keep if keep is not None else set()
        self.agree = agree
        self.verifier = Verifier()
        self._io = threading.Lock()  # one save at a time from this process
        self._foreign: set = set()  # directories holding a format this build must not touch
        self._told_legacy = False
        trie.ops = [o if isinstance(o, GuardedOps) else GuardedOps(o, self.verifier)
                    for o in trie.ops]

    def directory(self, root=None) -> Path:
        r = self.root if root is None else Path(root).expanduser()
        return version_dir(r) / self.fingerprint[:16]

    # -- before a restore ----------------------------------------------------------
    def before_request(self, tokens: Sequence[int]) -> None:
        """Check the files of the nodes a restore for ``tokens`` may read; drop bad ones.

        Call with the trie's lock held, right before restoring."""
        path: List[TrieNode] = []
        bad = 0
        try:
            path, _ = self.trie.find(tokens)
            bad = next((i for i, n in enumerate(path)
                        if not all([self.verifier.ensure(s) for s in n.snapshots])), len(path))
        except Exception as e:  # never break a request
            warn(f"prefix cache check failed ({type(e).__name__}: {e}); continuing")
            bad = 0
        if self.agree.size > 1:  # a file bad on any rank is bad on all of them
            bad = self.agree.all_min([bad])[0]
        if bad < len(path):
            self._drop_subtree(path[bad])

    def _drop_subtree(self, node: TrieNode) -> None:
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

    def purge_bad(self) -> None:
        """Drop nodes (with subtrees) whose files turned out bad or whose state was closed."""
        for n in list(self.trie.nodes()):
            if not n.detached and any(s is not None and (s.closed or self.verifier.is_bad(s))
                                      for s in n.snapshots):
                self._drop_subtree(n)

    # -- load ---------------------------------------------------------------------
    def _legacy_note(self) -> None:
        old = self.root / self.fingerprint[:16]
        if not self._told_legacy and (old / INDEX).exists():
            self._told_legacy = True
            warn(f"ignoring a prefix cache written by an older mlx_kvcache (format 1) at "
                 f"{old}; it is left as it is (delete it to reclaim {disk_usage(old)} B)")

    def load(self, root=None) -> int:
        """Merge the saved trie into the live one; returns the tokens loaded. Fail-open.

        Call with the trie's lock held; afterwards enforce the memory budget and
        `purge_bad`."""
        self._legacy_note()
        self._saved: Dict[int, int] = {}
        n = self._load_local(self.directory(root))
        if self.agree.size > 1:  # every rank, whatever its own load gave
            n = agree_loaded(self, self.agree, self._saved)
        return n

    def _load_local(self, d: Path) -> int:
        try:
            raw = (d / INDEX).read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as e:
            warn(f"cannot read the prefix cache index {d / INDEX} ({e}); starting empty")
            return 0
        try:
            idx = self._check_index(d, raw)
            files = {str(k): (int(v["size"]), int(v["crc32"])) for k, v in idx["files"].items()}
            nodes = list(idx["nodes"])
        except Exception as e:
            warn(f"ignoring the prefix cache at {d}: {type(e).__name__}: {e}")
            return 0
        return self._install(d, files, nodes)

    def _check_index(self, d: Path, raw: bytes) -> Dict[str, Any]:
        try:
            idx = decode_index(raw)
        except FormatError:
            try:
                head = json.loads(raw)
                newer = head.get("format") == MAGIC and int(head.get("version")) > FORMAT_VERSION
            except Exception:
                newer = False
            if newer:
                self._foreign.add(d)
                raise FormatError(f"format version {head.get('version')} is newer than this "
                                  f"build's ({FORMAT_VERSION}); it is left as it is") from None
            raise
        if idx.get("fingerprint") != self.fingerprint:
            raise FormatError("it was written for another model (fingerprint mismatch)")
        if idx.get("layers") != self.signature:
            raise FormatError("its cache layers do not match this model's")
        return idx

    def _install(self, d: Path, files: Dict[str, Tuple[int, int]], nodes: List[dict]) -> int:
        trie = self.trie
        by_id: Dict[int, TrieNode] = {0: trie.root}
        prefix: Dict[int, List[int]] = {0: []}
        skipped: set = set()
        problems: List[str] = []
        sizes_ok: Dict[str, bool] = {}
        for name, (size, crc) in files.items():
            self.verifier.set_file_info((d, name), size, crc)
            try:
                sizes_ok[name] = os.stat(d / name).st_size == size
            except OSError:
                sizes_ok[name] = False
        added: List[Tuple[TrieNode, int]] = []
        loaded = 0
        for e in nodes:
            nid = -1
            try:
                nid, pid = int(e["id"]), int(e["parent"])
                if pid in skipped:
                    skipped.add(nid)
                    continue
                parent = by_id.get(pid)
                if parent is None:
                    raise ValueError(f"node {nid}: unknown parent {pid}")
                toks = [int(t) for t in e["tokens"]]
                if not toks or parent.end + len(toks) != int(e["end"]):
                    raise ValueError(f"node {nid}: edge does not match its end offset")
                if toks[0] in parent.children:
                    skipped.add(nid)  # the live trie already has this branch
                    continue
                full = prefix[pid] + toks
                digest = prefix_digest(full)
                snaps, origins = self._placeholders(d, nid, e["layers"], files, sizes_ok, digest)
                node = trie.add_child(parent, toks, snaps)
            except Exception as ex:
                problems.append(f"{type(ex).__name__}: {ex}")
                skipped.add(nid)
                continue
            for s, o in origins:
                self.verifier.register(s, o)
            by_id[nid], prefix[nid] = node, full
            added.append((node, int(e.get("last_used", 0))))
            self._saved[id(node)] = added[-1][1]
            if e.get("keep"):
                self.keep.add(node)
            loaded += len(toks)
        # Keep the saved LRU order, after everything already in the trie.
        base = trie.clock - len(added)
        for rank, (node, _) in enumerate(sorted(added, key=lambda x: x[1]), 1):
            node.last_used = base + rank
        if problems:
            warn(f"dropped {len(problems)} damaged node(s) of the prefix cache at {d} "
                 f"with their subtrees (first: {problems[0]})")
        return loaded

    def _placeholders(self, d, nid, layers, files, sizes_ok, digest):
        if len(layers) != self.trie.num_layers:
            raise ValueError(f"node {nid}: {len(layers)} layers, expected {self.trie.num_layers}")
        snaps: List[Optional[Snapshot]] = []
        origins = []
        for ent in layers:
            if ent is None:
                snaps.append(None)
                continue
            fname = str(ent["file"])
            if fname not in files:
                raise ValueError(f"node {nid}: file {fname} is not in the index")
            if not sizes_ok[fname]:
                raise ValueError(f"snapshot file {fname} is missing or truncated")
            arrays, keys = {}, {}
            for name, (tkey, shape, dtype) in ent["arrays"].items():
                arrays[name] = mx.zeros([int(x) for x in shape], NAME_DTYPE[dtype])
                keys[name] = str(tkey)
            s = Snapshot.from_arrays(str(ent["kind"]), arrays,
                                     {k: int(v) for k, v in ent["meta"].items()})
            snaps.append(s)
            origins.append((s, Origin(d, fname, keys, False, digest)))
        return snaps, origins

    # -- save ---------------------------------------------------------------------
    def capture(self, root=None) -> Tuple[Path, List[_save.NodePlan]]:
        """What a save must write; call with the trie's lock held (quick, no I/O but stat)."""
        self.purge_bad()
        d = self.directory(root)
        return d, _save.capture(self.trie, self.keep, self.verifier, d)

    def write(self, d: Path, plans: List[_save.NodePlan]) -> int:
        """Write a `capture` (outside the trie's lock); returns bytes on disk.

        Raises ``OSError`` when the directory cannot be written, or after writing a
        consistent index without the snapshot files that failed to write (a full disk)."""
        if d in self._foreign:
            return 0  # a newer build's cache: never overwrite it
        header = {"fingerprint": self.fingerprint, "layers": self.signature}
        fixed = 400 + len(json.dumps(self.signature)) + len(self.fingerprint)
        with self._io:
            d.mkdir(parents=True, exist_ok=True)
            with DirLock(d):
                plans = _save.within_budget(plans, d, self.verifier, self.max_disk_bytes, fixed)
                size, problems = _save.write(d, plans, self.verifier, header)
        if problems:
            raise OSError(f"could not write {len(problems)} snapshot file(s) to {d} "
                          f"(first: {problems[0]}); those prefixes are not saved")
        return size

    def clear_disk(self) -> None:
        """Delete this model's saved cache: the index first (so a crash leaves an empty
        cache, never one with missing files), then the snapshot files."""
        d = self.directory()
        if d in self._foreign or not d.is_dir():
            return
        with self._io, DirLock(d):
            (d / INDEX).unlink(missing_ok=True)
            fsync_dir(d)
            for name in snapshot_files(d):
                (d / name).unlink(missing_ok=True)
                self.verifier.forget_file((d, name))

    def save(self, root=None) -> int:
        """`capture` then `write`; the caller holds the trie's lock for the whole call."""
        d, plans = self.capture(root)
        return self.write(d, plans)
