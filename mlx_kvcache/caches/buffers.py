"""What the two attention caches (and their snapshots) share: keys and values in
``[B, H, rows, D]`` buffers."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

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

    def adopt_length(self, length: int, quant: Any = None) -> bool:
        """Made from mlx-lm's class (`from_mlx`): whether it holds exactly ``length``
        tokens (it counts its own)."""
        return self.offset == length and self.keys is not None

    def arrays(self) -> List[mx.array]:
        """The buffers the cache holds now (to evaluate after a forward pass)."""
        return [] if self.keys is None else [self.keys, self.values]

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


def concat_rows(parts: Sequence[Tuple[mx.array, int]], pad: int) -> mx.array:
    """Rows ``[0, n)`` (axis 2) of each ``(array, n)`` of ``parts``, then ``pad`` zero rows:
    one new ``[B, H, rows, D]`` buffer, filled in one copy.

    MLX's CPU ``concatenate`` copies element by element (~2x a plain copy for float32,
    ~3x for float16); seen as 8-byte words — free for the compact arrays snapshots hold —
    the same copy runs at plain-copy speed. The bits, shape and dtype are unchanged.
    """
    a0 = parts[0][0]
    B, H, _, D = a0.shape
    row = D * a0.dtype.size
    if row % 8:
        cols: List[mx.array] = [a[..., :n, :] for a, n in parts]
        return mx.concatenate(cols + [mx.zeros((B, H, pad, D), a0.dtype)], axis=2)
    # View first, then slice: a view of a slice would copy it.
    cols = [mx.view(a, mx.uint64)[..., :n, :] for a, n in parts]
    out = mx.concatenate(cols + [mx.zeros((B, H, pad, row // 8), mx.uint64)], axis=2)
    return mx.view(out, a0.dtype)
