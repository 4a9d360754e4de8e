"""The SHA-256 of a file, read once: later asks cost a ``stat`` and one SQLite lookup.

A model directory's identity (`fingerprint.directory_fingerprint`) hashes every byte of
every weight file. Reading 16 GB on every start would be slow, so each digest is
remembered in a small SQLite table (``<cache root>/v<N>/file-digests.sqlite``) under the
file's real path and its ``stat`` signature: size, ``mtime_ns``, ``ctime_ns``, inode and
device. Any write to the file moves its ``ctime`` (which no user call can set back, unlike
``mtime``), and a replaced file has another inode, so a changed file misses the table and
is hashed again. Not detected: a change made while the system clock is set back to the
old ``ctime``, or on a file system that does not keep ``ctime`` (some FUSE / network
mounts) — there, delete the table to force a full re-hash.

A file changed in the same clock tick as it was hashed could keep its signature, so a
digest is remembered only when the file was last changed more than `RACY_NS` before the
hashing started (as git does for its index); a file still being written is re-hashed on
the next start. A file in a Hugging Face cache snapshot (a symlink into
``../../blobs/<name>``) whose blob name is 64 hex digits is named by its SHA-256 already:
that name is used without reading (40-hex names are git object ids, not SHA-256, and are
hashed). The table is a cache: unreadable, damaged or read-only, it is ignored.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import stat as _stat
import time
from pathlib import Path
from typing import Optional, Tuple

__all__ = ["FileDigests", "file_sha256", "hf_blob_sha256"]

#: A file changed less than this long before hashing started is not remembered.
RACY_NS = 2_000_000_000
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 8 << 20


def file_sha256(path) -> str:
    """Hex SHA-256 of a file's contents (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def hf_blob_sha256(path) -> Optional[str]:
    """The SHA-256 a Hugging Face cache names ``path`` by, or None.

    ``path`` must be a symlink whose target lies in a directory called ``blobs`` and is
    named by 64 lowercase hex digits (the hub's LFS files: their SHA-256)."""
    p = Path(path)
    try:
        if not p.is_symlink():
            return None
        target = p.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if target.parent.name != "blobs" or not _HEX64.fullmatch(target.name):
        return None
    return target.name


def _signature(st: os.stat_result) -> Tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class FileDigests:
    """Remembered file digests in a SQLite table at ``path`` (None: remember nothing)."""

    def __init__(self, path=None) -> None:
        self.path = None if path is None else Path(path)
        self._db: Optional[sqlite3.Connection] = None
        self.hashed_bytes = 0  # bytes read by this object (start-up cost, for reports)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self.path.exists() and not _stat.S_ISREG(os.lstat(self.path).st_mode):
                    raise OSError(f"{self.path} is not a regular file")
                db = sqlite3.connect(str(self.path), timeout=10, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, "
                           "size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, "
                           "dev INTEGER, sha256 TEXT NOT NULL)")
                self._db = db
            except (OSError, sqlite3.Error):
                self._db = None  # a cache only: hash without remembering

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> "FileDigests":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sha256(self, path) -> str:
        """Hex SHA-256 of ``path``'s contents: from a Hugging Face blob name, from the
        table when the file's signature is unchanged, else read (and remembered)."""
        named = hf_blob_sha256(path)
        if named is not None:
            return named
        real = os.path.realpath(path)
        st = os.stat(real)
        sig = _signature(st)
        known = self._lookup(real)
        if known is not None and known[0] == sig:
            return known[1]
        started = time.time_ns()
        digest = file_sha256(real)
        self.hashed_bytes += st.st_size
        after = os.stat(real)
        settled = (_signature(after) == sig
                   and max(after.st_mtime_ns, after.st_ctime_ns) < started - RACY_NS)
        if settled:
            self._remember(real, sig, digest)
        return digest

    def _lookup(self, real: str):
        if self._db is None:
            return None
        try:
            row = self._db.execute("SELECT size, mtime_ns, ctime_ns, inode, dev, sha256 "
                                   "FROM digests WHERE path = ?", (real,)).fetchone()
        except sqlite3.Error:
            return None
        if row is None or not isinstance(row[5], str):
            return None
        return tuple(row[:5]), row[5]

    def _remember(self, real: str, sig, digest: str) -> None:
        if self._db is None:
            return
        try:
            self._db.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (real, *sig, digest))
        except sqlite3.Error:
            pass
