"""Build snapshot-capable caches for any mlx-lm model, and see any cache list as leaves."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlc

from .chunked import ChunkedKVCache
from .generic import GenericCache, adapt, adapter_of, class_name
from .kv import KVCache
from .quantized import QuantizedKVCache
from .recurrent import RecurrentCache
from .rotating import RotatingKVCache
from .snapshot import CacheError

#: The cache classes with a snapshot kind of their own (anything else is adapted by
#: `GenericCache`).
LEAF_TYPES = (KVCache, RotatingKVCache, RecurrentCache, QuantizedKVCache, ChunkedKVCache)
#: mlx-lm's classes that `convert` turns into one of those.
_CONVERTIBLE = tuple(c.mlx_class for c in LEAF_TYPES)


def convert(c: Any) -> Any:
    """Our equivalent of one mlx-lm cache object, sharing its arrays (no copy).

    A class we have no equivalent of (a model's own, a future mlx-lm class) is returned
    as it is: the model keeps its own object, and `leaf_caches` adapts it.
    """
    if isinstance(c, LEAF_TYPES):
        return c
    t = type(c)
    for cls in LEAF_TYPES:
        if t is cls.mlx_class:
            return cls.from_mlx(c)
    if t is mlc.CacheList:
        return mlc.CacheList(*(convert(x) for x in c.caches))
    return c


def make_prompt_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    """Snapshot-capable caches for ``model``, one per layer, mirroring its own choice.

    The model's ``make_cache()`` decides the kinds (full attention, sliding window
    with its ``max_size``/``keep``, recurrent slots, chunked attention, lists of those,
    the model's own classes). Models without it get `KVCache` per layer, or
    `RotatingKVCache(max_kv_size, keep=4)` when ``max_kv_size`` is given (as in mlx-lm).
    """
    if hasattr(model, "make_cache"):
        return [convert(c) for c in model.make_cache()]
    n = len(model.layers)
    if max_kv_size is not None:
        return [RotatingKVCache(max_kv_size, keep=4) for _ in range(n)]
    return [KVCache() for _ in range(n)]


def load_prompt_cache(path: str, return_metadata: bool = False) -> Any:
    """mlx-lm's ``load_prompt_cache``, with each layer as our class (`convert`).

    mlx-lm rebuilds classes by name from its own module, so a file written with ours
    (``mlx_lm.models.cache.save_prompt_cache`` takes them as they are) loads there as
    mlx-lm's classes, and a file written from mlx-lm's classes loads here as ours: the
    layout is mlx-lm 0.32's either way.

    mlx-lm's ``ArraysCache`` does not record how many tokens its state absorbed; the file's
    other layers do (one prompt, one count). A non-empty recurrent layer of a file without
    such a layer stays mlx-lm's class, never ours with a wrong ``offset``."""
    loaded = mlc.load_prompt_cache(path, return_metadata=return_metadata)
    cache, meta = loaded if return_metadata else (loaded, None)
    counts = set(_token_counts(cache))
    tokens = counts.pop() if len(counts) == 1 else None
    cache = [_ours(c, tokens) for c in cache]
    return (cache, meta) if return_metadata else cache


def _token_counts(caches: Sequence[Any]):
    for c in caches:
        if isinstance(c, mlc.CacheList):
            yield from _token_counts(c.caches)
        elif not isinstance(c, mlc.ArraysCache) and isinstance(getattr(c, "offset", None), int):
            yield c.offset


def _ours(c: Any, tokens: Optional[int]) -> Any:
    if isinstance(c, mlc.CacheList):
        return mlc.CacheList(*(_ours(x, tokens) for x in c.caches))
    if type(c) is mlc.ArraysCache and not c.empty():
        if tokens is None:
            return c
        out = convert(c)
        out.offset = tokens
        return out
    return convert(c)


def leaf_caches(caches: Sequence[Any]) -> List[Any]:
    """The per-layer caches flattened (``CacheList`` entries expanded), in order; a class
    without a snapshot kind of its own appears as its `GenericCache` adapter."""
    out: List[Any] = []
    for c in caches:
        if isinstance(c, mlc.CacheList):
            out.extend(leaf_caches(list(c.caches)))
        elif isinstance(c, LEAF_TYPES) or isinstance(c, GenericCache):
            out.append(c)
        elif type(c) in _CONVERTIBLE:
            raise CacheError(f"a {type(c).__name__} from mlx-lm: convert() it first (it has a "
                             f"snapshot kind of its own)")
        else:
            out.append(adapt(c))
    return out


def quantizable(c: Any) -> bool:
    """Whether the ``kv_bits`` switch converts the cache-list entry ``c`` (a full-attention
    layer of ours at the top level, as mlx-lm converts only those; never a ``CacheList``
    or a class we adapt)."""
    return isinstance(c, LEAF_TYPES) and c.quantizable


def half_written(c: Any) -> bool:
    """Whether layer ``c`` (a leaf, `leaf_caches`) holds a write past its offset: a
    recurrent layer, or an adapted class, that a forward pass interrupted (its state
    cannot be trusted at any offset). KV-family layers never do: their rows past the
    offset are simply not read."""
    return isinstance(c, (RecurrentCache, GenericCache)) and c.dirty


def recurrent_arrays(leaves: Sequence[Any]) -> List[mx.array]:
    """The arrays of the recurrent layers among ``leaves`` (mlx-lm's ``ArraysCache``
    family, ours included): a decode step's logits do not depend on them, so the step
    evaluates them beside its outputs."""
    return [x for c in leaves if isinstance(c, mlc.ArraysCache) for x in c.cache if x is not None]


def restore_rule_of(c: Any) -> str:
    """Why a restore of layer cache ``c`` landed short, in words: its class's
    ``restore_rule``; for mlx-lm's class of a kind we have, that kind's; for any other
    class, a whole-state class's (`GenericCache.rule_for`)."""
    if isinstance(c, LEAF_TYPES) or isinstance(c, GenericCache):
        return c.restore_rule
    for cls in LEAF_TYPES:
        if type(c) is cls.mlx_class:
            return cls.restore_rule
    return GenericCache.rule_for(class_name(c))


def settle(caches: Sequence[Any], n: int) -> None:
    """Call after every forward pass of ``n`` tokens over ``caches`` (a model's cache list):
    recurrent layers that wrote state without `advance`, and objects adapted without an
    offset of their own, count the tokens."""
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.settle(n)
        elif isinstance(c, mlc.CacheList):
            settle(c.caches, n)
        elif not isinstance(c, LEAF_TYPES):
            a = c if isinstance(c, GenericCache) else adapter_of(c)
            if a is not None:
                a.settle(n)


def cache_arrays(leaves: Sequence[Any]) -> List[mx.array]:
    """Every array the layer caches (`leaf_caches`) hold (to evaluate after a forward pass)."""
    return [x for c in leaves for x in c.arrays()]


def layer_signature(leaves: List[Any], quantization: Any = None) -> List[List[Any]]:
    """Kind and shape-defining settings of each layer cache: snapshots are interchangeable
    only between cache lists with the same signature (persistence checks it).

    ``quantization`` (a `KVQuantization`) marks the full-attention layers whose rows
    switch to quantized ones: their snapshots hold that schedule's rows.
    """
    return [c.signature(quantization) if isinstance(c, (*LEAF_TYPES, GenericCache))
            else ["generic", class_name(c)] for c in leaves]
