"""A bounds-checked walk over a GGUF file's header, before MLX reads the file.

MLX's own GGUF reader (``mx.load(path, return_metadata=True)``) supplies the metadata and
weights, but it crashes the process (SIGSEGV) on some corrupt headers, so every file is
walked here first: magic, version, string and array bounds, tensor dimensions, types,
offsets and alignment, and that every tensor's data lies inside the file. Array values
(the 98k-entry vocabulary of the embedded model) are skipped, not read. The ``gguf``
package from llama.cpp does the same walk but materialises every array entry: 2.6 s
against 0.3 s here on the embedded SmolLM2 file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError

__all__ = ["GGUFHeader", "GGUFTensorInfo", "read_gguf_header", "GGML_TYPES", "SUPPORTED_TYPES"]

GGUF_MAGIC = b"GGUF"

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Tensor types this loader accepts (what MLX's GGUF reader converts).
SUPPORTED_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}

# GGUF metadata value types: id -> struct format (None: string/array)
_VT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
           7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_VT_STRING, _VT_ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (innermost) first
    type_id: int
    offset: int  # relative to the data section

    @property
    def type_name(self) -> str:
        t = GGML_TYPES.get(self.type_id)
        return t[0] if t else f"unknown type id {self.type_id}"

    @property
    def nbytes(self) -> int | None:
        t = GGML_TYPES.get(self.type_id)
        if t is None:
            return None
        n = 1
        for d in self.shape:
            n *= d
        return n // t[1] * t[2]


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int


class _Reader:
    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path = f, size, path

    def read(self, n: int) -> bytes:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF header (read of {n} bytes "
                f"at offset {pos} runs past the end of the {self.size}-byte file)"
            )
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.read(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        self.f.seek(n, os.SEEK_CUR)
        if self.f.tell() > self.size:
            self.read(1)  # raises the truncation error

    def value(self, vtype: int, key: str):
        """A scalar or string value; arrays are walked (bounds-checked) and give None."""
        if vtype in _VT_FMT:
            return self.unpack(_VT_FMT[vtype])
        if vtype == _VT_STRING:
            return self.string()
        if vtype == _VT_ARRAY:
            etype = self.unpack("<I")
            n = self.unpack("<Q")
            if etype in _VT_FMT:
                self.skip(n * struct.calcsize(_VT_FMT[etype]))
                return None
            if etype == _VT_STRING:
                for _ in range(n):
                    self.skip(self.unpack("<Q"))
                return None
            raise ModelLoadError(
                f"{self.path}: corrupt GGUF metadata: key {key!r} has an array of "
                f"unsupported element type {etype}"
            )
        raise ModelLoadError(
            f"{self.path}: corrupt GGUF metadata: key {key!r} has unknown value type {vtype}"
        )


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Walk and validate a GGUF header without touching MLX.

    Checks magic, version, string/array bounds, tensor dimensions and types,
    offsets/alignment, and that every tensor's data lies inside the file. The returned
    ``metadata`` holds the scalar and string values (arrays map to None).
    Raises ModelLoadError naming the path and the problem.
    """
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelLoadError(f"not a regular file: {path}")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelLoadError(f"cannot open model file {path}: {e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size, path)
        if size < 24 or f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic / too short, {size} bytes)")
        f.seek(4)
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: unsupported or corrupt GGUF version {version}")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        # Every tensor info / kv takes well over 8 bytes; reject absurd counts early.
        if n_tensors > size // 8 or n_kv > size // 8:
            raise ModelLoadError(
                f"{path}: corrupt GGUF header (claims {n_tensors} tensors, {n_kv} metadata keys)"
            )
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            metadata[key] = r.value(vtype, key)
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims > 8:
                raise ModelLoadError(f"{path}: corrupt tensor info for {name!r} ({n_dims} dims)")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            type_id = r.unpack("<I")
            offset = r.unpack("<Q")
            tensors.append(GGUFTensorInfo(name, shape, type_id, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{path}: corrupt GGUF header (alignment {alignment!r})")
        pos = f.tell()
        data_offset = (pos + alignment - 1) // alignment * alignment
    for t in tensors:
        if t.type_id not in GGML_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has unknown ggml type id {t.type_id} (corrupt file?)"
            )
        if t.offset % alignment:
            raise ModelLoadError(f"{path}: corrupt tensor info: {t.name!r} offset not aligned")
        nb = t.nbytes
        end = data_offset + t.offset + nb
        if end > size:
            raise ModelLoadError(
                f"{path}: file is truncated or corrupt: tensor {t.name!r} ends at byte "
                f"{end} but the file has {size} bytes (incomplete download?)"
            )
    return GGUFHeader(version, metadata, tensors, alignment, data_offset, size)

