"""Layers 2 and 3: the prefix trie of snapshots and the manager that decides what to
restore, where to snapshot and what to evict. No generation and no mlx-lm model code:
the trie (``trie`` with its counters and invariants, ``node``, ``journal``,
``eviction``) knows only `Snapshot`; the planner and the manager ask each layer's cache
class for its kind rules (`caches.reach`).
"""

from .node import TrieNode
from .trie import LayerOps, PrefixTrie
from .stats import CacheStats, RequestStats
from .manager import PrefixManager

__all__ = ["TrieNode", "LayerOps", "PrefixTrie", "CacheStats", "RequestStats", "PrefixManager"]
