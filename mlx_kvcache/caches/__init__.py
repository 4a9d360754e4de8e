"""Layer 1: cache classes that snapshot, restore, merge and split their state.

Pure MLX arrays and the mlx-lm cache protocol; nothing here knows of tries, models
beyond that protocol, or disk. The restore table (docs/design.md) is enforced by each
class's ``restore``; ``checks`` holds the input validation they share.
"""

from .snapshot import CacheError, Snapshot, compact
from .kv import KVCache, KVSnapshot
from .rotating import RotatingKVCache, RotatingSnapshot
from .recurrent import RecurrentCache, RecurrentSnapshot, settle
from .factory import LEAF_TYPES, convert, layer_signature, leaf_caches, make_prompt_cache

__all__ = [
    "CacheError", "Snapshot", "compact", "KVCache", "KVSnapshot", "RotatingKVCache",
    "RotatingSnapshot", "RecurrentCache", "RecurrentSnapshot", "settle", "LEAF_TYPES",
    "convert", "layer_signature", "leaf_caches", "make_prompt_cache",
]
