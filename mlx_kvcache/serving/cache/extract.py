"""mlx-lm's batch extraction without its full copy, for a prompt cache that copies only
what it lacks.

At every prompt segment's end and at every request's end, mlx-lm's server extracts the
request's row of the batch cache (``BatchKVCache.extract``: a contiguous copy of every
row of every layer, ~115 MB at 2.5k tokens of SmolLM2) and hands it to the prompt cache.
Stock's `LRUPromptCache` keeps that copy unevaluated and drops most of them (prefixes of
a later insert), so it rarely pays for it; the trie snapshots the rows it lacks — usually
a few hundred beyond its match — and evaluating them through that copy made each insert
copy the whole prefix first. With `install`, the extracted ``keys`` / ``values`` are views
of the batch's arrays instead (MLX arrays are immutable: the batch's later writes never
show through a view), so a snapshot copies its own rows only; `release` drops the views
once the insert has copied what it keeps, so the batch's next write still reuses its
buffer in place (an array with a view alive cannot be donated).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from mlx_lm.models import cache as mlc

_views: "weakref.WeakSet[Any]" = weakref.WeakSet()


def install() -> None:
    """Make ``BatchKVCache.extract`` hand out views (once per process; mlx-lm's own
    method still runs first, its unevaluated copy is dropped)."""
    cls = mlc.BatchKVCache
    orig = cls.extract
    if getattr(orig, "_mlx_kvcache_views", False):
        return

    def extract(self, idx):
        cache = orig(self, idx)
        n = cache.offset
        if n and type(cache) is mlc.KVCache and self.keys is not None:
            # mlx-lm's rows are ``[padding, _idx)`` of the row ``idx``: the same, uncopied
            cache.keys = self.keys[idx:idx + 1, :, self._idx - n:self._idx]
            cache.values = self.values[idx:idx + 1, :, self._idx - n:self._idx]
            _views.add(cache)
        return cache
    extract._mlx_kvcache_views = True
    cls.extract = extract


def release(caches: Iterable[Any]) -> None:
    """Drop the views of extracted caches (the caller is done reading them)."""
    for c in caches:
        if isinstance(c, mlc.CacheList):
            release(c.caches)
        elif c in _views:
            _views.discard(c)
            c.keys = c.values = None
