"""`TriePromptCache`: our prefix trie behind mlx-lm's server, in place of its `LRUPromptCache`.

The server calls, from its one generation thread (where the model lives, so all MLX work
here runs inline): ``fetch_nearest_cache(model_key, tokens) -> (cache, rest)``,
``insert_cache(model_key, tokens, cache, cache_type=...)``, ``trim_to(n_sequences=,
n_bytes=)``, ``nbytes``, ``len()`` and ``stats_by_type()``. Here:

* a fetch restores a fresh cache list to the deepest offset every layer reaches (never
  aliasing a snapshot, never an empty ``rest``), as mlx-lm's own classes so the batch path
  can merge it and the sequential path extend it;
* an insert stores only what the trie lacks: the KV beyond the matched prefix and, for
  recurrent / sliding-window layers, whole states at that point — so sessions sharing a
  system prompt hold it once;
* `checkpoints` tells the generation loop where else to stop during prefill (every
  ``checkpoint_interval`` tokens and at branch points, hybrid and sliding-window models);
* one byte budget counts every snapshot and holds after every insert, on every path;
* with a cache directory the trie persists: loaded when the model is first used, written
  in the background after each insert, flushed by `close`.

Statistics and `clear` may be called from the HTTP threads.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..caches import CacheError, layer_signature, make_prompt_cache
from ..store.autosave import Autosaver
from ..prefix.manager import PrefixManager
from ..prefix.stats import human_bytes
from ..store import PersistentStore, directory_fingerprint, disk_usage, model_fingerprint
from .native import from_native, to_native

__all__ = ["TriePromptCache"]

log = logging.getLogger("mlx_kvcache")


@dataclass
class _Fetch:
    """What a fetch did, kept until the request's final insert logs it."""

    prompt: List[int]
    matched: int
    cached: int
    reason: Optional[str]


@dataclass
class _Model:
    """The trie (and its disk store) of the model the server has loaded."""

    key: Any
    manager: Optional[PrefixManager]
    store: Optional[PersistentStore] = None
    why_not: Optional[str] = None
    types: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)


class TriePromptCache:
    """A prompt cache for ``mlx_lm.server`` backed by a prefix trie of snapshots.

    Args:
        model_provider: the server's ``ModelProvider`` (its loaded model and tokenizer).
        max_bytes: the byte budget for every snapshot held (``--prompt-cache-bytes``).
        checkpoint_interval: hybrid and sliding-window models also checkpoint every this
            many prompt tokens (``--checkpoint-interval``).
        cache_dir: persist under this directory (None: memory only).
        max_disk_bytes: disk budget for the model's persisted cache (None: no limit).
        max_entries: ``--prompt-cache-size``, honoured by ``trim_to(n_sequences=...)``.
    """

    def __init__(self, model_provider, *, max_bytes: int, checkpoint_interval: int = 2048,
                 cache_dir: Optional[str] = None, max_disk_bytes: Optional[int] = None,
                 max_entries: Optional[int] = None, pre_end_margin: int = 4) -> None:
        self.provider = model_provider
        self.max_bytes = int(max_bytes)
        self.checkpoint_interval = int(checkpoint_interval)
        self.pre_end_margin = int(pre_end_margin)
        self.cache_dir = cache_dir
        self.max_disk_bytes = max_disk_bytes
        self.max_entries = max_entries
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._model: Optional[_Model] = None
        self._fetches: "OrderedDict[int, _Fetch]" = OrderedDict()
        self._seq = 0
        self._told: List[str] = []
        self._autosaver: Optional[Autosaver] = None

    # -- the model's trie, made on first use (in the generation thread) ------------------
    def _state(self, model_key) -> _Model:
        if self._model is not None and self._model.key == model_key:
            return self._model
        self.close()
        model = self.provider.model
        draft = getattr(self.provider, "draft_model", None)
        if draft is not None:
            self._model = _Model(model_key, None, why_not="a draft model is loaded "
                                 "(speculative decoding caches two models)")
        else:
            try:
                self._model = _Model(model_key, PrefixManager(
                    lambda: make_prompt_cache(model), max_bytes=self.max_bytes,
                    pre_end_margin=self.pre_end_margin,
                    snapshot_interval=self.checkpoint_interval))
            except CacheError as e:
                self._model = _Model(model_key, None, why_not=str(e))
        if self._model.manager is None:
            log.warning("mlx_kvcache: prompt caching is off for this model: %s", self._model.why_not)
        elif self.cache_dir is not None:
            self._open_store(model_key)
        return self._model

    def _open_store(self, model_key) -> None:
        st, mgr = self._model, self._model.manager
        path = model_key[0] if isinstance(model_key, tuple) else model_key
        adapter = model_key[1] if isinstance(model_key, tuple) and len(model_key) > 1 else None
        try:
            if path and os.path.isdir(str(path)):
                fp = directory_fingerprint(path, adapter)
            else:  # a hub id: the loaded weights themselves
                fp = model_fingerprint(self.provider.model, self.provider.tokenizer)
            st.store = PersistentStore(mgr.trie, layer_signature(mgr.ops), self.cache_dir, fp,
                                       self.max_disk_bytes, keep=mgr.keep)
            mgr.verify = st.store.before_request

            def load():
                n = st.store.load()
                mgr._enforce()
                st.store.purge_bad()
                return n
            n = mgr.run(load)
            self._autosaver = Autosaver(st.store.write)
            log.info("mlx_kvcache: loaded %d cached tokens (%s) from %s", n,
                     human_bytes(mgr.snapshot_bytes), st.store.directory())
        except Exception as e:  # fail-open: the server runs without a disk tier
            log.warning("mlx_kvcache: the prompt cache will not persist: %s", e)
            st.store = None

    def prepare(self, model_key) -> None:
        """Open the trie of the model just loaded (in the generation thread), so the first
        request does not pay for it. Never raises."""
        try:
            self._state(model_key)
        except Exception:
            log.exception("mlx_kvcache: opening the prompt cache failed")

    # -- the protocol mlx-lm's server calls ---------------------------------------------
    # Nothing here may raise into the server: an exception in its generation thread ends
    # it (every later request fails). A cache problem costs reuse, never the server.
    def fetch_nearest_cache(self, model_key, tokens: Sequence[int]) -> Tuple[Optional[List[Any]], List[int]]:
        try:
            return self._fetch(model_key, list(tokens))
        except Exception:
            log.exception("mlx_kvcache: prompt cache fetch failed; serving without reuse")
            return None, list(tokens)

    def insert_cache(self, model_key, tokens: Sequence[int], prompt_cache: List[Any],
                     *, cache_type: str = "assistant") -> None:
        try:
            self._insert(model_key, list(tokens), prompt_cache, cache_type)
        except Exception:
            log.exception("mlx_kvcache: prompt cache insert failed; those tokens are not cached")

    def _fetch(self, model_key, tokens: List[int]) -> Tuple[Optional[List[Any]], List[int]]:
        st = self._state(model_key)
        if st.manager is None or not tokens:
            return None, tokens
        live, plan = st.manager.checkout(tokens)
        st.manager.forget(live)  # the server owns these caches from here on
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += plan.restored
        self._seq += 1
        self._fetches[self._seq] = _Fetch(tokens, plan.matched, plan.restored, plan.reason)
        while len(self._fetches) > 256:
            self._fetches.popitem(last=False)
        if plan.restored == 0:
            return None, tokens
        return to_native(live.caches), tokens[plan.restored:]

    def _insert(self, model_key, tokens: List[int], prompt_cache: List[Any], cache_type: str) -> None:
        st = self._state(model_key)
        if st.manager is None or not tokens:
            return
        caches = from_native(prompt_cache, len(tokens))
        if caches is None:
            kinds = sorted({type(c).__name__ for c in prompt_cache})
            if kinds != self._told:  # once per kind of cache, not once per request
                self._told = kinds
                log.warning("mlx_kvcache: not caching: a %s cache list does not hold exactly "
                            "the tokens it is stored under, or cannot be snapshotted (e.g. "
                            "--kv-bits quantized caches)", "/".join(kinds))
            return
        node = st.manager.record(caches, tokens)
        if node is not None:
            st.types[node] = cache_type
        self._log_request(st, tokens)
        if st.store is not None and self._autosaver is not None:
            try:
                plan = st.manager.run(st.store.capture)
            except Exception as e:  # never break the server
                self._autosaver.failed(e)
            else:
                self._autosaver.submit(plan)

    def checkpoints(self, model_key, tokens: Sequence[int]) -> List[int]:
        """Prompt offsets where prefill should stop so the caches can be stored there:
        every ``checkpoint_interval`` tokens, a few tokens before the end and at the branch
        point where a restore will land short (hybrid and sliding-window models; KV layers
        reach any token from the final insert anyway). Changes nothing."""
        try:
            st = self._state(model_key)
            if st.manager is None or not st.manager.whole_state or len(tokens) < 2:
                return []
            return st.manager.preview(tokens).stops
        except Exception:
            log.exception("mlx_kvcache: planning checkpoints failed; none for this prompt")
            return []

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        st = self._model
        if st is None or st.manager is None:
            return
        mgr = st.manager

        def trim():
            if n_bytes is not None:
                mgr._evict(max(int(n_bytes), 0))
            if n_sequences is not None:
                target = max(int(n_sequences), 0)
                while sum(1 for _ in mgr.trie.nodes()) > target:
                    before = sum(1 for _ in mgr.trie.nodes())
                    mgr._evict(mgr.trie.nbytes - 1)
                    if sum(1 for _ in mgr.trie.nodes()) >= before:
                        break
        try:
            mgr.run(trim)
        except Exception:
            log.exception("mlx_kvcache: trimming the prompt cache failed")

    @property
    def nbytes(self) -> int:
        st = self._model
        return 0 if st is None or st.manager is None else st.manager.peek(lambda: st.manager.trie.nbytes)

    def __len__(self) -> int:
        st = self._model
        if st is None or st.manager is None:
            return 0
        return st.manager.peek(lambda: sum(1 for _ in st.manager.trie.nodes()))

    def __bool__(self) -> bool:  # an empty cache is still a cache
        return True

    def stats_by_type(self) -> Dict[str, Dict[str, int]]:
        out = {t: {"n_sequences": 0, "n_bytes": 0} for t in ("assistant", "user", "system")}
        st = self._model
        if st is None or st.manager is None:
            return out

        def count():
            for n in st.manager.trie.nodes():
                row = out.setdefault(st.types.get(n, "assistant"), {"n_sequences": 0, "n_bytes": 0})
                row["n_sequences"] += 1
                row["n_bytes"] += n.nbytes
        st.manager.peek(count)
        return out

    # -- our own endpoints and lifecycle --------------------------------------------------
    def report(self) -> Dict[str, Any]:
        """What ``GET /v1/cache`` returns."""
        st = self._model
        out: Dict[str, Any] = {
            "bytes_held": 0, "max_bytes": self.max_bytes, "disk_bytes": 0, "nodes": 0,
            "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evicted_bytes": 0, "checkpoint_interval": self.checkpoint_interval,
            "cache_dir": None, "enabled": bool(st and st.manager),
        }
        if st is not None and st.manager is not None:
            mgr = st.manager

            def read():
                out["bytes_held"] = mgr.trie.nbytes
                out["nodes"] = sum(1 for _ in mgr.trie.nodes())
                out["evicted_bytes"] = mgr.evicted_bytes
            mgr.peek(read)
            if st.store is not None:
                out["cache_dir"] = str(st.store.directory())
                out["disk_bytes"] = disk_usage(st.store.directory())
        elif st is not None:
            out["disabled_because"] = st.why_not
        return out

    def clear(self) -> None:
        """Drop every snapshot, in memory and on disk (``DELETE /v1/cache``)."""
        st = self._model
        if st is None or st.manager is None:
            return
        st.manager.clear()
        if st.store is not None:
            if self._autosaver is not None:
                self._autosaver.flush(timeout=60)
            st.store.clear_disk()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background writes submitted so far."""
        return True if self._autosaver is None else self._autosaver.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background writes of the current model (on model switch and stop)."""
        if self._autosaver is not None:
            self._autosaver.close(timeout)
            self._autosaver = None

    # -- the request log line -------------------------------------------------------------
    def _log_request(self, st: _Model, tokens: List[int]) -> None:
        """One line per request, at its final insert (prompt plus answer)."""
        hit = None
        for key, f in reversed(self._fetches.items()):
            if len(tokens) >= len(f.prompt) and tokens[: len(f.prompt)] == f.prompt:
                hit = key
                break
        if hit is None:
            return
        f = self._fetches.pop(hit)
        mgr = st.manager
        held = mgr.peek(lambda: mgr.trie.nbytes)
        line = (f"[cache] prompt {len(f.prompt)} tok | cached {f.cached} | prefilled "
                f"{len(f.prompt) - f.cached} | answer {len(tokens) - len(f.prompt)} tok | "
                f"held {human_bytes(held)} of {human_bytes(self.max_bytes)}")
        if f.matched > f.cached + 1 and f.reason:
            line += f" (matched {f.matched}: {f.reason})"
        log.info(line)
