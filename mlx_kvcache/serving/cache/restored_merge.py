"""mlx-lm's batch merge copying a restored prefix once, from the trie's own arrays.

On mlx-lm's batch path every request's caches are merged into one left-padded batch
cache (``KVCache.merge`` is ``BatchKVCache.merge``: a new buffer, every row copied in).
A fetch used to hand it caches whose buffers our restore had just built by concatenating
the path's snapshots — so each reused row was copied twice, the second copy right after
the first, and both buffers were alive at once. (Stock mlx-lm does the same: its LRU
entry is deep-copied, then merged.) `RestoredKVCache` is mlx-lm's ``KVCache`` with the
arrays the restore would have concatenated (`KVCache.restored_parts`); its ``merge``
copies each of them straight into the batch buffer, and the restore's buffer, never
evaluated, is never computed. At 4 requests × 6k tokens of SmolLM2 that is 1.22 s
instead of 1.6–2.1 s a round and 0.4 GiB less at the peak (docs/request-path.md).

Nothing else about the batch cache changes: mlx-lm's own ``merge`` still builds it (its
layout, padding and bookkeeping), and only its two unevaluated arrays are replaced by
ones holding the same values. mlx-lm calls the ``merge`` of the batch's first row, so a
miss is handed an empty `RestoredKVCache` too (a batch led by a miss copies the hits'
rows once as well); a batch whose first cache is still not ours (caching off) is merged
by mlx-lm alone (it reads ``keys`` / ``values``: the restore's buffers, computed then).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlc

Parts = List[Tuple[mx.array, int]]

__all__ = ["RestoredKVCache", "holds_restored"]


class RestoredKVCache(mlc.KVCache):
    """mlx-lm's ``KVCache`` as a batch fetch hands it over: ``keys`` / ``values`` are the
    restore's (unevaluated) buffers, ``parts`` the arrays whose leading rows make them."""

    def __init__(self, keys: mx.array, values: mx.array, offset: int,
                 parts: Tuple[Parts, Parts]) -> None:
        super().__init__()
        self.keys, self.values, self.offset = keys, values, int(offset)
        self.parts = parts

    def merge(self, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``BatchKVCache.merge(caches)``, each restored row copied once."""
        out = mlc.BatchKVCache.merge(caches)
        if out.keys is None or not all(type(c) in (mlc.KVCache, RestoredKVCache) for c in caches):
            return out
        # Left padding: each row's tokens end at the batch's length.
        starts = [out.keys.shape[2] - c.offset for c in caches]
        if out.left_padding.tolist() != starts:
            return out  # not the layout this fills in (another mlx-lm): its own copy stands
        keys = mx.zeros(out.keys.shape, out.keys.dtype)
        values = mx.zeros(out.values.shape, out.values.dtype)
        for i, (c, at) in enumerate(zip(caches, starts)):
            if c.keys is None or not c.offset:
                continue
            kp, vp = c.parts if isinstance(c, RestoredKVCache) else (
                [(c.keys, c.offset)], [(c.values, c.offset)])
            _fill(keys, i, at, kp)
            _fill(values, i, at, vp)
        out.keys, out.values = keys, values  # mlx-lm's own copies are dropped unevaluated
        return out


def _fill(dst: mx.array, row: int, at: int, parts: Parts) -> None:
    for a, n in parts:
        dst[row:row + 1, :, at:at + n] = a[..., :n, :]
        at += n


def holds_restored(caches: List[object]) -> bool:
    """Whether a batch fetch's cache list holds a restored KV layer (`RestoredKVCache`):
    then mlx-lm must merge with it, even for a miss, so the hits' rows are copied once."""
    return any(isinstance(c, RestoredKVCache) for c in caches)
