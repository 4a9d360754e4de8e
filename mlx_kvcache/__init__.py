"""mlx_kvcache: KV caches that snapshot, restore, merge and split, for mlx-lm models.

Layers (each imports only the ones above it): cache classes (`KVCache`,
`RotatingKVCache`, `RecurrentCache`, `Snapshot`), the prefix trie, the prefix-cache
manager and generation (`PrefixCache`), persistence, and the front ends.
"""

from . import _blas

# Must run before anything imports mlx.core (see _blas).
_blas.preload()

from .snapshot import CacheError, Snapshot  # noqa: E402
from .kv import KVCache, KVSnapshot  # noqa: E402
from .rotating import RotatingKVCache, RotatingSnapshot  # noqa: E402
from .recurrent import RecurrentCache, RecurrentSnapshot, settle  # noqa: E402
from .factory import convert, leaf_caches, make_prompt_cache  # noqa: E402

__all__ = [
    "CacheError",
    "Snapshot",
    "KVCache",
    "KVSnapshot",
    "RotatingKVCache",
    "RotatingSnapshot",
    "RecurrentCache",
    "RecurrentSnapshot",
    "settle",
    "convert",
    "leaf_caches",
    "make_prompt_cache",
]
__version__ = "0.1.0"

from .stats import CacheStats, RequestStats  # noqa: E402
from .trie import PrefixTrie, TrieNode  # noqa: E402
from .manager import PrefixManager  # noqa: E402
from .prefix_cache import CachedGenerationResponse, PrefixCache  # noqa: E402

__all__ += [
    "CacheStats",
    "RequestStats",
    "PrefixTrie",
    "TrieNode",
    "PrefixManager",
    "PrefixCache",
    "CachedGenerationResponse",
]
