"""Layer 1: cache classes that snapshot, restore, merge and split their state.

Pure MLX arrays and the mlx-lm cache protocol; nothing here knows of tries, models
beyond that protocol, or disk. The restore table (docs/design.md) is enforced by each
class's ``restore``; ``checks`` holds the input validation they share. ``merge`` means
mlx-lm's batch constructor with one argument and the snapshot merge with two (`merging`);
each kind's batch cache lives with it (`kv.BatchKVCache`, ...); `protocol` checks the installed mlx-lm's protocol.
"""

import warnings

from .snapshot import CacheError, Snapshot, compact
from .kv import BatchKVCache, KVCache, KVSnapshot
from .quantized import BatchQuantizedKVCache, QuantizedKVCache, QuantizedSnapshot
from .schedule import KVQuantization
from .rotating import BatchRotatingKVCache, RotatingKVCache, RotatingSnapshot
from .recurrent import BatchRecurrentCache, RecurrentCache, RecurrentSnapshot
from .chunked import ChunkedKVCache, ChunkedSnapshot
from .generic import GenericCache, GenericSnapshot
from .factory import (
    LEAF_TYPES, cache_arrays, convert, layer_signature, leaf_caches, load_prompt_cache,
    make_prompt_cache, restore_rule_of, settle,
)
from .merging import MergeDispatch
from .protocol import ProtocolError, check as check_protocol

_note = check_protocol()  # raises ProtocolError on an mlx-lm whose cache protocol changed
if _note:
    warnings.warn(f"mlx_kvcache: {_note}", RuntimeWarning, stacklevel=2)

__all__ = [
    "CacheError", "Snapshot", "compact", "KVCache", "KVSnapshot", "QuantizedKVCache",
    "QuantizedSnapshot", "KVQuantization", "RotatingKVCache", "RotatingSnapshot",
    "RecurrentCache", "RecurrentSnapshot", "ChunkedKVCache", "ChunkedSnapshot", "GenericCache",
    "GenericSnapshot", "settle", "LEAF_TYPES", "cache_arrays", "convert", "layer_signature",
    "leaf_caches", "make_prompt_cache", "load_prompt_cache", "BatchKVCache",
    "BatchRotatingKVCache", "BatchRecurrentCache", "BatchQuantizedKVCache", "MergeDispatch",
    "ProtocolError", "check_protocol", "restore_rule_of",
]
