"""Between our cache classes and mlx-lm's own, for the server's prompt-cache seam.

mlx-lm's server batches requests by merging their caches with mlx-lm's batch classes
(``KVCache.merge`` is ``BatchKVCache.merge``, ...), so what a fetch hands it must be
mlx-lm's own ``KVCache`` / ``RotatingKVCache`` / ``ArraysCache`` (and, for the paths it
serves one request at a time, ``QuantizedKVCache`` / ``ChunkedKVCache``); what it inserts
is the same. A cache object of a class we have no kind for is the model's own: it goes
both ways as it is. Both directions share arrays instead of copying: a fetched cache's
arrays were just restored for that request alone, and an inserted cache is only read
(its snapshots are compact copies taken by our classes).
"""

from __future__ import annotations

from typing import Any, List, Optional

from mlx_lm.models import cache as mlc

from ...caches import (LEAF_TYPES, CacheError, GenericCache, KVCache, RecurrentCache, convert, leaf_caches)
from .padding import TrackedArraysCache
from .restored_merge import RestoredKVCache


def to_native(caches: List[Any], track_padding: bool = False, merged: bool = False) -> List[Any]:
    """mlx-lm cache objects holding the same state as ``caches`` (ours); with
    ``track_padding`` recurrent layers are `TrackedArraysCache` (remembers batch padding).
    ``merged``: the caches go to mlx-lm's batch merge, which copies them; attention
    layers just restored are `RestoredKVCache`, copied once from the trie's arrays, and
    so are empty ones (a miss leading a batch merges the others' rows that way too)."""
    return [_native(c, track_padding, merged) for c in caches]


def _native(c: Any, track: bool = False, merged: bool = False) -> Any:
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_native(x, track, merged) for x in c.caches))
    if not isinstance(c, (*LEAF_TYPES, GenericCache)):
        return c  # the model's own object
    if track and isinstance(c, RecurrentCache):
        return c.to_mlx(TrackedArraysCache)
    if merged and isinstance(c, KVCache):
        if c.keys is None:  # a miss: mlx-lm merges a batch with its first row's class
            return RestoredKVCache(None, None, 0, ([], []))
        parts = c.restored_parts()
        if parts is not None:
            return RestoredKVCache(c.keys, c.values, c.offset, parts)
    return c.to_mlx()


def from_native(caches: List[Any], length: int, quant: Any = None) -> Optional[List[Any]]:
    """Our cache objects sharing the arrays of mlx-lm ``caches`` that hold ``length``
    tokens; None when a layer does not hold exactly ``length`` tokens (then nothing must
    be stored from it). ``quant`` (a `KVQuantization`): the schedule the server's
    quantized caches follow (mlx-lm's class does not record it)."""
    ours = [convert(_untracked(c)) for c in caches]
    try:
        leaves = leaf_caches(ours)
    except CacheError:  # a class whose state cannot be snapshotted
        return None
    for c in leaves:
        if not c.adopt_length(length, quant):
            return None
    return ours


def _untracked(c: Any) -> Any:
    """A `TrackedArraysCache` or `RestoredKVCache` (a fetched cache used in place instead
    of merged) as mlx-lm's plain class (same arrays), for `convert`."""
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_untracked(x) for x in c.caches))
    if isinstance(c, TrackedArraysCache):
        plain = mlc.ArraysCache(len(c.cache))
        plain.cache, plain.left_padding, plain.lengths = c.cache, c.left_padding, c.lengths
        return plain
    if isinstance(c, RestoredKVCache):
        kv = mlc.KVCache()
        kv.keys, kv.values, kv.offset = c.keys, c.values, c.offset
        return kv
    return c
