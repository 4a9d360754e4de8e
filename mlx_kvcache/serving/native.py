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

from ..caches import (
    CacheError, ChunkedKVCache, GenericCache, KVCache, QuantizedKVCache, RecurrentCache,
    RotatingKVCache, convert, leaf_caches,
)
from .padding import TrackedArraysCache


def to_native(caches: List[Any], track_padding: bool = False) -> List[Any]:
    """mlx-lm cache objects holding the same state as ``caches`` (ours); with
    ``track_padding`` recurrent layers are `TrackedArraysCache` (remembers batch padding)."""
    return [_native(c, track_padding) for c in caches]


def _native(c: Any, track: bool = False) -> Any:
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_native(x, track) for x in c.caches))
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
        n = (TrackedArraysCache if track else mlc.ArraysCache)(len(c.cache))
        n.cache = list(c.cache)
        return n
    if isinstance(c, QuantizedKVCache):
        n = mlc.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
        if c.keys is not None and c.offset:
            n.keys, n.values = c.keys_and_values()
            n.offset = c.offset
        return n
    if isinstance(c, ChunkedKVCache):
        n = mlc.ChunkedKVCache(c.chunk_size)
        if c.keys is not None:
            n.keys, n.values = c.keys_and_values()
        n.offset, n.start_position = c.offset, c.start_position
        return n
    return c.obj if isinstance(c, GenericCache) else c  # the model's own object


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
        if (isinstance(c, QuantizedKVCache) and quant is not None and c.quantized_kv_start < 0
                and (c.bits, c.group_size) == (quant.bits, quant.group_size)):
            c.quantized_kv_start = quant.start
        if isinstance(c, RecurrentCache):
            if c.empty() or c.lengths is not None or c.left_padding is not None:
                return None  # a batch row's padding bookkeeping: not a single sequence
            c.offset = length  # recurrent state has no positions: the caller's count
        elif isinstance(c, GenericCache):
            c.set_offset(length)  # counted by the caller where the object has no offset
            if c.offset != length:
                return None
        elif c.offset != length or (c.keys is None and not isinstance(c, ChunkedKVCache)):
            return None
    return ours



def _untracked(c: Any) -> Any:
    """A `TrackedArraysCache` as mlx-lm's plain class (same arrays), for `convert`."""
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_untracked(x) for x in c.caches))
    if isinstance(c, TrackedArraysCache):
        plain = mlc.ArraysCache(len(c.cache))
        plain.cache, plain.left_padding, plain.lengths = c.cache, c.left_padding, c.lengths
        return plain
    return c
