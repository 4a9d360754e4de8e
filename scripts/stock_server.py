#!/usr/bin/env python
"""Stock ``mlx_lm.server``, unchanged, whose ``LRUPromptCache`` logs its exact byte count
after every insert and trim (``BENCH_CACHE_BYTES <n>``): the benchmark's view of what the
stock prompt cache holds. Arguments are mlx_lm.server's."""

import logging

import mlx_kvcache  # noqa: F401  (the same fast BLAS the other contender gets)

from mlx_lm import server as S


class MeasuredLRUPromptCache(S.LRUPromptCache):
    def _report(self):
        logging.info("BENCH_CACHE_BYTES %d", self.nbytes)

    def insert_cache(self, *args, **kwargs):
        super().insert_cache(*args, **kwargs)
        self._report()

    def trim_to(self, *args, **kwargs):
        super().trim_to(*args, **kwargs)
        self._report()


S.LRUPromptCache = MeasuredLRUPromptCache

if __name__ == "__main__":
    S.main()
