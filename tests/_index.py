"""Reading and editing a cache directory's SQLite index from tests (as a user or an
attacker with a text editor would), through the standard library's ``sqlite3``."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

from mlx_kvcache.store.index import INDEX


def index_path(d) -> Path:
    return Path(d) / INDEX


def connect(d) -> sqlite3.Connection:
    return sqlite3.connect(str(index_path(d)), isolation_level=None)


def query(d, sql, *args):
    """Rows of ``sql``; none when there is no index yet (connecting would create one)."""
    if not index_path(d).exists():
        return []
    with closing(connect(d)) as db:
        return db.execute(sql, args).fetchall()


def edit(d, sql, *args) -> None:
    """Run ``sql`` and fold the write-ahead log into the database file (so copies of the
    file alone, and its header, show the edit)."""
    with closing(connect(d)) as db:
        db.execute(sql, args)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def referenced_files(d) -> set:
    return {r[0] for r in query(d, "SELECT name FROM files")}


def copy_index(src, dst) -> None:
    """``src``'s index as ``dst``'s (a consistent copy, whatever its log holds)."""
    for side in ("", "-wal", "-shm"):
        try:
            os.unlink(str(index_path(dst)) + side)
        except FileNotFoundError:
            pass
    with closing(connect(src)) as a, closing(sqlite3.connect(str(index_path(dst)))) as b:
        a.backup(b)
