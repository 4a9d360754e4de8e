"""Layer 5: generation that reuses cached prefixes (`PrefixCache`).

Drives an mlx-lm model through the prefix manager: restore, chunked prefill that stops at
the planned snapshot offsets, decode (speculatively, with a draft model, on any cache kind:
`speculative`), record; persistence through the store. `core.CacheCore` is the one
composition root (manager, store, writer, fingerprint) that `PrefixCache` and the
server's prompt cache both hold.
"""

from .prefix_cache import CachedGenerationResponse, PrefixCache

__all__ = ["CachedGenerationResponse", "PrefixCache"]
