"""Layer 4: persistence of the prefix trie, keyed by model identity.

``format`` (files, index, layout), ``fingerprint`` (model identity), ``lazy`` (verified
loading on first use), ``save`` (capture then write, freeing space first), ``store``
(`PersistentStore`), ``autosave`` (writing captures in the background). Depends on the cache classes and the trie, never on generation
(docs/design.md, "Persistence").
"""

from .fingerprint import directory_fingerprint, model_fingerprint
from .format import FORMAT_VERSION, default_root, disk_usage
from .store import PersistentStore

__all__ = ["FORMAT_VERSION", "PersistentStore", "default_root", "directory_fingerprint", "disk_usage",
           "model_fingerprint"]
