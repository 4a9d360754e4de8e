"""The disk tier of a `PrefixCache` (a mixin): opening it, saving, loading, prefetching.

With ``cache_dir`` the trie keeps every node in memory, on disk, or both
(`mlx_kvcache.store.tiers`): each snapshot is written once, in the background, after the
request that recorded it; the memory budget parks nodes that are on disk instead of
dropping them, and a request that matches parked nodes reads them back (checked). The
disk budget (``max_disk_bytes``; default a quarter of the free disk, at most 32 GiB)
evicts least recently used nodes on its own. With ``cold_bits`` KV layers are written
compressed (lossy; the directory is keyed by it, so exact and compressed caches never mix).
"""

from __future__ import annotations

import warnings
from typing import Optional

from ..caches import layer_signature
from ..store.autosave import Autosaver
from .sizing import disk_budget_for

#: ``cold_bits`` accepted: `QuantizedSnapshot` widths worth storing.
COLD_BITS = (4, 8)


def check_cold_bits(bits) -> Optional[int]:
    """``bits`` if None or one of `COLD_BITS`; ``ValueError`` / ``TypeError`` otherwise."""
    if bits is None:
        return None
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"cold_bits must be an int (4 or 8) or None, got {type(bits).__name__} {bits!r}")
    if bits not in COLD_BITS:
        raise ValueError(f"cold_bits must be 4 or 8 (or None for exact snapshots), got {bits}")
    return bits


class Persistence:
    """Expects ``manager``, ``model``, ``draft_model``, ``kv_quant``, ``_engine``,
    ``_tokenizer_for_fp`` and ``cold_bits`` from `PrefixCache`."""

    def _open_disk(self, cache_dir: Optional[str], max_disk_bytes: Optional[int]) -> None:
        self._fingerprint: Optional[str] = None
        self._store = None
        self._autosaver: Optional[Autosaver] = None
        self.disk_budget_note: Optional[str] = None
        self.max_disk_bytes = max_disk_bytes
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        if self.cache_dir is None or self.manager is None:
            return
        try:
            if self.max_disk_bytes is None:
                self.max_disk_bytes, self.disk_budget_note = disk_budget_for(
                    self.cache_dir, self.fingerprint())
            self.load(self.cache_dir)
            self._autosaver = Autosaver(self._store.write)
        except Exception as e:  # fail-open: a cache problem never stops the model
            warnings.warn(f"mlx_kvcache: could not load the prefix cache from "
                          f"{self.cache_dir}: {e}", RuntimeWarning, stacklevel=3)

    def fingerprint(self) -> str:
        """`mlx_kvcache.store.model_fingerprint` of the model (computed once); with a draft
        model, a hash of both models' fingerprints; with ``cold_bits`` or ``kv_bits``, of
        those too (`mlx_kvcache.store.cache_key`)."""
        if self._fingerprint is None:
            from ..store import cache_key, model_fingerprint

            draft = self.draft_model
            self._fingerprint = cache_key(
                model_fingerprint(self.model, self._tokenizer_for_fp),
                draft_fp=None if draft is None else model_fingerprint(draft),
                cold_bits=self.cold_bits,
                kv_quant=None if self.kv_quant is None else self.kv_quant.signature())
        return self._fingerprint

    @property
    def cache_path(self):
        """The directory this model's persisted cache lives in (None without ``cache_dir``)."""
        return None if self._store is None else self._store.directory()

    def _persistent(self, path):
        from ..store import PersistentStore

        if self._store is None:
            if path is None:
                raise ValueError("no cache directory: pass a path or construct with cache_dir")
            mgr = self.manager
            self._store = PersistentStore(mgr.trie, layer_signature(mgr.ops, self.kv_quant), path,
                                          self.fingerprint(), self.max_disk_bytes, keep=mgr.keep,
                                          cold_bits=self.cold_bits,
                                          default_budget=self.disk_budget_note is not None)
            mgr.attach_disk(self._store.before_request)
        return self._store

    def _prefetch(self, tokens) -> None:
        """Start reading the files of parked nodes ``tokens`` will restore (any thread)."""
        store, mgr = self._store, self.manager
        if store is not None and mgr is not None:
            mgr.peek(store.prefetch, tokens)

    def save(self, path: Optional[str] = None) -> int:
        """Write the cache under ``path`` (default: ``cache_dir``) now; returns bytes on disk.

        Incremental: snapshots already on disk are not rewritten. Raises ``OSError``
        when the directory cannot be written.
        """
        if self.manager is None:
            return 0
        store = self._persistent(path)
        return store.write(*self.manager.run(store.capture, path))

    def load(self, path: Optional[str] = None) -> int:
        """Merge the cache saved under ``path`` (default: ``cache_dir``) into the trie.

        Returns the number of cached tokens loaded (on disk; read when first needed).
        Fail-open: a missing, damaged, other-model or other-version cache gives one
        warning and loads nothing.
        """
        if self.manager is None:
            return 0
        store = self._persistent(path)

        def load():
            n = store.load(path)
            self.manager.enforce_budget()
            store.purge_bad()
            return n
        return self.manager.run(load)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the background saves asked for so far are on disk (False on timeout)."""
        return True if self._autosaver is None else self._autosaver.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background saves (every request asks for one), retrying once if the
        last failed; later requests are no longer saved. Idempotent."""
        if self._autosaver is not None:
            self._autosaver.close(timeout, lambda: self.manager.run(self._store.capture))
        if self._store is not None:
            self._store.close()
