"""Lazy, verified loading: snapshots that wait for their file until a request needs them.

A snapshot whose data is on disk only is *parked* (`Snapshot.park`: kind, offsets,
shapes and dtypes kept, no memory held): every snapshot ``load`` builds, and every one
the memory budget demotes (`park`: its file already holds it). The first time a parked
snapshot is needed its file is read and checked — a plain name, a regular file of the
recorded size (`format.read_regular`), its CRC-32, the token prefix it was written for,
and the kind, integer metadata, shapes and dtypes of every layer it holds — and the data
filled into the snapshots asked for (`ensure_all`; others waiting on the same file stay
parked, so the memory held is what was asked for). Needed means: before a restore reads
it (`PersistentStore.before_request`), when the trie splits or merges it (`GuardedOps`),
and before it is written elsewhere. Reads may be started early (`prefetch`).

A KV layer written compressed (``cold`` in the file's layer: `delta.Capturer` with
``cold_bits``) is stored as a `QuantizedSnapshot` and filled back as the `KVSnapshot` it
was, dequantized (lossy: off unless asked for; such a cache lives in its own directory).

A snapshot may be a *slice* of what its file holds: a KV edge split after it was written
keeps referencing the file (the halves are cut from the file's snapshot with the cache's
own ``split`` when loaded), so a split never rewrites bytes. The file's prefix digest
still binds it: the node's prefix extended by the file's remaining edge tokens must hash
to it.

A bad file gives one ``RuntimeWarning`` and its snapshots are reported bad; the store
then drops their nodes with their subtrees. A file the store itself deleted (its node
left the disk budget) is dropped silently. Thread-safe: one lock guards the maps, so the
background writer and request threads may ask at the same time.
"""

from __future__ import annotations

import json
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..caches.snapshot import Snapshot
from .format import FormatError, decode_file, file_header, read_regular
from .prefetch import Prefetcher

FileKey = Tuple[Path, str]


def warn(msg: str) -> None:
    warnings.warn(f"mlx_kvcache: {msg}", RuntimeWarning, stacklevel=3)


class Origin:
    """Where a snapshot lives on disk: layer ``layer`` of file ``file`` in ``dir`` (or the
    ``slice`` [lo, hi) of its edge), and whether it was already checked against it.
    ``prefix`` is a SHA-256 state of the tokens up to the snapshot's node end (needed
    only until verified)."""

    __slots__ = ("dir", "file", "layer", "verified", "prefix", "slice")

    def __init__(self, d: Path, file: str, layer: int, verified: bool, prefix=None,
                 slice_: Optional[Tuple[int, int]] = None):
        self.dir, self.file, self.layer, self.verified = d, file, layer, verified
        self.prefix, self.slice = prefix, slice_

    @property
    def key(self) -> FileKey:
        return (self.dir, self.file)


class Verifier:
    """Which snapshot is backed by which file; reads and checks files on first use.

    ``ops[i]`` splits layer ``i``'s snapshots (cutting slices out of a file's snapshot).
    """

    def __init__(self, ops: Sequence[Any]) -> None:
        self.ops = list(ops)
        self._mu = threading.RLock()
        self._origin: "weakref.WeakKeyDictionary[Snapshot, Origin]" = weakref.WeakKeyDictionary()
        # snapshot -> (dir, file, layer, slice) of a file being written
        self._pending: "weakref.WeakKeyDictionary[Snapshot, tuple]" = weakref.WeakKeyDictionary()
        self._bad: set = set()
        self._gone: set = set()
        self._info: Dict[FileKey, Tuple[int, int]] = {}
        self._waiting: Dict[FileKey, List["weakref.ref[Snapshot]"]] = {}
        self._found_bad: List["weakref.ref[Snapshot]"] = []
        self.prefetcher = Prefetcher()
        #: Bytes of snapshot files read (and checked) so far.
        self.read_bytes = 0

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
            self._gone.discard(key)

    def forget_file(self, key: FileKey) -> None:
        """The file is no longer on disk: snapshots still waiting for it are dropped
        silently when needed; loaded ones get written again when their node changes."""
        with self._mu:
            self._info.pop(key, None)
            if key in self._waiting:
                self._gone.add(key)
        self.prefetcher.forget(key)

    def forget_dir(self, d: Path) -> None:
        """No file of ``d`` is on disk any more (its index was replaced)."""
        with self._mu:
            for key in [k for k in self._info if k[0] == d]:
                self.forget_file(key)

    def register(self, snap: Snapshot, origin: Origin) -> None:
        """``snap`` is held by ``origin``'s file (if not verified: holds placeholders to be
        filled from it)."""
        with self._mu:
            self._origin[snap] = origin
            self._pending.pop(snap, None)
            if not origin.verified:
                self._waiting.setdefault(origin.key, []).append(weakref.ref(snap))

    def park(self, snap: Snapshot, prefix) -> None:
        """Park ``snap``, whose file in its origin's directory holds it (`written`): it
        waits for that file again, to be checked against ``prefix`` (a SHA-256 state of
        the tokens up to its node's end) when filled."""
        with self._mu:
            o = self._origin[snap]
            self.register(snap, Origin(o.dir, o.file, o.layer, False, prefix, o.slice))
            snap.park()

    def written(self, snap: Snapshot, d: Path) -> bool:
        """Whether a file of ``d`` that was written and committed holds ``snap`` (not one
        still being written, nor one found bad or deleted)."""
        with self._mu:
            o = self._origin.get(snap)
            return (o is not None and o.dir == d and o.key in self._info
                    and o.key not in self._bad and o.key not in self._gone)

    def prefetch(self, snaps) -> int:
        """Start reading the files the parked ``snaps`` wait for; returns how many."""
        n = 0
        with self._mu:
            for s in snaps:
                o = None if s is None or not s.parked else self._origin.get(s)
                if o is None or o.verified or o.key in self._bad or o.key in self._gone:
                    continue
                info = self._info.get(o.key)
                if info is not None:
                    self.prefetcher.start(o.key, *info)
                    n += 1
        return n

    def set_pending(self, snap: Snapshot, d: Path, file: str, layer: int,
                    slice_: Optional[Tuple[int, int]] = None) -> None:
        """``snap`` is being written to ``file`` (referenced by rows captured meanwhile);
        ``slice_``: it is that part of the file's edge (a split while it was written)."""
        with self._mu:
            self._pending[snap] = (d, file, layer, slice_)

    def pending_of(self, snap: Snapshot) -> Optional[tuple]:
        with self._mu:
            return self._pending.get(snap)

    def forget_pending(self, snap: Snapshot) -> None:
        with self._mu:
            self._pending.pop(snap, None)

    def written_file(self, d: Path, file: str, ok: bool) -> None:
        """The write of ``file`` in ``d`` ended: committed (``ok``: every snapshot being
        written to it now has it as its home, unless it has one elsewhere already) or
        failed / superseded (they must be written again)."""
        with self._mu:
            for snap, (pd, pf, layer, sl) in list(self._pending.items()):
                if pd != d or pf != file:
                    continue
                del self._pending[snap]
                if not ok or snap.closed:
                    continue
                o = self._origin.get(snap)
                if o is None or self.location(snap, o.dir) is None:
                    self.register(snap, Origin(d, file, layer, True, None, sl))

    def location(self, snap: Snapshot, d: Path) -> Optional[Tuple[str, Optional[Tuple[int, int]]]]:
        """``(file, slice)`` holding ``snap`` in ``d``, written or being written; None
        when it must be written."""
        with self._mu:
            o = self._origin.get(snap)
            if o is not None and o.dir == d and o.key in self._info and o.key not in self._bad:
                return o.file, o.slice
            p = self._pending.get(snap)
            if p is not None and p[0] == d:
                return p[1], p[3]
            return None

    def is_bad(self, snap: Snapshot) -> bool:
        with self._mu:
            o = self._origin.get(snap)
            return o is not None and not o.verified and (o.key in self._bad or o.key in self._gone)

    def found_bad(self) -> List[Snapshot]:
        """Snapshots whose file turned out bad since the last call (their nodes must go)."""
        with self._mu:
            out = [s for s in (r() for r in self._found_bad) if s is not None]
            self._found_bad = []
            return out

    # -- verification -----------------------------------------------------------------
    def ensure(self, snap: Optional[Snapshot]) -> bool:
        """Make sure ``snap`` holds real, checked data; False if its file is bad."""
        return self.ensure_all([snap])[0]

    def ensure_all(self, snaps: Sequence[Optional[Snapshot]]) -> List[bool]:
        """`ensure` for each of ``snaps``, reading each file once; only these are filled."""
        out = [True] * len(snaps)
        with self._mu:
            groups: Dict[FileKey, List[int]] = {}
            for i, snap in enumerate(snaps):
                if snap is None or snap.closed:
                    continue
                o = self._origin.get(snap)
                if o is None or o.verified:
                    continue
                if o.key in self._bad or o.key in self._gone:
                    out[i] = False
                    continue
                groups.setdefault(o.key, []).append(i)
            for key, idx in groups.items():
                try:
                    self._load_file(key, {id(snaps[i]) for i in idx})
                except Exception as e:  # any damage: the file is unusable, never a crash
                    self._bad.add(key)
                    self._found_bad.extend(self._waiting.pop(key, []))
                    d, name = key
                    warn(f"ignoring cached snapshot file {d / name}: {e}; "
                         f"its prefix will be recomputed")
                    for i in idx:
                        out[i] = False
        return out

    def _load_file(self, key: FileKey, want: set) -> None:
        info = self._info.get(key)
        if info is None:
            raise FormatError("it is not in the index")
        fut = self.prefetcher.take(key)
        data = None
        if fut is not None and not fut.cancelled():
            try:
                data = fut.result()
            except FormatError:
                raise
            except Exception:  # noqa: BLE001 - a failed early read is retried here
                data = None
        if data is None:
            data = read_regular(key[0], key[1], *info)
        self.read_bytes += len(data)
        meta = file_header(data)
        try:
            start, end = int(meta["start"]), int(meta["end"])
            edge = bytes.fromhex(meta["tokens"])
            described = json.loads(meta["layers"])
            digest = meta["prefix_sha256"]
        except Exception as e:
            raise FormatError(f"its metadata is incomplete ({type(e).__name__}: {e})") from None
        if len(edge) != 8 * (end - start):
            raise FormatError("its edge tokens do not match its offsets")
        arrays = decode_file(data)
        swaps = []
        waiting = self._waiting.get(key, [])
        for ref in waiting:
            s = ref()
            so = None if s is None else self._origin.get(s)
            if s is None or so is None or so.verified or s.closed or id(s) not in want:
                continue
            hi = end if so.slice is None else so.slice[1]
            if not start <= hi <= end:
                raise FormatError(f"slice end {hi} outside the file's edge [{start}, {end})")
            h = so.prefix.copy()
            h.update(edge[8 * (hi - start):])
            if h.hexdigest() != digest:
                raise FormatError("it holds state for other tokens than the index says")
            swaps.append((s, so, self._layer(so, described, arrays, s)))
        for s, so, new in swaps:
            if s.parked:  # (placeholders are; a resident one already holds these arrays)
                s.fill(new)
            so.verified = True
            so.prefix = None
        left = []
        for ref in waiting:
            s = ref()
            so = None if s is None else self._origin.get(s)
            if s is not None and so is not None and not so.verified and s.parked:
                left.append(ref)
        if left:
            self._waiting[key] = left
        else:
            self._waiting.pop(key, None)

    def _layer(self, so: Origin, described: Dict[str, Any], arrays, s: Snapshot):
        ent = described.get(str(so.layer))
        cold = isinstance(ent, dict) and bool(ent.get("cold")) and ent.get("kind") == "quantized" \
            and s.kind == "kv"
        if not isinstance(ent, dict) or (ent.get("kind") != s.kind and not cold):
            raise FormatError(f"layer {so.layer} is missing or of another kind")
        try:
            full = Snapshot.from_arrays(ent["kind"], {
                name: arrays[key] for name, (key, _, _) in ent["arrays"].items()},
                {k: int(v) for k, v in ent["meta"].items()})
            if cold:
                full = _dequantized(full)
        except Exception as e:
            raise FormatError(f"layer {so.layer} cannot be rebuilt ({type(e).__name__}: {e})") from None
        if so.slice is not None:
            lo, hi = so.slice
            ops = self.ops[so.layer]
            if hi < full.to_offset:
                full, rest = ops.split(full, hi)
                if rest is not None:
                    rest.close()
            if full is not None and lo > full.from_offset:
                head, full = ops.split(full, lo)
                if head is not None:
                    head.close()
            if full is None:
                raise FormatError(f"layer {so.layer}: slice [{lo}, {hi}) cannot be cut")
        new, _ = full.to_arrays()
        if full.meta() != s.meta() or full.shapes() != s.shapes():
            raise FormatError(f"layer {so.layer} does not match the index (offsets, shapes "
                              f"or dtypes)")
        return new


class GuardedOps:
    """One layer's split/merge, checking disk-backed snapshots before they are used; the
    halves of a split keep referencing the file of what was split."""

    def __init__(self, inner, verifier: Verifier, layer: int):
        self.inner = inner
        self.verifier = verifier
        self.layer = layer

    def split(self, snapshot, at):
        v = self.verifier
        if not v.ensure(snapshot):
            snapshot.close()
            return None, None
        o = v.origin(snapshot)
        pend = v.pending_of(snapshot)
        span = (snapshot.from_offset, snapshot.to_offset)
        head, tail = self.inner.split(snapshot, at)
        if head is None or head is snapshot:
            return head, tail
        if o is not None and o.verified:
            lo, hi = o.slice or span
            v.register(head, Origin(o.dir, o.file, o.layer, True, None, (lo, at)))
            if tail is not None and tail is not snapshot:
                v.register(tail, Origin(o.dir, o.file, o.layer, True, None, (at, hi)))
        if pend is not None:  # being written: the halves are slices of that file too
            d, f, layer, sl = pend
            lo, hi = sl or span
            v.set_pending(head, d, f, layer, (lo, at))
            if tail is not None and tail is not snapshot:
                v.set_pending(tail, d, f, layer, (at, hi))
        return head, tail

    def merge(self, parent, child):
        if not (self.verifier.ensure(parent) & self.verifier.ensure(child)):
            parent.close()
            child.close()
            return None
        return self.inner.merge(parent, child)


def _dequantized(q: Snapshot) -> Snapshot:
    """A cold (compressed) KV layer as the `KVSnapshot` it was written from."""
    g, b = q.group_size, q.bits  # type: ignore[attr-defined]
    k = mx.dequantize(*q.keys, group_size=g, bits=b)  # type: ignore[attr-defined]
    v = mx.dequantize(*q.values, group_size=g, bits=b)  # type: ignore[attr-defined]
    mx.eval(k, v)
    return Snapshot.from_arrays("kv", {"keys": k, "values": v}, {
        "from_offset": q.from_offset, "to_offset": q.to_offset})
