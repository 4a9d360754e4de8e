"""Layer 5: generation that reuses cached prefixes (`PrefixCache`).

Drives an mlx-lm model (and its draft: `model_pair`) through the prefix manager: restore,
the chunked prefill that stops at the planned snapshot offsets (`prefill`), decode (one
step ahead, or speculatively on any cache kind: `decode`, `speculative`), record;
persistence through the store. The server's sequential path prefills and decodes through
the same modules. `core.CacheCore` is the one composition root (manager, store, writer,
fingerprint) that `PrefixCache` and the server's prompt cache both hold.
"""

from .prefix_cache import CachedGenerationResponse, PrefixCache

__all__ = ["CachedGenerationResponse", "PrefixCache"]
