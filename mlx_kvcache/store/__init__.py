"""Layer 4: persistence of the prefix trie, keyed by model identity.

``format`` (files, index, layout), ``fingerprint`` (model identity), ``lazy`` (verified
loading on first use), ``save`` (capture then write, freeing space first), ``store``
(`PersistentStore`). Depends on the cache classes and the trie, never on generation
(docs/design.md, "Persistence").
"""

from .fingerprint import model_fingerprint
from .format import FORMAT_VERSION, disk_usage
from .store import PersistentStore

__all__ = ["FORMAT_VERSION", "PersistentStore", "disk_usage", "model_fingerprint"]
