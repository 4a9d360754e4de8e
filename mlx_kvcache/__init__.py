"""mlx_kvcache: KV caches that snapshot, restore, merge and split, for mlx-lm models.

The folders are the layers (docs/design.md); each imports only the ones before it:

``caches``      1  cache classes (`KVCache`, `QuantizedKVCache`, `RotatingKVCache`,
                   `RecurrentCache`, `ChunkedKVCache`, `GenericCache`, `Snapshot`)
``prefix``      2-3 the prefix trie and the manager (restore, snapshot, evict decisions)
``store``       4  the trie on disk, keyed by model identity
``generation``  5  `PrefixCache`: generation that reuses cached prefixes
``serving``     5  ``mlx-kvcache serve``: mlx-lm's OpenAI-compatible server with the trie
                   behind its prompt cache, the agent APIs (Anthropic Messages, OpenAI
                   Responses) through one typed front door, output parsers, foresight
``models``, ``cli``  6  front ends: model loading, the ``mlx-kvcache`` commands
"""

from . import _blas

# Must run before anything imports mlx.core (see _blas).
_blas.preload()

from .caches import (  # noqa: E402
    CacheError,
    ChunkedKVCache,
    ChunkedSnapshot,
    GenericCache,
    GenericSnapshot,
    KVCache,
    KVQuantization,
    KVSnapshot,
    QuantizedKVCache,
    QuantizedSnapshot,
    RecurrentCache,
    RecurrentSnapshot,
    RotatingKVCache,
    RotatingSnapshot,
    Snapshot,
    convert,
    ProtocolError,
    leaf_caches,
    load_prompt_cache,
    make_prompt_cache,
    settle,
)
from .prefix import CacheStats, PrefixManager, PrefixTrie, RequestStats, TrieNode  # noqa: E402
from .generation import CachedGenerationResponse, PrefixCache  # noqa: E402

__all__ = [
    "CacheError",
    "Snapshot",
    "KVCache",
    "KVSnapshot",
    "QuantizedKVCache",
    "QuantizedSnapshot",
    "KVQuantization",
    "ChunkedKVCache",
    "ChunkedSnapshot",
    "GenericCache",
    "GenericSnapshot",
    "RotatingKVCache",
    "RotatingSnapshot",
    "RecurrentCache",
    "RecurrentSnapshot",
    "settle",
    "convert",
    "leaf_caches",
    "make_prompt_cache",
    "load_prompt_cache",
    "ProtocolError",
    "CacheStats",
    "RequestStats",
    "PrefixTrie",
    "TrieNode",
    "PrefixManager",
    "PrefixCache",
    "CachedGenerationResponse",
]
__version__ = "0.1.0"
