"""The on-disk format: layout, snapshot files (safetensors), safe reads, atomic writes.

Layout, one directory per format version and model under a cache root::

    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/index.sqlite      the trie (SQLite, WAL)
    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/n<20 hex>.safetensors  one file per node write
    <root>/v<FORMAT_VERSION>/<fingerprint[:16]>/.lock             flock'ed while writing
    <root>/v<FORMAT_VERSION>/file-digests.sqlite                  remembered weight digests

A build reads and writes only its own version's directory, so it never deletes or
overwrites a format it does not understand (an older or newer build's files stay as they
are). Snapshot files are written and read by the ``safetensors`` library through raw byte
buffers, so bfloat16 needs no numpy support; any safetensors reader can open them.

A snapshot file describes itself: its metadata holds the SHA-256 of the token prefix up
to the end of the node it was written for, that node's edge (``start``, ``end`` and the
tokens, so a later slice of the edge can be checked too) and, per layer, the snapshot kind,
its integer metadata and the tensors' keys, shapes and dtypes. Everything a restore reads
is therefore inside a CRC-checked file and bound to its tokens by the prefix digest; the
index only says which file holds what. An index row edited to point elsewhere gives a
digest or shape mismatch (a damaged node), never state for other tokens. There is no
checksum over the index itself: an unkeyed checksum stops no one who can edit the file.

File names in the index are checked before anything is opened (`check_name`: the plain
names this build writes), and files are opened without following symlinks and read only
when they are regular files of the recorded size (`read_regular`): an entry naming
``../x``, an absolute path, a FIFO or a device is a damaged node, never a hang or a read
outside the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from safetensors import TensorSpec, deserialize, serialize

try:  # POSIX advisory lock so two processes never collect each other's files mid-save
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 3
MAGIC = "mlx_kvcache.prefix_trie"
LOCK = ".lock"
#: The plain names this build gives snapshot files; nothing else is ever opened.
FILE_NAME = re.compile(r"n[0-9a-f]{20}\.safetensors")

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


def exports_dir(root) -> Path:
    """Where ``mlx-kvcache serve`` writes the mlx-lm directories of GGUF models (the
    embedded one included) under the cache root ``root``."""
    return Path(root).expanduser() / "models"


def version_dir(root: Path, version: int = FORMAT_VERSION) -> Path:
    return Path(root) / f"v{version}"


def model_dir(root, fingerprint: str) -> Path:
    """The directory of the cache named ``fingerprint`` under the cache root ``root``."""
    return version_dir(Path(root).expanduser()) / fingerprint[:16]


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as the little-endian int64 bytes every digest and index row uses."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def prefix_digest(tokens: Sequence[int]) -> str:
    """SHA-256 naming a token prefix (binds a snapshot file to the tokens it holds)."""
    return hashlib.sha256(token_bytes(tokens)).hexdigest()


def new_file_name() -> str:
    return f"n{uuid.uuid4().hex[:20]}.safetensors"


def check_name(name) -> str:
    """``name`` if it is a snapshot file name this build writes; else `FormatError`."""
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
        raise FormatError(f"{name!r} is not a snapshot file name of this format")
    return name


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
    return serialize(specs, metadata={"format": MAGIC, "version": str(FORMAT_VERSION), **metadata})


def file_header(data: bytes) -> Dict[str, str]:
    """The metadata of a safetensors file's bytes; raises `FormatError`."""
    try:
        n = int.from_bytes(data[:8], "little")
        if n <= 0 or 8 + n > len(data):
            raise ValueError("header length out of range")
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    except Exception as e:
        raise FormatError(f"not a readable safetensors file ({e})") from None
    if meta.get("format") != MAGIC or meta.get("version") != str(FORMAT_VERSION):
        raise FormatError("not a snapshot file of this format")
    return meta


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


def regular_size(path: Path) -> int:
    """The size of ``path`` if it is a regular file (not followed if a symlink); else
    `FormatError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FormatError("file is missing") from None
    except OSError as e:
        raise FormatError(f"cannot stat it ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError("not a regular file (a symlink, FIFO or device)")
    return st.st_size


def read_regular(d: Path, name: str, size: int, crc: int) -> bytes:
    """The bytes of snapshot file ``name`` in ``d``, checked: a plain name, a regular file
    (opened without following symlinks or blocking, then ``fstat``-ed), exactly ``size``
    bytes, CRC-32 ``crc``. Raises `FormatError` naming what is wrong."""
    check_name(name)
    regular_size(d / name)  # refuse a FIFO or device before opening it at all
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(d / name, flags)
    except FileNotFoundError:
        raise FormatError("file is missing") from None
    except OSError as e:
        raise FormatError(f"unreadable ({e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError("not a regular file (a symlink, FIFO or device)")
        if st.st_size != size:
            raise FormatError(f"size {st.st_size} B, expected {size} B (truncated or replaced)")
        os.set_blocking(fd, True)
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n <= 0:
                raise FormatError(f"size {got} B, expected {size} B (truncated while read)")
            got += n
    except OSError as e:
        raise FormatError(f"unreadable ({e})") from None
    finally:
        os.close(fd)
    if zlib.crc32(buf) != crc:
        raise FormatError("checksum mismatch (corrupted)")
    return bytes(buf)


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
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def collectable(d: Path) -> List[str]:
    """Names in ``d`` a writer may collect: snapshot files and temporaries."""
    try:
        names = [e.name for e in os.scandir(d)]
    except OSError:
        return []
    return [n for n in names if FILE_NAME.fullmatch(n) or (n.endswith(".tmp") and (
        FILE_NAME.fullmatch(n.split(".tmp")[0].rsplit(".", 2)[0]) or n.startswith("index.sqlite.")))]


class DirLock:
    """``flock`` on ``<dir>/.lock`` for the duration of a ``with`` block (POSIX)."""

    def __init__(self, d: Path):
        self.path = Path(d) / LOCK
        self.fd = None

    def __enter__(self) -> "DirLock":
        if fcntl is not None:
            self.fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                              | getattr(os, "O_NONBLOCK", 0), 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
