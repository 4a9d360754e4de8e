"""The index of one model's cache directory: a SQLite database in WAL mode.

Tables (``index.sqlite``; ``PRAGMA application_id`` = `APP_ID`, ``user_version`` = the
format version, both in the file header so a build can tell a newer format without
opening it through SQLite)::

    meta(key, value)      format, fingerprint, layer signature, bytes of all files,
                          the directory's disk budget (``budget``, shared by every
                          process writing it; absent: none recorded yet)
    nodes(uid, parent, tokens, end_, last_used, keep, nchildren, layers)
                          one row per trie node; ``uid`` is the node's persistent id
                          (0 is the root), ``tokens`` its edge as int64 LE bytes,
                          ``layers`` per layer null or {kind, meta, file, shapes,
                          slice?} (`encode_layers`: each distinct entry once);
                          ``nchildren`` counts child rows, so the least recently used
                          leaves are one index away
    files(name, size, crc32)  every snapshot file rows may reference
    refs(file, node)          which node references which file

A transaction changes only the rows of the nodes that changed. A file is written (and
fsync'ed) before the transaction that adds its ``files`` row commits, and unlinked only
after the transaction that removed its last reference commits, so no committed row ever
references a missing file. ``synchronous=FULL``: a commit is durable when it returns.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from .format import FORMAT_VERSION, MAGIC, FormatError, fsync_dir

INDEX = "index.sqlite"
APP_ID = 0x6D6B7663  # "mkvc"
PAGE = 1024
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE nodes (uid INTEGER PRIMARY KEY, parent INTEGER NOT NULL, tokens BLOB NOT NULL,
                    end_ INTEGER NOT NULL, last_used INTEGER NOT NULL, keep INTEGER NOT NULL,
                    nchildren INTEGER NOT NULL DEFAULT 0, layers TEXT NOT NULL);
CREATE INDEX nodes_parent ON nodes(parent);
CREATE INDEX nodes_leaves ON nodes(last_used) WHERE nchildren = 0;
CREATE TABLE files (name TEXT PRIMARY KEY, size INTEGER NOT NULL, crc32 INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE refs (file TEXT NOT NULL, node INTEGER NOT NULL, PRIMARY KEY (file, node))
    WITHOUT ROWID;
CREATE INDEX refs_node ON refs(node);
"""


def encode_layers(layers: List[Optional[dict]]) -> str:
    """A node's layer entries as JSON ``[[distinct entries], [index or null per layer]]``:
    the layers of a node usually share kind, offsets, file and shapes, so a 30-layer
    model's row holds one entry and 30 small numbers instead of 30 copies."""
    distinct: List[str] = []
    at: Dict[str, int] = {}
    refs: List[Optional[int]] = []
    for ly in layers:
        if ly is None:
            refs.append(None)
            continue
        key = json.dumps(ly, sort_keys=True, separators=(",", ":"))
        if key not in at:
            at[key] = len(distinct)
            distinct.append(key)
        refs.append(at[key])
    return f"[[{','.join(distinct)}],{json.dumps(refs, separators=(',', ':'))}]"


def decode_layers(text: str) -> List[Optional[dict]]:
    """Inverse of `encode_layers`; raises ``ValueError`` / ``KeyError`` when malformed."""
    distinct, refs = json.loads(text)
    return [None if r is None else dict(distinct[int(r)]) for r in refs]


def header_version(path: Path) -> Optional[int]:
    """The format version in an index file's header, read without SQLite (None: no file).
    Raises `FormatError` when it is not an index of this package."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError("the index is not a regular file")
    if st.st_size == 0:
        return None  # created, never written (a crash at the first start)
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or not head.startswith(_SQLITE_MAGIC):
        raise FormatError("the index is not an SQLite database (damaged)")
    if int.from_bytes(head[68:72], "big") != APP_ID:
        raise FormatError("not a prefix cache index")
    return int.from_bytes(head[60:64], "big")


class Index:
    """One open index database (used under the store's I/O lock; any thread)."""

    def __init__(self, db: sqlite3.Connection, path: Path, readonly: bool):
        self.db, self.path, self.readonly = db, path, readonly
        self._id = self._identity()

    def _identity(self):
        try:
            st = os.lstat(self.path)
            return (st.st_dev, st.st_ino)
        except OSError:
            return None

    def still_there(self) -> bool:
        """Whether the file this connection writes is still the directory's index (not
        deleted or replaced behind the process's back)."""
        return self._id is not None and self._identity() == self._id

    # -- opening ------------------------------------------------------------------------
    @classmethod
    def open(cls, d: Path, writable: bool = True) -> Optional["Index"]:
        """The index in ``d`` (None when there is none). A directory that cannot be
        written is opened immutable (reads only). Raises `FormatError` (damaged, another
        format, a newer version) or ``OSError``."""
        path = d / INDEX
        version = header_version(path)
        if version is None:
            return None
        if version != FORMAT_VERSION:
            raise FormatError(f"format version {version}, this build reads version {FORMAT_VERSION}")
        for side in ("-wal", "-shm"):  # SQLite opens these by name: never through a link
            p = d / (INDEX + side)
            if p.is_symlink() or (p.exists() and not p.is_file()):
                raise FormatError(f"{p.name} is not a regular file")
        try:
            if not writable:
                raise sqlite3.OperationalError("read only")
            db = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            readonly = False
        except sqlite3.Error:
            try:
                db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, timeout=30,
                                     isolation_level=None, check_same_thread=False)
                readonly = True
            except sqlite3.Error as e:
                raise FormatError(f"cannot open the index ({e})") from None
        idx = cls(db, path, readonly)
        try:
            idx._pragmas()
            idx.meta()
        except sqlite3.Error as e:
            db.close()
            raise FormatError(f"the index is damaged ({e})") from None
        return idx

    @classmethod
    def create(cls, d: Path, header: Dict[str, Any]) -> "Index":
        """A fresh, empty index in ``d``, replacing anything named like it. Built under a
        temporary name and renamed into place, so a crash leaves the old index or the new
        one, never half of one."""
        path = d / INDEX
        tmp = d / f"{INDEX}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        db = sqlite3.connect(str(tmp), timeout=30, isolation_level=None)
        try:
            # Small pages: a request changes a handful of rows in as many B-tree pages,
            # and each changed page is written whole to the log.
            db.execute(f"PRAGMA page_size = {PAGE}")
            db.execute(f"PRAGMA application_id = {APP_ID}")
            db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript("BEGIN;" + _SCHEMA + "COMMIT;")
            db.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("format", MAGIC), ("version", str(FORMAT_VERSION)), ("bytes", "0"),
                *((k, json.dumps(v)) for k, v in header.items())])
            db.execute("PRAGMA journal_mode=WAL")  # recorded in the header; no log yet
            db.close()
            for side in ("-wal", "-shm", "-journal"):
                try:
                    os.unlink(str(path) + side)
                except FileNotFoundError:
                    pass
            os.replace(tmp, path)
            fsync_dir(d)
        except BaseException:
            db.close()
            for side in ("", "-wal", "-shm", "-journal"):
                try:
                    os.unlink(str(tmp) + side)
                except FileNotFoundError:
                    pass
            raise
        db = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        idx = cls(db, path, False)
        idx._pragmas()
        return idx

    def _pragmas(self) -> None:
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=30000")

    def tune(self, wal_bytes: int) -> None:
        """Checkpoint the write-ahead log at about ``wal_bytes`` (a small disk budget
        must hold it too)."""
        pages = max(16, min(4000, wal_bytes // PAGE))
        self.db.execute(f"PRAGMA wal_autocheckpoint={pages}")
        self.db.execute(f"PRAGMA journal_size_limit={pages * PAGE}")

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database and truncate it to nothing."""
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass

    def close(self, checkpoint: bool = True) -> None:
        try:
            if checkpoint and not self.readonly:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self.db.close()

    # -- reading --------------------------------------------------------------------------
    def meta(self) -> Dict[str, str]:
        return dict(self.db.execute("SELECT key, value FROM meta").fetchall())

    def header(self) -> Dict[str, Any]:
        """The JSON-valued fields written by `create` (fingerprint, layers)."""
        out = {}
        for k, v in self.meta().items():
            if k not in ("format", "version", "bytes", "budget"):
                out[k] = json.loads(v)
        return out

    def files(self) -> Dict[str, Tuple[int, int]]:
        return {str(n): (int(s), int(c)) for n, s, c in
                self.db.execute("SELECT name, size, crc32 FROM files")}

    def rows(self) -> Iterable[tuple]:
        """``(uid, parent, tokens, end, last_used, keep, layers)``, parents first."""
        return self.db.execute("SELECT uid, parent, tokens, end_, last_used, keep, layers "
                               "FROM nodes ORDER BY end_, uid")

    def files_bytes(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'bytes'").fetchone()
        return int(row[0]) if row else 0

    def budget(self) -> Optional[int]:
        """The directory's disk budget, as last set by a process writing it (None: none)."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'budget'").fetchone()
        return int(row[0]) if row else None

    def set_budget(self, n: int) -> None:
        """Record ``n`` as the directory's disk budget (its own durable transaction)."""
        self.begin()
        try:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('budget', ?)", (str(int(n)),))
            self.commit()
        except BaseException:
            self.rollback()
            raise

    def db_bytes(self) -> int:
        """Bytes of the database and its write-ahead log and shared-memory files."""
        total = 0
        for side in ("", "-wal", "-shm"):
            try:
                total += os.lstat(str(self.path) + side).st_size
            except OSError:
                pass
        return total

    def has_file(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM files WHERE name = ?", (name,)).fetchone() is not None

    # -- writing (inside `transaction`) ----------------------------------------------------
    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _add_bytes(self, n: int) -> None:
        if n:
            self.db.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT) "
                            "WHERE key = 'bytes'", (n,))

    def add_file(self, name: str, size: int, crc: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?)", (name, size, crc))
        self._add_bytes(size)

    def _parent_of(self, uid: int) -> Optional[int]:
        row = self.db.execute("SELECT parent FROM nodes WHERE uid = ?", (uid,)).fetchone()
        return None if row is None else int(row[0])

    def exists(self, uid: int) -> bool:
        return uid == 0 or self._parent_of(uid) is not None

    def _count(self, parent: int, delta: int) -> None:
        if parent:
            self.db.execute("UPDATE nodes SET nchildren = nchildren + ? WHERE uid = ?", (delta, parent))

    def _unref(self, uid: int, doomed: Set[str]) -> None:
        for (f,) in self.db.execute("SELECT file FROM refs WHERE node = ?", (uid,)).fetchall():
            doomed.add(f)
        self.db.execute("DELETE FROM refs WHERE node = ?", (uid,))

    def upsert(self, uid: int, parent: int, tokens: bytes, end: int, last_used: int, keep: bool,
               layers: List[Optional[dict]], doomed: Set[str]) -> None:
        """Write a node's row (its parent's row must exist) and its file references."""
        old = self._parent_of(uid)
        if old is None:
            kids = self.db.execute("SELECT COUNT(*) FROM nodes WHERE parent = ?", (uid,)).fetchone()[0]
            self.db.execute("INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (uid, parent, tokens, end, last_used, int(keep), kids,
                             encode_layers(layers)))
            self._count(parent, 1)
        else:
            self.db.execute("UPDATE nodes SET parent = ?, tokens = ?, end_ = ?, last_used = ?, "
                            "keep = ?, layers = ? WHERE uid = ?",
                            (parent, tokens, end, last_used, int(keep), encode_layers(layers), uid))
            if old != parent:
                self._count(old, -1)
                self._count(parent, 1)
            self._unref(uid, doomed)
        files = {ly["file"] for ly in layers if ly is not None}
        self.db.executemany("INSERT OR IGNORE INTO refs VALUES (?, ?)", [(f, uid) for f in files])

    def touch(self, uid: int, last_used: int, keep: bool) -> bool:
        """Move a node's use stamp (and restore-point flag); False when it has no row."""
        cur = self.db.execute("UPDATE nodes SET last_used = ?, keep = ? WHERE uid = ?",
                              (last_used, int(keep), uid))
        return cur.rowcount > 0

    def delete(self, uid: int, doomed: Set[str]) -> List[int]:
        """Delete a node's row and every row below it; returns the uids deleted."""
        gone: List[int] = []
        stack = [uid]
        while stack:
            u = stack.pop()
            parent = self._parent_of(u)
            if parent is None:
                continue
            stack.extend(c for (c,) in self.db.execute("SELECT uid FROM nodes WHERE parent = ?", (u,)))
            self.db.execute("DELETE FROM nodes WHERE uid = ?", (u,))
            self._count(parent, -1)
            self._unref(u, doomed)
            gone.append(u)
        return gone

    def delete_all(self, doomed: Set[str], keep: Optional[Set[int]] = None) -> None:
        """Delete every row (but those in ``keep``, whose rows are about to be rewritten)."""
        if keep:
            self.db.execute("CREATE TEMP TABLE IF NOT EXISTS keep_uids (uid INTEGER PRIMARY KEY)")
            self.db.execute("DELETE FROM keep_uids")
            self.db.executemany("INSERT INTO keep_uids VALUES (?)", [(u,) for u in keep])
            doomed.update(f for (f,) in self.db.execute(
                "SELECT DISTINCT file FROM refs WHERE node NOT IN (SELECT uid FROM keep_uids)"))
            self.db.execute("DELETE FROM refs WHERE node NOT IN (SELECT uid FROM keep_uids)")
            self.db.execute("DELETE FROM nodes WHERE uid NOT IN (SELECT uid FROM keep_uids)")
            self.db.execute("UPDATE nodes SET nchildren = (SELECT COUNT(*) FROM nodes c "
                            "WHERE c.parent = nodes.uid)")
        else:
            doomed.update(f for (f,) in self.db.execute("SELECT name FROM files"))
            self.db.execute("DELETE FROM refs")
            self.db.execute("DELETE FROM nodes")

    def release(self, doomed: Set[str]) -> Dict[str, int]:
        """Drop the ``files`` rows of ``doomed`` files no row references any more;
        returns them with their sizes (unlink them after the commit)."""
        out: Dict[str, int] = {}
        for f in doomed:
            if self.db.execute("SELECT 1 FROM refs WHERE file = ? LIMIT 1", (f,)).fetchone():
                continue
            row = self.db.execute("SELECT size FROM files WHERE name = ?", (f,)).fetchone()
            if row is None:
                out[f] = 0  # written but never committed (an orphan): unlink it too
                continue
            self.db.execute("DELETE FROM files WHERE name = ?", (f,))
            self._add_bytes(-int(row[0]))
            out[f] = int(row[0])
        return out

    def oldest_leaf(self, skip: Set[int]) -> Optional[int]:
        """The least recently used row without child rows, not in ``skip``."""
        cur = self.db.execute("SELECT uid FROM nodes WHERE nchildren = 0 ORDER BY last_used, uid")
        for (uid,) in cur:
            if uid not in skip:
                return int(uid)
        return None

    def wipe(self) -> List[str]:
        """Delete every row (one durable transaction); returns the files to unlink."""
        doomed: Set[str] = set()
        self.begin()
        try:
            self.delete_all(doomed)
            gone = self.release(doomed)
            self.commit()
        except BaseException:
            self.rollback()
            raise
        return list(gone)


def recorded_budget(d: Path) -> Optional[int]:
    """The disk budget recorded in directory ``d``'s index (`Index.budget`), which a store
    opened with a default budget follows; None when there is no readable index or none is
    recorded. Reads only (no lock: SQLite's WAL lets a reader see the last commit)."""
    try:
        idx = Index.open(Path(d))
    except (FormatError, OSError, sqlite3.Error):
        return None
    if idx is None:
        return None
    try:
        return idx.budget()
    except sqlite3.Error:
        return None
    finally:
        idx.close(checkpoint=False)
