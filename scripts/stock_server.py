#!/usr/bin/env python
"""Stock ``mlx_lm.server``, unchanged, whose ``LRUPromptCache`` logs its exact byte count
after every insert and trim (``BENCH_CACHE_BYTES <n>``): the benchmark's view of what the
stock prompt cache holds. With ``MLX_KVCACHE_PROFILE=1`` it also counts and times its
prefill passes and decode steps and logs them at each request's end (``[profile] rank N``,
as ``mlx-kvcache serve`` does). Arguments are mlx_lm.server's."""

import logging

import mlx_kvcache  # noqa: F401  (the same fast BLAS the other contender gets)

import mlx.core as mx
from mlx_lm import server as S

from mlx_kvcache.serving.cache.profile import from_env, probe_server_loop

PROFILE = from_env()
if PROFILE.timing:
    probe_server_loop(PROFILE)


class MeasuredLRUPromptCache(S.LRUPromptCache):
    def _report(self):
        logging.info("BENCH_CACHE_BYTES %d", self.nbytes)

    def fetch_nearest_cache(self, *args, **kwargs):
        with PROFILE.phase("fetch"):  # its copy of the entry (the restore)
            return super().fetch_nearest_cache(*args, **kwargs)

    def insert_cache(self, *args, **kwargs):
        final = kwargs.get("cache_type", "assistant") == "assistant"
        with PROFILE.phase("final" if final else "checkpoint"):
            super().insert_cache(*args, **kwargs)
        self._report()
        if PROFILE.timing and kwargs.get("cache_type", "assistant") == "assistant":
            PROFILE.add("stored.final")
            logging.info(PROFILE.line(mx.distributed.init().rank()))

    def trim_to(self, *args, **kwargs):
        super().trim_to(*args, **kwargs)
        self._report()


S.LRUPromptCache = MeasuredLRUPromptCache

if __name__ == "__main__":
    S.main()
