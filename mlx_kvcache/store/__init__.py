"""Layer 4: persistence of the prefix trie, keyed by model identity.

``format`` (layout, snapshot files, name checks, safe reads), ``index`` (the SQLite
index), ``fingerprint`` and ``digests`` (model identity), ``lazy`` (verified loading on
first use), ``load`` (index rows into a trie), ``delta`` (capturing what changed),
``save`` (writing it), ``store`` (`PersistentStore`), ``autosave`` (writing in the
background), ``agreed`` (loading on the ranks of a sharded model). Depends on the cache
classes and the trie, never on generation (docs/design.md, "Persistence").
"""

from .fingerprint import (cache_key, directory_fingerprint, directory_identity, model_fingerprint,
                          record_identity)
from .format import FORMAT_VERSION, default_root, disk_usage, exports_dir
from .store import PersistentStore

__all__ = ["FORMAT_VERSION", "PersistentStore", "cache_key", "default_root", "directory_fingerprint",
           "directory_identity", "disk_usage", "exports_dir", "model_fingerprint", "record_identity"]
