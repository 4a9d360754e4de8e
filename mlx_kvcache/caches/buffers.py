"""What the two attention caches (and their snapshots) share: keys and values in
``[B, H, rows, D]`` buffers."""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx


class KVBuffers:
    """``keys`` / ``values`` buffers (None until the first write) and ``offset``."""

    keys: Optional[mx.array]
    values: Optional[mx.array]
    offset: int

    def keys_and_values(self) -> Tuple[mx.array, mx.array]:
        """Views of the ``offset`` valid positions."""
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def _row_bytes(self) -> int:
        """Bytes one token position takes in both buffers, over batch and heads."""
        B, H, _, dk = self.keys.shape
        return B * H * (dk * self.keys.dtype.size + self.values.shape[3] * self.values.dtype.size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the live buffers (including the growth padding they really hold)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class SnapshotKV:
    """The ``keys`` / ``values`` arrays of an attention cache's `Snapshot` (raises once closed)."""

    @property
    def keys(self) -> mx.array:
        return self._get("keys")

    @property
    def values(self) -> mx.array:
        return self._get("values")
