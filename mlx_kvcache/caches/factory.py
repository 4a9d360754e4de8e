"""Build snapshot-capable caches for any mlx-lm model."""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.nn as nn
from mlx_lm.models import cache as mlc

from .kv import KVCache
from .recurrent import RecurrentCache
from .rotating import RotatingKVCache
from .snapshot import CacheError

#: The cache classes a trie can snapshot.
LEAF_TYPES = (KVCache, RotatingKVCache, RecurrentCache)


def convert(c: Any) -> Any:
    """Our equivalent of one mlx-lm cache object, sharing its arrays (no copy).

    Raises `CacheError` naming the class for a kind we cannot snapshot
    (quantized, chunked, batch caches, model-specific classes).
    """
    if isinstance(c, LEAF_TYPES):
        return c
    t = type(c)
    if t is mlc.KVCache:
        out = KVCache()
        if c.keys is not None:
            out.keys, out.values = c.keys, c.values
        out.offset = int(c.offset)
        return out
    if t is mlc.RotatingKVCache:
        out = RotatingKVCache(c.max_size, keep=c.keep)
        if c.keys is not None:
            out.state = c.state
        return out
    if t is mlc.ArraysCache:
        out = RecurrentCache(len(c.cache))
        out.cache = list(c.cache)
        out.left_padding, out.lengths = c.left_padding, c.lengths
        return out
    if t is mlc.CacheList:
        return mlc.CacheList(*(convert(x) for x in c.caches))
    raise CacheError(
        f"cannot snapshot a {t.__name__} layer cache: only KVCache, RotatingKVCache, "
        f"ArraysCache and CacheList of those are supported"
    )


def make_prompt_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    """Snapshot-capable caches for ``model``, one per layer, mirroring its own choice.

    The model's ``make_cache()`` decides the kinds (full attention, sliding window
    with its ``max_size``/``keep``, recurrent slots, lists of those). Models without
    it get `KVCache` per layer, or `RotatingKVCache(max_kv_size, keep=4)` when
    ``max_kv_size`` is given (as in mlx-lm).
    """
    if hasattr(model, "make_cache"):
        return [convert(c) for c in model.make_cache()]
    n = len(model.layers)
    if max_kv_size is not None:
        return [RotatingKVCache(max_kv_size, keep=4) for _ in range(n)]
    return [KVCache() for _ in range(n)]


def leaf_caches(caches: List[Any]) -> List[Any]:
    """The per-layer caches flattened (``CacheList`` entries expanded), in order."""
    out: List[Any] = []
    for c in caches:
        if isinstance(c, mlc.CacheList):
            out.extend(leaf_caches(list(c.caches)))
        elif isinstance(c, LEAF_TYPES):
            out.append(c)
        else:
            raise CacheError(f"cannot snapshot a {type(c).__name__} layer cache")
    return out


def layer_signature(leaves: List[Any]) -> List[List[Any]]:
    """Kind and shape-defining settings of each layer cache: snapshots are interchangeable
    only between cache lists with the same signature (persistence checks it)."""
    sig: List[List[Any]] = []
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
