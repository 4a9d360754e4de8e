"""Layer 4: a prefix trie on disk, keyed by model identity (see ``format`` for the layout).

`PersistentStore` loads a saved trie into a live one (lazily: ``lazy``; ``load``) and
keeps the directory up to date by writing only what changed: the trie tells the store's
change journal which nodes changed (`prefix.journal`), a capture after each request turns
those into rows and new files (``delta``), and a writer applies them to the SQLite index
in one transaction (``index``, ``save``). Per request the work is proportional to the
nodes that changed, never to the size of the trie.

Loading is fail-open: a damaged, other-model, other-layers or other-version index is
ignored as a whole with one ``RuntimeWarning`` starting ``"mlx_kvcache: "`` (and replaced
by the next save); a bad snapshot file drops its node with its subtree when first
needed. A missing index is the normal first start: no warning. Nothing here raises into
a request.

A build never writes into a directory whose index has a newer format version, and never
touches another version's directory; caches of older formats (format 1 directly under
the root, format 2 under ``v2/``) are reported once and left alone: the cache is derived
data that the next requests recompute, an older build may still be using its directory,
and a migration would keep an old format's reader alive forever. Two processes may share
a directory: every change is a transaction, node ids are random, and a row only ever
references a file that its transaction saw listed; what one process deletes the other
recomputes (never wrong output).

The directory is the trie's second tier (`tiers`): the memory budget parks nodes whose
files are written instead of dropping them, a request fills the parked nodes it needs,
and the disk budget's evictions remove parked nodes from the trie.
"""

from __future__ import annotations

import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..prefix.agreement import SOLO, Agreement
from ..prefix.journal import STRUCT, Journal
from ..prefix.node import TrieNode
from ..prefix.trie import PrefixTrie
from . import save as _save
from .agreed import agree_loaded
from .delta import Capturer, Delta
from .format import FORMAT_VERSION, DirLock, FormatError, collectable, fsync_dir, model_dir
from .index import INDEX, Index, header_version
from .lazy import GuardedOps, Verifier, warn
from .load import install, new_holders
from .opening import legacy_note, open_to_read, open_to_write
from .tiers import DiskTier

__all__ = ["PersistentStore"]

_QUEUE_LIMIT = 1 << 16  # rows a failing disk may owe before the next save writes all


class PersistentStore:
    """Saves a trie under ``root`` and loads it back.

    Args:
        trie: the live trie (its per-layer ops get wrapped so disk-backed snapshots are
            verified before a split or merge reads them; it gets a change journal).
        signature: `mlx_kvcache.caches.layer_signature` of the model's caches.
        root: cache root; this model's files go to ``root/v<N>/<fingerprint[:16]>``.
        fingerprint: `model_fingerprint` of the model (and tokenizer).
        max_disk_bytes: budget for this model's directory (files and index); the least
            recently used nodes without saved children leave the disk until it fits.
            ``None``: no limit. The directory has one budget, recorded in its index and
            followed by every process writing it (counting what the index holds, every
            process's files): a store records its own at its first write.
        default_budget: ``max_disk_bytes`` is a default, not the user's choice: a budget
            already recorded for the directory is followed instead of replaced.
        keep: the manager's set of deliberate restore points (saved as a flag per node).
        agree: the ranks of a sharded model load and drop nodes together (`agreed`).
        cold_bits: write full-attention KV layers compressed to this many bits (lossy;
            None: as they are). Part of what names the directory (pass a fingerprint
            that includes it), so compressed and exact caches never mix.
        tier: make the directory the trie's second tier (`tiers`): memory eviction parks
            nodes that are on disk instead of dropping them.
    """

    def __init__(self, trie: PrefixTrie, signature: List[Any], root, fingerprint: str,
                 max_disk_bytes: Optional[int] = None, keep: Optional[set] = None,
                 agree: Agreement = SOLO, cold_bits: Optional[int] = None, tier: bool = True,
                 default_budget: bool = False):
        self.trie = trie
        self.signature = signature
        self.fingerprint = fingerprint
        self.root = Path(root).expanduser()
        self._max_disk_bytes = None if max_disk_bytes is None else int(max_disk_bytes)
        self._claim = max_disk_bytes is not None  # record ours at the next write
        self._follow = bool(default_budget)  # a recorded budget wins over ours
        self.keep = keep if keep is not None else set()
        self.agree = agree
        inner = [o.inner if isinstance(o, GuardedOps) else o for o in trie.ops]
        self.verifier = Verifier(inner)
        trie.ops = [GuardedOps(o, self.verifier, i) for i, o in enumerate(inner)]
        #: Placeholder snapshot -> its node (a bad file drops the node).
        self.holders = new_holders()
        self.capturer = Capturer(trie, self.keep, self.verifier,
                                 None if cold_bits is None else (int(cold_bits), 64))
        self.tier = DiskTier(trie, self.verifier, self.capturer, self.agree, self.keep,
                             self.holders, self.directory)
        self.capturer.on_row = self.tier.note_row
        if tier:
            trie.tier = self.tier
            trie.candidates.rebuild()  # branch points are candidates too now (to park)
        self.journal = Journal()
        for n in trie.nodes():  # what the trie held before it had a journal
            self.journal.note(n, STRUCT)
        trie.journal = self.journal
        self._io = threading.Lock()  # one writer (and index user) at a time in this process
        self._qmu = threading.Lock()  # the queue of captured changes
        self._queue: Optional[Delta] = None
        self._need_full = False
        self._resync: "weakref.WeakSet[TrieNode]" = weakref.WeakSet()
        self._stale: Set[int] = set()
        self._index: Optional[Index] = None
        self._reset = False  # the index on disk is unusable: the next write replaces it
        self._swept = False
        self._foreign: set = set()  # directories holding a format this build must not touch
        self._disk_bytes = 0
        self._saved: dict = {}

    @property
    def max_disk_bytes(self) -> Optional[int]:
        """The directory's budget in force (the recorded one, once read or written)."""
        return self._max_disk_bytes

    @max_disk_bytes.setter
    def max_disk_bytes(self, n: Optional[int]) -> None:
        """A new budget for the directory: recorded at the next write, for every process."""
        self._max_disk_bytes = None if n is None else int(n)
        self._claim, self._follow = n is not None, False

    def directory(self, root=None) -> Path:
        return model_dir(self.root if root is None else root, self.fingerprint)

    @property
    def disk_bytes(self) -> int:
        """Bytes this model's directory held after the last load or write (no I/O)."""
        return self._disk_bytes

    # -- before a restore ----------------------------------------------------------
    def before_request(self, tokens: Sequence[int]) -> List[Tuple[int, int]]:
        """Fill the parked nodes a restore for ``tokens`` may read (checked); drop bad
        ones. Returns the ``(start, end)`` of the nodes that came from disk.

        Call with the trie's lock held, right before restoring."""
        return self.tier.before_request(tokens)

    def prefetch(self, tokens: Sequence[int]) -> int:
        """Start reading the files of the parked nodes a request for ``tokens`` would
        restore (no MLX; call with the trie's lock held, from any thread). Returns how
        many files. Never raises."""
        try:
            path, _ = self.trie.find(tokens)
            return self.verifier.prefetch(s for n in path if n.parked for s in n.snapshots)
        except Exception:  # noqa: BLE001 - an early read is only a head start
            return 0

    def purge_bad(self) -> None:
        """Drop nodes (with subtrees) whose files turned out bad or whose state was closed
        (walks the trie: call after a load, not per request)."""
        self.verifier.found_bad()
        for n in list(self.trie.nodes()):
            if not n.detached and any(s is not None and (s.closed or self.verifier.is_bad(s))
                                      for s in n.snapshots):
                self.tier.drop_subtree(n)

    def _drop_found_bad(self) -> None:
        if self.agree.size > 1:
            # Found on this rank only: dropping here alone would make the tries differ.
            # Those nodes go on every rank when a request reaches them (`before_request`).
            return
        for s in self.verifier.found_bad():
            n = self.holders.get(s)
            if n is not None and not n.detached:
                self.tier.drop_subtree(n)

    # -- load ---------------------------------------------------------------------
    def load(self, root=None) -> int:
        """Merge the saved trie into the live one; returns the tokens loaded. Fail-open.

        Call with the trie's lock held; afterwards enforce the memory budget and
        `purge_bad`."""
        legacy_note(self.root, self.fingerprint)
        d = self.directory(root)
        own = d == self.directory()
        with self._io:
            n = self._load_local(d, own)
        if self.agree.size > 1:  # every rank, whatever its own load gave
            n = agree_loaded(self, self.agree, self._saved)
        return n

    def _open(self, d: Path) -> Optional[Index]:
        """The index in ``d`` if usable; warns and returns None otherwise."""
        try:
            idx, why, newer = open_to_read(d, self.fingerprint, self.signature)
        except (FormatError, OSError, sqlite3.Error, ValueError) as e:
            idx, why, newer = None, f"{type(e).__name__}: {e}", False
        if why is not None:
            warn(f"ignoring the prefix cache at {d}: {why}")
            if newer:
                self._foreign.add(d)
            elif d == self.directory():
                self._reset = True  # the next write replaces it
        return idx

    def _load_local(self, d: Path, own: bool) -> int:
        self._saved = {}
        idx = self._open(d)
        if idx is None:
            return 0
        try:
            files, rows = idx.files(), list(idx.rows())
            size = idx.files_bytes() + idx.db_bytes()
        except sqlite3.Error as e:
            idx.close(checkpoint=False)
            warn(f"ignoring the prefix cache at {d}: the index is damaged ({e})")
            self._reset = own
            return 0
        journal, self.trie.journal = self.trie.journal, (None if own else self.trie.journal)
        try:  # loaded rows are on disk already: nothing to write for them
            res = install(self, d, files, rows, adopt=own)
        finally:
            self.trie.journal = journal
        self._saved = res.stamps
        if own:
            self._stale |= res.stale
            self._disk_bytes = size
            self._shared_budget(idx, write=False)
            if self._index is not None:
                self._index.close()
            self._index = idx
        else:
            idx.close()
        return res.tokens

    # -- save ---------------------------------------------------------------------
    def capture(self, root=None) -> Tuple[Path, Optional[Delta]]:
        """Record what changed since the last capture; call with the trie's lock held
        (quick, no I/O). Returns what `write` takes."""
        self._drop_found_bad()
        d = self.directory(root)
        if d != self.directory():  # another directory: everything, written there directly
            return d, self._full(d)
        changed, cleared, overflowed = self.journal.drain()
        with self._qmu:
            need_full, self._need_full = self._need_full or overflowed, False
            resync = list(self._resync)
            self._resync = weakref.WeakSet()
        if need_full:
            delta = self._full(d)
        else:
            delta = Delta(d)
            delta.cleared = cleared
            if not cleared:
                delta.deletes |= self._stale
            for n in resync:
                if not n.detached:
                    changed[n] = STRUCT
            self.tier.settle(changed)
            for n in self.journal.drain()[0]:  # nodes the settling removed
                changed.setdefault(n, STRUCT)
            self.capturer.capture(d, changed, delta)
        self._stale = set()
        with self._qmu:
            self._queue = delta if self._queue is None else self._queue.absorb(delta)
        return d, None

    def _full(self, d: Path) -> Delta:
        delta = Delta(d)
        delta.full = True
        return self.capturer.capture(d, {n: STRUCT for n in self.trie.nodes()}, delta)

    def write(self, d: Path, delta: Optional[Delta] = None) -> int:
        """Write what `capture` recorded (outside the trie's lock); returns bytes on disk.

        Raises ``OSError`` when the directory cannot be written, or after committing
        the rows whose files could be written (a full disk)."""
        if d in self._foreign:
            return 0
        with self._io:
            if delta is None:
                with self._qmu:
                    delta, self._queue = self._queue, None
                if delta is None:
                    return self._disk_bytes
            try:
                out, size = self._apply(d, delta, own=delta.dir == self.directory())
            except BaseException as e:
                if delta.dir == self.directory():
                    self._requeue(delta)  # retried with the next capture
                if isinstance(e, (OSError, sqlite3.Error)):
                    raise OSError(f"cannot write the prefix cache at {d}: {e}") from e
                raise
        self.tier.evicted(out.evicted)
        with self._qmu:
            for ref in out.resync:
                n = ref()
                if n is not None:
                    self._resync.add(n)
        if out.problems:
            raise OSError(f"could not write {len(out.problems)} snapshot file(s) to {d} "
                          f"(first: {out.problems[0]}); those prefixes are not saved")
        return size

    def _apply(self, d: Path, delta: Delta, own: bool):
        d.mkdir(parents=True, exist_ok=True)
        with DirLock(d):
            idx = self._index_for(d, own)
            if idx is None:
                return _save.Outcome(), 0  # a newer format's directory: never touched
            try:
                if not own or not self._swept:
                    _save.sweep(idx, d, self.verifier)
                    self._swept = own
                # Our budget is recorded only after the write has made room for it: on a
                # full disk even that one row cannot be committed before files go.
                budget = self._shared_budget(idx, write=False) if own else self.max_disk_bytes
                idx.tune((budget or 64 << 20) // 16)
                out = _save.write(idx, delta, self.verifier, budget)
                if own and self._claim:  # ours is still to be recorded
                    self._shared_budget(idx)
                size = idx.files_bytes() + idx.db_bytes()
            finally:
                if not own:
                    idx.close()
        if own:
            self._disk_bytes = size
        return out, size

    def _shared_budget(self, idx: Index, write: bool = True) -> Optional[int]:
        """The directory's one budget (the caller holds the directory lock): ours is
        recorded at our first write (``write``) unless it is a default and one is recorded
        already; after that, whatever is recorded (another process may set its own)."""
        try:
            recorded = idx.budget()
        except sqlite3.Error:
            recorded = None
        if self._claim and self._follow and recorded is not None:
            self._claim = False  # a default never replaces a recorded budget
        if self._claim:
            if not write:
                return self.max_disk_bytes
            if recorded != self.max_disk_bytes:
                idx.set_budget(self.max_disk_bytes)
            self._claim = False
        elif recorded is not None:
            self._max_disk_bytes = recorded
        return self.max_disk_bytes

    def _index_for(self, d: Path, own: bool) -> Optional[Index]:
        """``d``'s index open for writing (`opening.open_to_write`); None for a newer
        format's directory. Call with the directory lock held."""
        if own and self._index is not None:
            if not self._index.readonly and self._index.still_there():
                return self._index
            self._index.close(checkpoint=self._index.still_there())
            self._index = None
            self._swept = False
        idx, made = open_to_write(d, self.fingerprint, self.signature, own and self._reset)
        if idx is None:
            self._foreign.add(d)
            return None
        if made:  # what the old index listed is swept as unknown files
            self.verifier.forget_dir(d)
            if own:
                self._reset, self._swept = False, False
                self._claim = self.max_disk_bytes is not None  # a new index records it again
        if own:
            self._index = idx
        return idx

    def _requeue(self, delta: Delta) -> None:
        for name in delta.files:
            self.verifier.written_file(delta.dir, name, False)
        delta.strip()
        with self._qmu:
            if self._queue is not None:
                delta.absorb(self._queue)
            if len(delta.rows) + len(delta.deletes) + len(delta.touches) > _QUEUE_LIMIT:
                self._need_full, delta = True, None  # too much owed: the next save writes all
            self._queue = delta

    def clear_disk(self) -> Dict[str, int]:
        """Delete this model's saved cache, durably before returning, in an order that
        needs no free space (a full disk is when a clear is most wanted, and SQLite cannot
        commit a transaction there): the index files first — from then on a crash or
        restart loads nothing, and the snapshot files left are unknown files the next
        save sweeps — then every snapshot file and temporary. A process sharing the
        directory sees its index gone at its next save and starts a new one.

        Returns ``{"files": n, "bytes": b}``: the files unlinked and the bytes they held.
        Raises ``OSError`` naming the directory when it cannot be written (e.g.
        read-only); what was unlinked by then stays unlinked."""
        d = self.directory()
        freed = {"files": 0, "bytes": 0}
        if d in self._foreign or not d.is_dir():
            return freed
        try:
            with self._io, DirLock(d):
                with self._qmu:
                    self._queue = None  # captures of what is being cleared
                try:
                    version = header_version(d / INDEX)
                except FormatError:
                    version = None  # damaged: cleared like any other
                if version is not None and version > FORMAT_VERSION:
                    self._foreign.add(d)  # a newer build's: never touched
                    return freed
                if self._index is not None:
                    # No checkpoint: it would write, and the file is going anyway.
                    self._index.close(checkpoint=False)
                    self._index = None
                    self._swept = False
                names = [INDEX + side for side in ("", "-wal", "-shm")] + collectable(d)
                for name in names:
                    try:
                        size = (d / name).lstat().st_size
                        (d / name).unlink()
                    except FileNotFoundError:
                        continue
                    freed["files"] += 1
                    freed["bytes"] += size
                    if name == INDEX:
                        fsync_dir(d)  # durable: nothing loads from here on
                self.verifier.forget_dir(d)
                fsync_dir(d)
                self._disk_bytes = 0
                self._claim = self.max_disk_bytes is not None  # the budget went with the index
        except (OSError, sqlite3.Error) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise OSError(getattr(e, "errno", None), f"cannot clear the prompt cache at {d}: {why}") from e
        return freed

    def save(self, root=None) -> int:
        """`capture` then `write`; the caller holds the trie's lock for the whole call."""
        return self.write(*self.capture(root))

    def close(self) -> None:
        """Checkpoint and close the index (reopened if used again)."""
        self.verifier.prefetcher.close()
        with self._io:
            if self._index is not None:
                self._index.close()
                self._index = None
