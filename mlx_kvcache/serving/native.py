"""Between our cache classes and mlx-lm's own, for the server's prompt-cache seam.

mlx-lm's server batches requests by merging their caches with mlx-lm's batch classes
(``KVCache.merge`` is ``BatchKVCache.merge``, ...), so what a fetch hands it must be
mlx-lm's own ``KVCache`` / ``RotatingKVCache`` / ``ArraysCache``; what it inserts is the
same. Both directions share arrays instead of copying: a fetched cache's arrays were just
restored for that request alone, and an inserted cache is only read (its snapshots are
compact copies taken by our classes).
"""

from __future__ import annotations

from typing import Any, List, Optional

from mlx_lm.models import cache as mlc

from ..caches import CacheError, KVCache, RecurrentCache, RotatingKVCache, convert, leaf_caches


def to_native(caches: List[Any]) -> List[Any]:
    """mlx-lm cache objects holding the same state as ``caches`` (ours)."""
    return [_native(c) for c in caches]


def _native(c: Any) -> Any:
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_native(x) for x in c.caches))
    if isinstance(c, KVCache):
        n = mlc.KVCache()
        if c.keys is not None and c.offset:
            # The whole buffer, room to grow included (mlx-lm's own layout: rows past
            # ``offset`` are free space): the prompt's rest is written in place instead
            # of copying every cached row into a bigger buffer first.
            n.keys, n.values = c.keys, c.values
            n.offset = c.offset
        return n
    if isinstance(c, RotatingKVCache):
        n = mlc.RotatingKVCache(c.max_size, keep=c.keep)
        if c.keys is not None and c.offset:
            n.keys, n.values, n.offset, n._idx = c.keys, c.values, c.offset, c._idx
        return n
    if isinstance(c, RecurrentCache):
        n = mlc.ArraysCache(len(c.cache))
        n.cache = list(c.cache)
        return n
    raise CacheError(f"cannot hand a {type(c).__name__} to mlx-lm's server")


def from_native(caches: List[Any], length: int) -> Optional[List[Any]]:
    """Our cache objects sharing the arrays of mlx-lm ``caches`` that hold ``length``
    tokens; None when a layer cannot be snapshotted or does not hold exactly ``length``
    tokens (then nothing must be stored from it)."""
    try:
        ours = [convert(c) for c in caches]
    except CacheError:
        return None
    for c in leaf_caches(ours):
        if isinstance(c, RecurrentCache):
            if c.empty() or c.lengths is not None or c.left_padding is not None:
                return None  # a batch row's padding bookkeeping: not a single sequence
            c.offset = length  # recurrent state has no positions: the caller's count
        elif c.offset != length or c.keys is None:
            return None
    return ours
