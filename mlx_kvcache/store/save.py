"""Writing a `Delta` into a directory: new files first, then one transaction, then unlinks.

1. make room: when the disk budget ``max_disk_bytes`` could not take the new files, the
   least recently used rows without child rows (and the files only they referenced) go
   first, in one transaction — so a full disk recovers instead of failing every save;
2. write each new file (temporary name, fsync, rename; then the directory is fsync'ed);
   a failed write (e.g. ENOSPC) leaves those layers out instead of failing the save;
3. one transaction: the new ``files`` rows, the changed rows (parents before children; a
   row whose parent has no row is left for later), moved stamps, deleted rows (with any
   row left below them), and the ``files`` rows nothing references any more;
4. after the commit, unlink those files; then evict again if the budget is exceeded.

The ids of the rows the budget evicted are reported (`Outcome.evicted`): the store
removes those nodes from the trie where they are on disk only (`tiers`).

A save killed at any point leaves an index whose every file is intact (a file is on disk
before a row can reference it, and leaves only after no committed row does); files written
but never committed are collected by the next process's first save. Snapshots are
immutable, so a file once written is referenced, never rewritten.
"""

from __future__ import annotations

import os
import sqlite3
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from .delta import Delta
from .format import collectable, encode_file, fsync_dir, write_atomic  # noqa: F401 (tests patch write_atomic)
from .index import Index
from .lazy import Verifier


class Outcome:
    """What a write did: problems met, nodes whose rows must be captured again."""

    def __init__(self) -> None:
        self.problems: List[str] = []
        self.resync: List["weakref.ref"] = []
        self.missing: Set[str] = set()
        self.unlinked = 0
        #: Ids of the rows the disk budget evicted.
        self.evicted: List[int] = []


def _unlink(d: Path, names, verifier: Verifier) -> int:
    n = 0
    for name in names:
        verifier.forget_file((d, name))
        try:
            os.unlink(d / name)
            n += 1
        except OSError:
            pass
    return n


def sweep(idx: Index, d: Path, verifier: Verifier) -> int:
    """Unlink snapshot files and temporaries no row knows of (a killed writer's); call
    with the directory lock held. Returns the number unlinked."""
    known = set(idx.files())
    return _unlink(d, [n for n in collectable(d) if n not in known], verifier)


def evict(idx: Index, d: Path, verifier: Verifier, target: int, protect: Set[int],
          gone: Optional[List[int]] = None) -> int:
    """Delete least recently used leaf rows until the directory fits ``target`` bytes;
    returns the bytes of files unlinked (the deleted rows' ids are added to ``gone``)."""
    gone = [] if gone is None else gone
    try:
        return _evict(idx, d, verifier, target, protect, gone)
    except sqlite3.OperationalError as e:
        if getattr(e, "sqlite_errorcode", None) != _SQLITE_FULL and "full" not in str(e):
            raise
    # The disk is so full that even the log of the transaction that frees space cannot
    # be written: unlink the victims' files first (a crash right now leaves rows whose
    # files are missing: damaged nodes, dropped at load), then commit their removal.
    _unlink(d, _victim_files(idx, target, protect), verifier)
    return _evict(idx, d, verifier, target, protect, gone)


_SQLITE_FULL = 13


def _victim_files(idx: Index, target: int, protect: Set[int]) -> List[str]:
    over = idx.files_bytes() + idx.db_bytes() - target
    files = idx.files()
    out: List[str] = []
    skip = set(protect)
    while over > 0:
        uid = idx.oldest_leaf(skip)
        if uid is None:
            break
        skip.add(uid)
        for (f,) in idx.db.execute("SELECT file FROM refs WHERE node = ? AND file NOT IN "
                                   "(SELECT file FROM refs WHERE node != ?)", (uid, uid)).fetchall():
            out.append(f)
            over -= files.get(f, (0, 0))[0]
    return out


def _evict(idx: Index, d: Path, verifier: Verifier, target: int, protect: Set[int],
           uids: List[int]) -> int:
    start_db = idx.db_bytes()
    if idx.files_bytes() + start_db <= target:
        return 0
    doomed: Set[str] = set()
    gone: Dict[str, int] = {}
    deleted: List[int] = []
    idx.begin()
    try:
        skip = set(protect)
        while idx.files_bytes() + start_db > target:
            uid = idx.oldest_leaf(skip)
            if uid is None:
                break
            skip.add(uid)
            deleted.extend(idx.delete(uid, doomed))
            gone.update(idx.release(doomed))
            doomed.clear()
        idx.commit()
    except BaseException:
        idx.rollback()
        raise
    uids.extend(deleted)
    _unlink(d, gone, verifier)
    return sum(gone.values())


def write(idx: Index, delta: Delta, verifier: Verifier, max_disk_bytes: Optional[int]) -> Outcome:
    """Apply ``delta`` to ``idx``'s directory (steps 1-4 of the module doc); the caller
    holds the directory lock. Raises ``OSError`` / ``sqlite3.Error`` when the index cannot
    be written (nothing is committed then)."""
    d = delta.dir
    out = Outcome()
    wanted = {ly["file"] for r in delta.rows.values() for ly in r.layers if ly is not None}
    new = {n: f for n, f in delta.files.items() if n in wanted}
    for n, f in delta.files.items():
        if n not in wanted:  # superseded before it was written
            verifier.written_file(d, n, False)
    protect = set(delta.rows) | set(delta.touches)
    if max_disk_bytes is not None:
        evict(idx, d, verifier, max_disk_bytes - sum(f.estimate for f in new.values()), protect,
              out.evicted)
    written: Dict[str, Tuple[int, int]] = {}
    for name, f in new.items():
        try:
            written[name] = write_atomic(d / name, [encode_file(f.tensors, f.header())])
        except OSError as e:
            out.problems.append(f"{type(e).__name__}: {e}")
            verifier.written_file(d, name, False)
    if written:
        fsync_dir(d)
    try:
        gone = _transaction(idx, delta, written, out)
        for name in out.missing:  # listed nowhere: whoever references it writes it again
            verifier.forget_file((d, name))
    except BaseException:
        _unlink(d, written, verifier)
        for name in written:
            verifier.written_file(d, name, False)
        raise
    for name, (size, crc) in written.items():
        verifier.set_file_info((d, name), size, crc)
        # Its snapshots (and the halves of any split meanwhile) live there now; a copy
        # written elsewhere, by a save to another directory, keeps its home where it is.
        verifier.written_file(d, name, True)
    out.unlinked += _unlink(d, gone, verifier)
    if max_disk_bytes is not None:
        fit(idx, d, verifier, max_disk_bytes, out.evicted)
    return out


def fit(idx: Index, d: Path, verifier: Verifier, budget: int,
        gone: Optional[List[int]] = None) -> None:
    """Bring the directory within ``budget``: fold the write-ahead log away, then evict
    (whose own transaction grows the log again: fold once more)."""
    for _ in range(3):
        if idx.files_bytes() + idx.db_bytes() <= budget:
            return
        idx.checkpoint()
        if idx.files_bytes() + idx.db_bytes() <= budget:
            return
        evict(idx, d, verifier, budget, set(), gone)


def _transaction(idx: Index, delta: Delta, written: Dict[str, Tuple[int, int]],
                 out: Outcome) -> Dict[str, int]:
    doomed: Set[str] = set(written)  # a written file no row ends up referencing goes again
    idx.begin()
    try:
        if delta.cleared or delta.full:
            idx.delete_all(doomed, keep=set(delta.rows) if delta.full and not delta.cleared else None)
        for name, (size, crc) in written.items():
            idx.add_file(name, size, crc)
        skipped: Set[int] = set()
        for row in sorted(delta.rows.values(), key=lambda r: (r.end, r.uid)):
            if row.parent in skipped or not idx.exists(row.parent):
                skipped.add(row.uid)  # its parent's row is gone: write it when it is back
                out.resync.append(row.node)
                continue
            layers = []
            for ly in row.layers:
                if ly is not None and ly["file"] not in written and not idx.has_file(ly["file"]):
                    out.missing.add(ly["file"])  # failed to write, or collected meanwhile
                    ly = None
                    out.resync.append(row.node)
                layers.append(ly)
            idx.upsert(row.uid, row.parent, row.tokens, row.end, row.last_used, row.keep,
                       layers, doomed)
        for uid, (stamp, keep, ref) in delta.touches.items():
            if not idx.touch(uid, stamp, keep):
                out.resync.append(ref)
        for uid in delta.deletes:
            idx.delete(uid, doomed)
        gone = idx.release(doomed)
        idx.commit()
    except BaseException:
        idx.rollback()
        raise
    return gone
