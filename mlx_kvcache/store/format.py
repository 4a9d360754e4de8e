"""The on-disk format: snapshot files (safetensors), the checksummed index, atomic writes.

Layout, one directory per format version and model under a cache root::

    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/index.json        the trie, written last
    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/n<hex>.safetensors one file per node save
    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/.lock             flock'ed while writing

A build reads and writes only its own version's directory, so it never deletes or
overwrites a format it does not understand (an older or newer build's files stay as they
are). Snapshot files are written and read by the ``safetensors`` library through raw
byte buffers, so bfloat16 needs no numpy support; any safetensors reader can open them.
Their metadata names the format and the SHA-256 of the token prefix they hold state for.

``index.json`` carries a SHA-256 of its own canonical body: a change to any field (a token
id, an offset, a file's size or CRC-32) is detected and the whole index ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zlib
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from safetensors import TensorSpec, deserialize, safe_open, serialize

try:  # POSIX advisory lock so two processes never collect each other's files mid-save
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 2
MAGIC = "mlx_kvcache.prefix_trie"
INDEX = "index.json"
LOCK = ".lock"

# mlx dtype -> unsigned integer dtype of the same width (the raw bits on disk).
RAW = {
    mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16,
    mx.int8: mx.uint8, mx.int16: mx.uint16, mx.int32: mx.uint32, mx.int64: mx.uint64,
    mx.uint8: mx.uint8, mx.uint16: mx.uint16, mx.uint32: mx.uint32, mx.uint64: mx.uint64,
    mx.bool_: mx.uint8,
}
_NP = {mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64}
#: mlx dtype <-> its name ("float32"), which is also the safetensors library's spelling.
DTYPE_NAME = {d: str(d).split(".")[-1] for d in RAW}
NAME_DTYPE = {v: k for k, v in DTYPE_NAME.items()}
# The header codes `deserialize` reports ("F32", "BF16", ...).
_CODE_DTYPE = {
    "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "I8": mx.int8,
    "I16": mx.int16, "I32": mx.int32, "I64": mx.int64, "U8": mx.uint8, "U16": mx.uint16,
    "U32": mx.uint32, "U64": mx.uint64, "BOOL": mx.bool_,
}


class FormatError(ValueError):
    """A file or index that cannot be used; the message says what is wrong with it."""


def default_root() -> Path:
    """Where caches live unless told otherwise: ``$XDG_CACHE_HOME/mlx_kvcache`` (or
    ``~/.cache/mlx_kvcache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx_kvcache"


def version_dir(root: Path) -> Path:
    return Path(root) / f"v{FORMAT_VERSION}"


def prefix_digest(tokens: Sequence[int]) -> str:
    """SHA-256 naming a token prefix (binds a snapshot file to the tokens it holds)."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


# -- snapshot files -----------------------------------------------------------------------

#: An array's raw bits as numpy (no MLX needed to write them), its dtype name and shape.
RawTensor = Tuple[np.ndarray, str, List[int]]


def to_raw(a: mx.array) -> RawTensor:
    """``a`` as a `RawTensor` (runs MLX: call on the thread that owns the array; shares
    ``a``'s buffer instead of copying where MLX allows)."""
    if a.dtype not in RAW:
        raise FormatError(f"cannot persist dtype {a.dtype}")
    bits = a.astype(mx.uint8) if a.dtype == mx.bool_ else mx.view(a, RAW[a.dtype])
    return np.ascontiguousarray(np.asarray(bits)), DTYPE_NAME[a.dtype], list(a.shape)


def encode_file(tensors: Dict[str, RawTensor], metadata: Dict[str, str]) -> bytes:
    """A safetensors file holding ``tensors`` (any supported dtype, bf16 included)."""
    specs = {key: TensorSpec(dtype=dtype, shape=shape, data_ptr=raw.ctypes.data,
                             data_len=raw.nbytes)
             for key, (raw, dtype, shape) in tensors.items()}  # `tensors` keeps the buffers alive
    return serialize(specs, metadata={"format": MAGIC, **metadata})


def decode_file(data: bytes) -> Dict[str, mx.array]:
    """The tensors of a safetensors file's bytes; raises `FormatError` when unreadable."""
    try:
        items = deserialize(data)
    except Exception as e:
        raise FormatError(f"not a readable safetensors file ({e})") from None
    out = {}
    for key, d in items:
        dt = _CODE_DTYPE.get(d["dtype"])
        if dt is None:
            raise FormatError(f"tensor {key}: unsupported dtype {d['dtype']}")
        x = mx.array(np.frombuffer(d["data"], dtype=_NP[RAW[dt]]))
        x = x.astype(mx.bool_) if dt == mx.bool_ else mx.view(x, dt)
        out[key] = x.reshape(d["shape"])
    mx.eval(list(out.values()))
    return out


def file_metadata(path: Path) -> Dict[str, str]:
    """The metadata of a safetensors file (reads the header only)."""
    with safe_open(str(path), framework="numpy") as f:
        return dict(f.metadata() or {})


def read_checked(path: Path, size: int, crc: int) -> bytes:
    """A file's bytes, checked against its recorded size and CRC-32."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FormatError("file is missing") from None
    except OSError as e:
        raise FormatError(f"unreadable ({e})") from None
    if len(data) != size:
        raise FormatError(f"size {len(data)} B, expected {size} B (truncated or replaced)")
    if zlib.crc32(data) != crc:
        raise FormatError("checksum mismatch (corrupted)")
    return data


# -- the index ------------------------------------------------------------------------------

def _canonical(body: Dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_index(body: Dict[str, Any]) -> bytes:
    """The index file: ``body`` plus the SHA-256 of its canonical JSON."""
    return json.dumps({**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()},
                      separators=(",", ":")).encode()


def decode_index(raw: bytes) -> Dict[str, Any]:
    """Parse an index and check its checksum and format; raises `FormatError`."""
    try:
        idx = json.loads(raw)
    except Exception:
        raise FormatError("not valid JSON") from None
    if not isinstance(idx, dict) or idx.get("format") != MAGIC:
        raise FormatError("not a prefix cache index")
    if idx.get("version") != FORMAT_VERSION:
        raise FormatError(f"format version {idx.get('version')!r}, this build reads "
                          f"version {FORMAT_VERSION}")
    body = {k: v for k, v in idx.items() if k != "checksum"}
    if idx.get("checksum") != hashlib.sha256(_canonical(body)).hexdigest():
        raise FormatError("its checksum does not match its contents (edited or corrupted)")
    return body


# -- files ----------------------------------------------------------------------------------

def fsync_dir(d: Path) -> None:
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


def write_atomic(path: Path, parts: Iterable[bytes]) -> Tuple[int, int]:
    """Write ``parts`` to ``path`` through a fsync'ed temporary; returns (size, crc32)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    crc, size = 0, 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
                crc = zlib.crc32(p, crc)
                size += len(p)
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


def snapshot_files(d: Path) -> List[str]:
    """Names of the snapshot and temporary files in ``d`` (what a save may collect)."""
    try:
        names = [e.name for e in os.scandir(d)]
    except OSError:
        return []
    return [n for n in names if n.endswith(".tmp")
            or (n.startswith("n") and n.endswith(".safetensors"))]


class DirLock:
    """``flock`` on ``<dir>/.lock`` for the duration of a ``with`` block (POSIX)."""

    def __init__(self, d: Path):
        self.path = Path(d) / LOCK
        self.fd = None

    def __enter__(self) -> "DirLock":
        if fcntl is not None:
            self.fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
