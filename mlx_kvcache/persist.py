"""Layer 5: the prefix trie to and from disk, keyed by model identity.

On-disk layout, one directory per model under a cache root::

    <root>/<fingerprint[:16]>/index.json        the trie (written last, atomically)
    <root>/<fingerprint[:16]>/n<hex>.safetensors one file per node save (write-once)
    <root>/<fingerprint[:16]>/.lock             flock'ed while saving / collecting

``index.json`` holds the format version, the full model fingerprint, the layer
signature (cache kind per layer, window sizes), the trie clock and one entry per node:
id, parent id (0 = root), edge tokens, end offset, last_used, keep flag, and per layer
``null`` or ``{"kind", "meta", "file", "arrays": {name: [tensor key, shape, dtype]}}``.
``files`` maps each referenced file to its size and CRC-32. Snapshot files are plain
safetensors (``L<layer>.<name>`` tensors), readable by any safetensors reader.

Saving is incremental and crash-safe: a snapshot already on disk is referenced, never
rewritten (snapshots are immutable); new snapshots of a node go to a fresh file written
to a temporary name, fsync'ed and renamed; the index is replaced last, the same way, and
only then are files no index references deleted. A save killed at any point leaves the
previous index and every file it references intact.

Loading is fail-open and lazy. ``load`` reads only the index and ``stat``s the files:
each snapshot is rebuilt around *placeholder* arrays (unevaluated ``mx.zeros`` of the
recorded shape and dtype: they report the right ``nbytes`` but allocate nothing). A
node's file is read, checked against its size and CRC-32 and swapped in the first time
the node is needed:

* before a request's restore, for the nodes on the prompt's trie path
  (`PersistentStore.before_request`, called by `PrefixCache`);
* whenever the trie splits or merges a disk-backed snapshot (the trie's per-layer ops
  are wrapped by `_GuardedOps`), which covers recording and eviction;
* before writing it elsewhere (``save`` to another directory).

A bad file (missing, truncated, flipped bytes, not a safetensors file, wrong shapes)
gives one ``RuntimeWarning`` starting ``"mlx_kvcache: "`` and its node is dropped with
its subtree (inside a split/merge, the layer just ends with no snapshot, which the
restore rules handle, and the node is dropped after the request). A bad index (missing
fields, unknown format version, another model's fingerprint, other cache layers) is
ignored as a whole with one warning. A missing index is the normal first start: no
warning. Nothing here raises into a request.

Placeholders count their full size against the memory budget (as if resident), so the
budget holds whatever gets verified later. One writer per directory: a save collects
the files its own index does not reference (under ``.lock``), so two processes saving to
one directory lose each other's nodes (the loser sees a "missing" warning, never wrong
output). Model identity: `model_fingerprint` (one pass over the weights, ~0.5 s for a
135M model on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
import weakref
import zlib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import hashlib

import mlx.core as mx
import numpy as np

from .kv import KVCache
from .recurrent import RecurrentCache
from .rotating import RotatingKVCache
from .snapshot import CacheError, Snapshot
from .trie import TrieNode

try:  # POSIX advisory lock so two processes never collect each other's files mid-save
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["FORMAT_VERSION", "model_fingerprint", "PersistentStore", "disk_usage"]

FORMAT_VERSION = 1
INDEX = "index.json"
_MAGIC = "mlx_kvcache.prefix_trie"

# mlx dtype -> (safetensors name, unsigned raw dtype of the same width)
_DTYPES = {
    mx.float32: ("F32", mx.uint32), mx.float16: ("F16", mx.uint16),
    mx.bfloat16: ("BF16", mx.uint16), mx.int8: ("I8", mx.uint8),
    mx.int16: ("I16", mx.uint16), mx.int32: ("I32", mx.uint32),
    mx.int64: ("I64", mx.uint64), mx.uint8: ("U8", mx.uint8),
    mx.uint16: ("U16", mx.uint16), mx.uint32: ("U32", mx.uint32),
    mx.uint64: ("U64", mx.uint64), mx.bool_: ("BOOL", mx.uint8),
}
_NP_RAW = {mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64}
_BY_NAME = {v[0]: k for k, v in _DTYPES.items()}
_DTYPE_STR = {k: str(k).split(".")[-1] for k in _DTYPES}
_STR_DTYPE = {v: k for k, v in _DTYPE_STR.items()}


def _warn(msg: str) -> None:
    warnings.warn(f"mlx_kvcache: {msg}", RuntimeWarning, stacklevel=3)


# -- model identity -----------------------------------------------------------------------

def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v, sort_keys=True)
        return v
    except (TypeError, ValueError):
        return None


def _config(model) -> Dict[str, Any]:
    args = getattr(model, "args", None)
    if args is None:
        args = getattr(model, "config", None)
    if args is None:
        return {}
    if is_dataclass(args):
        items = {f.name: getattr(args, f.name, None) for f in fields(args)}
    elif isinstance(args, dict):
        items = dict(args)
    else:
        items = dict(getattr(args, "__dict__", {}))
    out = {}
    for k in sorted(items):
        if str(k).startswith("_"):
            continue
        v = _jsonable(items[k])
        if v is not None or items[k] is None:
            out[str(k)] = v
    return out


_CHUNK = 1 << 22  # elements per chunk of the content checksum (bounds temporaries)


def _content_digest(a: mx.array) -> bytes:
    """Order-sensitive checksum of every element's bits, plus a strided sample.

    Integer arithmetic modulo 2**32 is exact and associative, so the result does not
    depend on the device or the reduction order. Each element's bit pattern is weighted
    by an odd position-dependent factor: changing any single element always changes the
    sum, and a realistic fine-tune (many elements) cannot cancel out except by chance.
    """
    flat = a.reshape(-1)
    dt = flat.dtype
    if dt == mx.bool_:
        bits = flat.astype(mx.uint32)
    elif dt in _DTYPES:
        raw = _DTYPES[dt][1]
        bits = mx.view(flat, raw)
        if raw == mx.uint64:
            bits = mx.view(bits, mx.uint32)
        elif raw != mx.uint32:
            bits = bits.astype(mx.uint32)
    else:  # complex64 and anything 32-bit multiple
        bits = mx.view(flat.astype(mx.float32) if dt.size < 4 else flat, mx.uint32)
    n = bits.size
    sums = []
    for s in range(0, n, _CHUNK):
        part = bits[s:s + _CHUNK]
        idx = mx.arange(s, s + part.size, dtype=mx.uint32)
        w = idx * mx.array(2654435761, dtype=mx.uint32) + mx.array(0x9E3779B9, dtype=mx.uint32)
        w = w | mx.array(1, dtype=mx.uint32)
        sums.append(mx.sum(part * w))
        sums.append(mx.sum(part ^ idx))
    step = max(1, n // 2048)
    sample = bits[::step][:2048]
    mx.eval(sums, sample)
    return np.asarray([int(x.item()) for x in sums], dtype=np.uint64).tobytes() + \
        np.asarray(sample).tobytes()


def _tokenizer_identity(tok) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    inner = getattr(tok, "_tokenizer", tok)

    def get(name):
        for o in (tok, inner):
            try:
                v = getattr(o, name)
            except Exception:
                continue
            if v is not None:
                return v
        return None

    try:
        vocab = inner.get_vocab()
        h = hashlib.sha256()
        for k, v in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
            h.update(f"{v}\t{k}\n".encode("utf-8", "surrogatepass"))
        out["vocab"] = h.hexdigest()
        out["vocab_size"] = len(vocab)
    except Exception:
        pass
    for name in ("vocab_size", "bos_token", "eos_token", "pad_token", "unk_token",
                 "all_special_tokens", "chat_template"):
        v = get(name)
        if v is not None:
            out.setdefault(name, _jsonable(v) if not isinstance(v, (set, tuple)) else sorted(v))
    try:
        out["eos_token_ids"] = sorted(int(t) for t in tok.eos_token_ids)
    except Exception:
        pass
    return out


def model_fingerprint(model, tokenizer=None) -> str:
    """A hex SHA-256 naming the model (config, parameters and their contents) and tokenizer.

    Two models share a fingerprint only if they have the same class, config, parameter
    names, shapes, dtypes and (up to a 64-bit-per-tensor checksum of every element plus
    a sample of raw values) the same weights; the tokenizer's vocabulary, special tokens
    and chat template are included when it is given. Costs one pass over the weights.
    """
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    h.update(f"mlx_kvcache-fingerprint-v1\n{type(model).__module__}.{type(model).__qualname__}\n".encode())
    h.update(json.dumps(_config(model), sort_keys=True, default=str).encode())
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for name, a in params:
        h.update(f"\n{name}:{tuple(a.shape)}:{a.dtype}\n".encode())
        h.update(_content_digest(a))
    if tokenizer is not None:
        h.update(b"\ntokenizer\n")
        h.update(json.dumps(_tokenizer_identity(tokenizer), sort_keys=True, default=str).encode())
    return h.hexdigest()


# -- safetensors files ----------------------------------------------------------------------

def _raw_bytes(a: mx.array) -> memoryview:
    raw = _DTYPES[a.dtype][1]
    v = a.astype(mx.uint8) if a.dtype == mx.bool_ else mx.view(a, raw)
    return memoryview(np.ascontiguousarray(np.asarray(v)).reshape(-1)).cast("B")


def _header(tensors: Dict[str, mx.array]) -> bytes:
    """The safetensors header (length prefix included); needs shapes only, no data."""
    header: Dict[str, Any] = {"__metadata__": {"format": _MAGIC}}
    pos = 0
    for key in sorted(tensors):
        a = tensors[key]
        if a.dtype not in _DTYPES:
            raise CacheError(f"cannot persist dtype {a.dtype}")
        header[key] = {"dtype": _DTYPES[a.dtype][0], "shape": list(a.shape),
                       "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    return len(hj).to_bytes(8, "little") + hj


def _encode_file(tensors: Dict[str, mx.array]) -> Tuple[bytes, List[memoryview]]:
    return _header(tensors), [_raw_bytes(tensors[k]) for k in sorted(tensors)]


def _file_tensors(new: Dict[int, Snapshot]) -> Dict[str, mx.array]:
    out = {}
    for i, snap in new.items():
        for name, a in snap.to_arrays()[0].items():
            out[f"L{i}.{name}"] = a
    return out


def _layer_entry(s: Snapshot, file: str, keys: Dict[str, str]) -> dict:
    arrays = s._arrays or {}  # noqa: SLF001 - shapes only (no data read)
    return {
        "kind": s.kind,
        "meta": s.meta(),
        "file": file,
        "arrays": {name: [keys[name], list(a.shape), _DTYPE_STR[a.dtype]]
                   for name, a in arrays.items()},
    }


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(str(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, parts: Iterable) -> Tuple[int, int]:
    """Write ``parts`` to ``path`` via a fsync'ed temporary; returns (size, crc32)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    crc, size = 0, 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
                crc = zlib.crc32(p, crc)
                size += len(p) if isinstance(p, bytes) else p.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size, crc


def _read_file(path: Path, size: int, crc: int) -> Dict[str, mx.array]:
    """Read and check a snapshot file; raises ``ValueError`` naming what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError("file is missing") from None
    except OSError as e:
        raise ValueError(f"unreadable ({e})") from None
    if len(data) != size:
        raise ValueError(f"size {len(data)} B, expected {size} B (truncated or replaced)")
    if zlib.crc32(data) != crc:
        raise ValueError("checksum mismatch (corrupted)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n])
    except Exception:
        raise ValueError("bad safetensors header") from None
    base = 8 + n
    out = {}
    buf = memoryview(data)
    for key, d in header.items():
        if key == "__metadata__":
            continue
        dt = _BY_NAME.get(d.get("dtype"))
        if dt is None:
            raise ValueError(f"tensor {key}: unsupported dtype {d.get('dtype')}")
        b, e = d["data_offsets"]
        raw = _DTYPES[dt][1]
        arr = np.frombuffer(buf[base + b: base + e], dtype=_NP_RAW[raw])
        x = mx.array(arr)
        x = x.astype(mx.bool_) if dt == mx.bool_ else mx.view(x, dt)
        out[key] = x.reshape(d["shape"])
    mx.eval(list(out.values()))
    return out


def disk_usage(directory) -> int:
    """Bytes of every file under ``directory`` (non-recursive)."""
    total = 0
    try:
        for e in os.scandir(directory):
            if e.is_file():
                total += e.stat().st_size
    except OSError:
        pass
    return total


class _Lock:
    def __init__(self, d: Path):
        self.path = d / ".lock"
        self.fd = None

    def __enter__(self):
        if fcntl is not None:
            self.fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# -- the store --------------------------------------------------------------------------------

class _Origin:
    """Where a snapshot lives on disk, and whether its file was already checked."""

    __slots__ = ("dir", "file", "keys", "verified")

    def __init__(self, d: Path, file: str, keys: Dict[str, str], verified: bool):
        self.dir, self.file, self.keys, self.verified = d, file, keys, verified


class _GuardedOps:
    """Wraps one layer's split/merge so disk-backed snapshots are checked before use."""

    def __init__(self, inner, store: "PersistentStore"):
        self.inner = inner
        self.store = store

    def split(self, snapshot, at):
        if not self.store._ensure(snapshot):
            snapshot.close()
            return None, None
        return self.inner.split(snapshot, at)

    def merge(self, parent, child):
        if not (self.store._ensure(parent) & self.store._ensure(child)):
            parent.close()
            child.close()
            return None
        return self.inner.merge(parent, child)


def _layer_signature(leaves) -> List[Any]:
    sig = []
    for c in leaves:
        if isinstance(c, RotatingKVCache):
            sig.append(["rotating", c.max_size, c.keep])
        elif isinstance(c, RecurrentCache):
            sig.append(["recurrent", len(c.cache)])
        elif isinstance(c, KVCache):
            sig.append(["kv"])
        else:
            sig.append([type(c).__name__])
    return sig


class PersistentStore:
    """Saves a `PrefixManager`'s trie under ``root`` and loads it back (see module doc).

    Args:
        manager: the manager whose trie is persisted.
        root: cache root; this model's files go to ``root/<fingerprint[:16]>``.
        fingerprint: `model_fingerprint` of the model (and tokenizer).
        max_disk_bytes: budget for this model's directory (files + index); the least
            recently used leaves are left out of a save until it fits. ``None``: no limit.
    """

    def __init__(self, manager, root, fingerprint: str, max_disk_bytes: Optional[int] = None):
        self.manager = manager
        self.fingerprint = fingerprint
        self.root = Path(root).expanduser()
        self.max_disk_bytes = None if max_disk_bytes is None else int(max_disk_bytes)
        self._origin: "weakref.WeakKeyDictionary[Snapshot, _Origin]" = weakref.WeakKeyDictionary()
        self._bad: set = set()  # (dir, file) pairs found bad
        self._file_info: Dict[Tuple[Path, str], Tuple[int, int]] = {}
        # Unverified snapshots per file, so checking a file swaps data into all of them.
        self._waiting: Dict[Tuple[Path, str], List["weakref.ref[Snapshot]"]] = {}
        trie = manager.trie
        if not all(isinstance(o, _GuardedOps) for o in trie.ops):
            trie.ops = [o if isinstance(o, _GuardedOps) else _GuardedOps(o, self) for o in trie.ops]
        else:
            for o in trie.ops:
                o.store = self

    def directory(self, root=None) -> Path:
        r = self.root if root is None else Path(root).expanduser()
        return r / self.fingerprint[:16]

    # -- verification ---------------------------------------------------------------
    def _ensure(self, snap: Optional[Snapshot]) -> bool:
        """Make sure ``snap`` holds real, checked data; False if its file is bad."""
        if snap is None or snap.closed:
            return True
        o = self._origin.get(snap)
        if o is None or o.verified:
            return True
        key = (o.dir, o.file)
        if key in self._bad:
            return False
        size, crc = self._file_info.get(key, (-1, -1))
        try:
            arrays = _read_file(o.dir / o.file, size, crc)
            # Swap the data into every snapshot still waiting on this file.
            swaps = []
            for ref in self._waiting.get(key, []):
                s = ref()
                so = None if s is None else self._origin.get(s)
                if s is None or so is None or so.verified or s.closed:
                    continue
                new = {}
                for name, tkey in so.keys.items():
                    a = arrays.get(tkey)
                    old = s._arrays[name]  # noqa: SLF001 - the placeholder we installed
                    if a is None or a.shape != old.shape or a.dtype != old.dtype:
                        raise ValueError(f"tensor {tkey} is missing or has the wrong shape")
                    new[name] = a
                swaps.append((s, so, new))
            for s, so, new in swaps:
                s._arrays = new  # noqa: SLF001 - same shapes, so nbytes is unchanged
                so.verified = True
            self._waiting.pop(key, None)
        except Exception as e:  # any damage: the file is unusable, never a crash
            self._bad.add(key)
            _warn(f"ignoring cached snapshot file {o.dir / o.file}: {e}; "
                  f"its prefix will be recomputed")
            return False
        return True

    def _node_ok(self, node: TrieNode) -> bool:
        ok = True
        for s in node.snapshots:
            if s is not None and not self._ensure(s):
                ok = False
        return ok

    def _drop_subtree(self, node: TrieNode) -> None:
        trie = self.manager.trie
        if node.detached:
            return
        order = [node]
        i = 0
        while i < len(order):
            order.extend(order[i].children.values())
            i += 1
        for n in reversed(order):
            if n.in_use:
                # A running request holds it: just drop its state, keep the structure.
                trie.set_snapshots(n, [None] * trie.num_layers)
                continue
            trie.remove(n)
            self.manager._keep.discard(n)

    def _purge_bad(self) -> None:
        """Drop nodes (with subtrees) whose files turned out bad or whose state was closed."""
        for n in list(self.manager.trie.nodes()):
            if n.detached:
                continue
            bad = False
            for s in n.snapshots:
                if s is None:
                    continue
                o = self._origin.get(s)
                if s.closed or (o is not None and not o.verified and (o.dir, o.file) in self._bad):
                    bad = True
            if bad:
                self._drop_subtree(n)

    def before_request(self, tokens: Sequence[int]) -> None:
        """Check the files of the nodes a restore for ``tokens`` may read; drop bad ones."""
        try:
            path, _ = self.manager.trie.find(tokens)
            for n in path:
                if not self._node_ok(n):
                    self._drop_subtree(n)
                    break
        except Exception as e:  # never break a request
            _warn(f"prefix cache check failed ({type(e).__name__}: {e}); continuing")

    # -- load -----------------------------------------------------------------------
    def load(self, root=None) -> int:
        """Merge the saved trie into the manager's; returns the tokens loaded. Fail-open."""
        d = self.directory(root)
        index_path = d / INDEX
        try:
            raw = index_path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as e:
            _warn(f"cannot read the prefix cache index {index_path} ({e}); starting empty")
            return 0
        try:
            idx = json.loads(raw)
            if not isinstance(idx, dict) or idx.get("format") != _MAGIC:
                raise ValueError("not a prefix cache index")
            if idx.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {idx.get('version')!r}, this build reads "
                                 f"version {FORMAT_VERSION}")
            if idx.get("fingerprint") != self.fingerprint:
                raise ValueError("it was written for another model (fingerprint mismatch)")
            if idx.get("layers") != _layer_signature(self.manager.leaves):
                raise ValueError("its cache layers do not match this model's")
            files = {str(k): (int(v["size"]), int(v["crc32"])) for k, v in idx["files"].items()}
            nodes = list(idx["nodes"])
        except Exception as e:
            _warn(f"ignoring the prefix cache at {d}: {type(e).__name__}: {e}")
            return 0
        return self._install(d, files, nodes)

    def _install(self, d: Path, files: Dict[str, Tuple[int, int]], nodes: List[dict]) -> int:
        mgr = self.manager
        trie = mgr.trie
        L = trie.num_layers
        by_id: Dict[int, TrieNode] = {0: trie.root}
        skipped: Dict[int, bool] = {}
        problems: List[str] = []
        sizes_ok: Dict[str, bool] = {}
        for name, (size, crc) in files.items():
            self._file_info[(d, name)] = (size, crc)
            try:
                sizes_ok[name] = os.stat(d / name).st_size == size
            except OSError:
                sizes_ok[name] = False
        added: List[Tuple[TrieNode, int]] = []
        loaded = 0
        for e in nodes:
            nid = -1
            try:
                nid = int(e["id"])
                pid = int(e["parent"])
                if pid in skipped:
                    skipped[nid] = True
                    continue
                parent = by_id.get(pid)
                if parent is None:
                    raise ValueError(f"node {nid}: unknown parent {pid}")
                toks = [int(t) for t in e["tokens"]]
                if not toks or parent.end + len(toks) != int(e["end"]):
                    raise ValueError(f"node {nid}: edge does not match its end offset")
                if toks[0] in parent.children:
                    skipped[nid] = True  # the live trie already has this branch
                    continue
                layers = e["layers"]
                if len(layers) != L:
                    raise ValueError(f"node {nid}: {len(layers)} layers, expected {L}")
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
                        arrays[name] = mx.zeros([int(x) for x in shape], _STR_DTYPE[dtype])
                        keys[name] = str(tkey)
                    s = Snapshot.from_arrays(str(ent["kind"]), arrays,
                                             {k: int(v) for k, v in ent["meta"].items()})
                    snaps.append(s)
                    origins.append((s, _Origin(d, fname, keys, False)))
                node = trie.add_child(parent, toks, snaps)
            except Exception as ex:
                problems.append(f"{type(ex).__name__}: {ex}")
                skipped[nid] = True
                continue
            for s, o in origins:
                self._origin[s] = o
                self._waiting.setdefault((d, o.file), []).append(weakref.ref(s))
            by_id[nid] = node
            added.append((node, int(e.get("last_used", 0))))
            if e.get("keep"):
                mgr._keep.add(node)
            loaded += len(toks)
        # Keep the saved LRU order, after everything already in the trie.
        base = trie.clock - len(added)
        for rank, (node, _) in enumerate(sorted(added, key=lambda x: x[1]), 1):
            node.last_used = base + rank
        if problems:
            _warn(f"dropped {len(problems)} damaged node(s) of the prefix cache at {d} "
                  f"with their subtrees (first: {problems[0]})")
        mgr.enforce_budget()
        self._purge_bad()
        return loaded

    # -- save -----------------------------------------------------------------------
    def save(self, root=None) -> int:
        """Write the trie (incrementally) and collect unreferenced files; returns bytes on disk."""
        d = self.directory(root)
        d.mkdir(parents=True, exist_ok=True)
        self._purge_bad()
        with _Lock(d):
            return self._save_locked(d)

    def _save_locked(self, d: Path) -> int:
        trie = self.manager.trie
        L = trie.num_layers
        nodes = list(trie.nodes())  # parents before children
        ids = {id(n): i + 1 for i, n in enumerate(nodes)}
        ids[id(trie.root)] = 0
        # Per node: reused references, and the snapshots that need a new file.
        plan = []
        for n in nodes:
            refs: List[Optional[dict]] = [None] * L
            new: Dict[int, Snapshot] = {}
            for i, s in enumerate(n.snapshots):
                if s is None or s.closed:
                    continue
                o = self._origin.get(s)
                if o is not None and o.dir == d and (d / o.file).exists():
                    refs[i] = {"file": o.file, "keys": o.keys}
                elif o is not None and not o.verified and not self._ensure(s):
                    continue  # unreadable elsewhere: leave this layer out
                else:
                    new[i] = s
            plan.append((n, refs, new))

        # Disk budget: leave out least recently used leaves until the estimate fits.
        keep = {id(n) for n in nodes}
        if self.max_disk_bytes is not None:
            # Bytes each node adds: its index entry (measured on a stand-in with the same
            # field widths), its new file (exact header + data), and the files it
            # references (a file shared by several nodes is counted for each: safe side).
            dummy = f"n{'0' * 20}.safetensors"
            big = 10 ** len(str(max(len(nodes), 1) + 1))
            cost = {}
            for n, refs, new in plan:
                entry = {"id": big, "parent": big, "tokens": n.tokens, "end": n.end,
                         "last_used": n.last_used, "keep": False, "layers": [
                             None if (r is None and i not in new) else _layer_entry(
                                 n.snapshots[i], dummy, (r or {}).get("keys") or {
                                     k: f"L{i}.{k}" for k in n.snapshots[i]._arrays})
                             for i, r in enumerate(refs)]}
                c = len(json.dumps(entry, separators=(",", ":"))) + 1
                used = {r["file"] for r in refs if r is not None}
                c += sum(self._file_info.get((d, f), (0, 0))[0] + 80 for f in used)
                if new:
                    t = _file_tensors(new)
                    c += len(_header(t)) + sum(a.nbytes for a in t.values()) + 80
                cost[id(n)] = c
            total = 400 + len(json.dumps(_layer_signature(self.manager.leaves))) + sum(
                cost.values())
            children = {id(n): len(n.children) for n in nodes}
            leaves = [n for n in nodes if not n.children]
            import heapq
            heap = [(n.last_used, -n.end, k, n) for k, n in enumerate(leaves)]
            heapq.heapify(heap)
            seq = len(heap)
            while heap and total > self.max_disk_bytes:
                _, _, _, n = heapq.heappop(heap)
                keep.discard(id(n))
                total -= cost[id(n)]
                p = n.parent
                if p is not None and p is not trie.root:
                    children[id(p)] -= 1
                    if children[id(p)] == 0:
                        heapq.heappush(heap, (p.last_used, -p.end, seq, p))
                        seq += 1

        files: Dict[str, Tuple[int, int]] = {}
        entries = []
        for n, refs, new in plan:
            if id(n) not in keep:
                continue
            if new:
                fname = f"n{uuid.uuid4().hex[:20]}.safetensors"
                tensors = {}
                keymaps: Dict[int, Dict[str, str]] = {}
                for i, s in new.items():
                    arrays, _ = s.to_arrays()
                    keymaps[i] = {}
                    for name, a in arrays.items():
                        tensors[f"L{i}.{name}"] = a
                        keymaps[i][name] = f"L{i}.{name}"
                head, blobs = _encode_file(tensors)
                size, crc = _write_atomic(d / fname, [head, *blobs])
                self._file_info[(d, fname)] = (size, crc)
                for i, s in new.items():
                    self._origin[s] = _Origin(d, fname, keymaps[i], True)
                    refs[i] = {"file": fname, "keys": keymaps[i]}
            layers = []
            for i, s in enumerate(n.snapshots):
                r = refs[i]
                if r is None or s is None:
                    layers.append(None)
                    continue
                layers.append(_layer_entry(s, r["file"], r["keys"]))
                files[r["file"]] = self._file_info[(d, r["file"])]
            entries.append({
                "id": ids[id(n)],
                "parent": ids[id(n.parent)],
                "tokens": n.tokens,
                "end": n.end,
                "last_used": n.last_used,
                "keep": n in self.manager._keep,
                "layers": layers,
            })
        index = {
            "format": _MAGIC,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "layers": _layer_signature(self.manager.leaves),
            "saved_at": time.time(),
            "files": {k: {"size": v[0], "crc32": v[1]} for k, v in sorted(files.items())},
            "nodes": entries,
        }
        blob = json.dumps(index, separators=(",", ":")).encode()
        _write_atomic(d / INDEX, [blob])
        _fsync_dir(d)
        # Only now is it safe to delete what the new index no longer references.
        for e in os.scandir(d):
            name = e.name
            if name == INDEX or name == ".lock" or name in files:
                continue
            if name.endswith(".tmp") or (name.startswith("n") and name.endswith(".safetensors")):
                try:
                    os.unlink(e.path)
                except OSError:
                    pass
                self._file_info.pop((d, name), None)
        return len(blob) + sum(v[0] for v in files.values())
