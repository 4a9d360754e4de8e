"""Lazy, verified loading: snapshots that wait for their file until a request needs them.

``load`` builds every snapshot around *placeholder* arrays (unevaluated ``mx.zeros`` of
the recorded shape and dtype: the right ``nbytes``, nothing allocated). The first time a
snapshot is needed its file is read, checked (size, CRC-32, the token prefix it was
written for, tensor shapes) and the data swapped into every snapshot waiting on that
file. Needed means: before a restore reads it (`PersistentStore.before_request`), when
the trie splits or merges it (`GuardedOps`), and before it is written elsewhere.

A bad file gives one ``RuntimeWarning`` and its snapshots are reported bad; the store
then drops their nodes with their subtrees. Thread-safe: one lock guards the maps, so
the background writer and request threads may ask at the same time.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..caches.snapshot import Snapshot
from .format import FormatError, decode_file, file_metadata, read_checked

FileKey = Tuple[Path, str]


def warn(msg: str) -> None:
    warnings.warn(f"mlx_kvcache: {msg}", RuntimeWarning, stacklevel=3)


class Origin:
    """Where a snapshot lives on disk, and whether its file was already checked."""

    __slots__ = ("dir", "file", "keys", "verified", "prefix")

    def __init__(self, d: Path, file: str, keys: Dict[str, str], verified: bool,
                 prefix: Optional[str] = None):
        self.dir, self.file, self.keys, self.verified, self.prefix = d, file, keys, verified, prefix

    @property
    def key(self) -> FileKey:
        return (self.dir, self.file)


class Verifier:
    """Which snapshot is backed by which file; reads and checks files on first use."""

    def __init__(self) -> None:
        self._mu = threading.RLock()
        self._origin: "weakref.WeakKeyDictionary[Snapshot, Origin]" = weakref.WeakKeyDictionary()
        self._bad: set = set()
        self._info: Dict[FileKey, Tuple[int, int]] = {}
        self._waiting: Dict[FileKey, List["weakref.ref[Snapshot]"]] = {}

    # -- bookkeeping ------------------------------------------------------------------
    def origin(self, snap: Snapshot) -> Optional[Origin]:
        with self._mu:
            return self._origin.get(snap)

    def file_info(self, key: FileKey) -> Optional[Tuple[int, int]]:
        with self._mu:
            return self._info.get(key)

    def set_file_info(self, key: FileKey, size: int, crc: int) -> None:
        with self._mu:
            self._info[key] = (size, crc)

    def forget_file(self, key: FileKey) -> None:
        with self._mu:
            self._info.pop(key, None)

    def register(self, snap: Snapshot, origin: Origin) -> None:
        """``snap`` holds placeholders to be filled from ``origin``'s file."""
        with self._mu:
            self._origin[snap] = origin
            if not origin.verified:
                self._waiting.setdefault(origin.key, []).append(weakref.ref(snap))

    def is_bad(self, snap: Snapshot) -> bool:
        with self._mu:
            o = self._origin.get(snap)
            return o is not None and not o.verified and o.key in self._bad

    # -- verification -----------------------------------------------------------------
    def ensure(self, snap: Optional[Snapshot]) -> bool:
        """Make sure ``snap`` holds real, checked data; False if its file is bad."""
        if snap is None or snap.closed:
            return True
        with self._mu:
            o = self._origin.get(snap)
            if o is None or o.verified:
                return True
            if o.key in self._bad:
                return False
            try:
                self._load_file(o)
            except Exception as e:  # any damage: the file is unusable, never a crash
                self._bad.add(o.key)
                warn(f"ignoring cached snapshot file {o.dir / o.file}: {e}; "
                     f"its prefix will be recomputed")
                return False
            return True

    def _load_file(self, o: Origin) -> None:
        size, crc = self._info.get(o.key, (-1, -1))
        data = read_checked(o.dir / o.file, size, crc)
        if o.prefix is not None:
            meta = file_metadata(o.dir / o.file)
            if meta.get("prefix_sha256") != o.prefix:
                raise FormatError("it holds state for other tokens than the index says")
        arrays = decode_file(data)
        swaps = []
        for ref in self._waiting.get(o.key, []):
            s = ref()
            so = None if s is None else self._origin.get(s)
            if s is None or so is None or so.verified or s.closed:
                continue
            new = {}
            for name, tkey in so.keys.items():
                a = arrays.get(tkey)
                old = s._arrays[name]  # noqa: SLF001 - the placeholder installed at load
                if a is None or a.shape != old.shape or a.dtype != old.dtype:
                    raise FormatError(f"tensor {tkey} is missing or has the wrong shape")
                new[name] = a
            swaps.append((s, so, new))
        for s, so, new in swaps:
            s._arrays = new  # noqa: SLF001 - same shapes, so nbytes is unchanged
            so.verified = True
        self._waiting.pop(o.key, None)


class GuardedOps:
    """One layer's split/merge, checking disk-backed snapshots before they are used."""

    def __init__(self, inner, verifier: Verifier):
        self.inner = inner
        self.verifier = verifier

    def split(self, snapshot, at):
        if not self.verifier.ensure(snapshot):
            snapshot.close()
            return None, None
        return self.inner.split(snapshot, at)

    def merge(self, parent, child):
        if not (self.verifier.ensure(parent) & self.verifier.ensure(child)):
            parent.close()
            child.close()
            return None
        return self.inner.merge(parent, child)
