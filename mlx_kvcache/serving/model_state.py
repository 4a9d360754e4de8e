"""The trie (and disk store) of the model mlx-lm's server has loaded.

Made in the generation thread when the model loads. On the ranks of a sharded model every
choice here is agreed (`mlx_kvcache.prefix.agreement`): whether caching is on at all,
whether checkpoints are planned (a pipeline rank may hold only attention layers while
another holds recurrent ones), and what is loaded from disk. Each rank persists its own
shard under a directory named by the model, the sharding mode, the world size and the
rank, so no rank ever reads another plan's files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..caches import CacheError, KVQuantization, layer_signature, make_prompt_cache
from ..generation import sizing
from ..prefix.agreement import Agreement, any_rank, every
from ..prefix.manager import PrefixManager
from ..prefix.stats import human_bytes
from ..store import (PersistentStore, cache_key, directory_fingerprint, directory_identity,
                     model_fingerprint)
from ..store.autosave import Autosaver
from .padding import padded_rows_exact, recurrent_kinds
from .validation import vocab_size

log = logging.getLogger("mlx_kvcache")


@dataclass
class ModelState:
    key: Any
    manager: Optional[PrefixManager]
    store: Optional[PersistentStore] = None
    writer: Optional[Autosaver] = None
    why_not: Optional[str] = None
    #: mlx-lm's batch path is not exact for this model's padded recurrent rows: hand out
    #: `TrackedArraysCache` and store no padded row (`serving.padding`).
    track_padding: bool = False
    #: The memory and disk budgets in force (defaults follow the model and the disk).
    max_bytes: int = 0
    max_disk_bytes: Optional[int] = None
    #: Top-level cache entries of the target model: a cache list holds them, then the
    #: draft model's (mlx-lm's layout for speculative decoding).
    target_entries: int = 0
    #: The draft model's vocabulary when smaller than the target's (ids it lacks are fed
    #: to it clamped), else None.
    draft_vocab: Optional[int] = None


def open_model(provider, key, agree: Agreement, *, max_bytes: Optional[int],
               checkpoint_interval: int, pre_end_margin: int, cache_dir: Optional[str],
               max_disk_bytes: Optional[int], sharding: str = "",
               cold_bits: Optional[int] = None) -> ModelState:
    """The state for the model ``provider`` just loaded under ``key``. ``max_bytes`` /
    ``max_disk_bytes`` None: the defaults (`generation.sizing`), said in the log."""
    model = provider.model
    draft = getattr(provider, "draft_model", None)
    manager, why_not, quant, entries = None, None, None, 0
    if max_bytes is None:
        max_bytes, why = sizing.default_ram_budget(sizing.model_bytes(model, draft))
        log.info("mlx_kvcache: prompt cache memory budget %s (--prompt-cache-bytes)", why)

    def make_caches():
        # With a draft model one node holds both models' layers (as `PrefixCache` does):
        # a hit skips prefill on both, the budget counts both.
        caches = make_prompt_cache(model)
        return caches if draft is None else caches + make_prompt_cache(draft)
    try:
        quant = _quantization(getattr(provider, "cli_args", None))
        entries = len(make_prompt_cache(model))
        manager = PrefixManager(make_caches, max_bytes=max_bytes, pre_end_margin=pre_end_margin,
                                snapshot_interval=checkpoint_interval, kv_quant=quant)
    except CacheError as e:
        why_not = str(e)
    if not every(agree, manager is not None):  # a rank that cannot cache turns it off for all
        manager, why_not = None, why_not or "another rank cannot snapshot its layers"
    track = False
    # Only models with recurrent layers are checked (attention masks its padding; that is
    # mlx-lm's batch path for every model). The forward passes involve every rank.
    if manager is not None and every(agree, bool(getattr(provider, "is_batchable", False))) \
            and any_rank(agree, bool(recurrent_kinds(model))):
        attention_ok, recurrent_ok = _padding_exact(model, agree)
        if not every(agree, attention_ok):
            manager, why_not = None, ("mlx-lm's batch path does not compute exact attention "
                                      "caches for padded rows of this model")
        track = not every(agree, recurrent_ok)
    st = ModelState(key, manager, why_not=why_not, track_padding=track, max_bytes=max_bytes,
                    target_entries=entries)
    if draft is not None:
        tv, dv = vocab_size(model), vocab_size(draft)
        st.draft_vocab = dv if dv is not None and (tv is None or dv < tv) else None
    if manager is None:
        log.warning("mlx_kvcache: prompt caching is off for this model: %s", why_not)
        return st
    _check_budget((model, draft), max_bytes, checkpoint_interval)
    if track:
        log.info("mlx_kvcache: mlx-lm's batch path computes wrong recurrent states for "
                 "padded rows of this model: states of requests batched with longer ones "
                 "are not stored")
    manager.agree = agree
    # Checkpoints are planned where any rank has a layer that needs them.
    manager.whole_state = any_rank(agree, manager.whole_state)
    if cache_dir is not None:
        _open_store(st, provider, key, agree, cache_dir, max_disk_bytes, sharding, cold_bits)
    return st


def _check_budget(models, max_bytes: int, interval: int) -> None:
    """One warning when the budget cannot hold one checkpoint of these models (a target
    and its draft share each node)."""
    tokens = max(1, min(int(interval), 2048))
    try:
        one = sum(sizing.checkpoint_bytes(m, lambda m=m: make_prompt_cache(m), tokens)
                  for m in models if m is not None)
    except Exception:  # noqa: BLE001 - a model that cannot take one token: no advice
        return
    problem = sizing.budget_problem(max_bytes, one, tokens, live_counted=False)
    if problem:
        log.warning("mlx_kvcache: %s (--prompt-cache-bytes)", problem)


def _quantization(args) -> Optional[KVQuantization]:
    """mlx-lm's ``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` as the
    canonical schedule (`KVQuantization`; raises `CacheError` when invalid)."""
    bits = getattr(args, "kv_bits", None)
    if bits is None:
        return None
    return KVQuantization(bits, getattr(args, "kv_group_size", 64),
                          getattr(args, "quantized_kv_start", 5000))


def _padding_exact(model, agree):
    """(attention layers exact, recurrent layers exact) for padded batch rows. A check
    that cannot run counts the recurrent layers as not exact (their padded rows are then
    not stored); the attention layers as exact (mlx-lm's own batch path for every model)."""
    try:
        verdict = padded_rows_exact(model, vocab_size(model) or 2)
    except Exception as e:  # the batch path itself will tell; store conservatively
        if agree.size > 1:
            raise  # a rank that left a collective early hangs the others: exit instead
        log.warning("mlx_kvcache: could not check mlx-lm's batch path on padded rows (%s); "
                    "recurrent states of padded rows will not be stored", e)
        return True, False
    recurrent = recurrent_kinds(model)
    log.debug("mlx_kvcache: padded batch rows exact, per layer kind: %s", verdict)
    if not all(verdict.values()):
        log.info("mlx_kvcache: padded batch rows exact, per layer kind: %s", verdict)
    return (all(ok for k, ok in verdict.items() if k not in recurrent),
            all(ok for k, ok in verdict.items() if k in recurrent))


def _open_store(st: ModelState, provider, key, agree, cache_dir, max_disk_bytes, sharding,
                cold_bits) -> None:
    mgr = st.manager
    path = key[0] if isinstance(key, tuple) else key
    adapter = key[1] if isinstance(key, tuple) and len(key) > 1 else None
    draft = key[2] if isinstance(key, tuple) and len(key) > 2 else None
    try:
        if path and os.path.isdir(str(path)):  # an export of ours: the chat's identity
            fp = directory_identity(path, adapter, cache_root=cache_dir)
        else:  # a hub id: the loaded weights themselves
            fp = model_fingerprint(provider.model, provider.tokenizer)
        dfp = None
        if getattr(provider, "draft_model", None) is not None:  # nodes hold both models' layers
            if draft and os.path.isdir(str(draft)):
                dfp = directory_fingerprint(draft, cache_root=cache_dir)
            else:
                dfp = model_fingerprint(provider.draft_model)
        # a rank's shard of this plan has its own directory
        fp = cache_key(fp, draft_fp=dfp, sharding=sharding if agree.size > 1 else None,
                       cold_bits=cold_bits,
                       kv_quant=None if mgr.kv_quant is None else mgr.kv_quant.signature())
        default = max_disk_bytes is None
        if default:
            max_disk_bytes, why = sizing.disk_budget_for(cache_dir, fp)
            log.info("mlx_kvcache: prompt cache disk budget %s (--max-disk-bytes; a budget "
                     "already set for this directory is followed instead)", why)
        st.max_disk_bytes = max_disk_bytes
        st.store = PersistentStore(mgr.trie, layer_signature(mgr.ops, mgr.kv_quant), cache_dir,
                                   fp, max_disk_bytes, keep=mgr.keep, agree=agree,
                                   cold_bits=cold_bits, default_budget=default)
    except Exception as e:  # fail-open: the server runs without a disk tier
        log.warning("mlx_kvcache: the prompt cache will not persist: %s", e)
        st.store = None
    if agree.size > 1 and not every(agree, st.store is not None):
        st.store = None  # all ranks persist, or none do
    if st.store is None:
        return
    mgr.attach_disk(st.store.before_request)

    def load():
        n = st.store.load()
        mgr.enforce_budget()
        st.store.purge_bad()
        return n
    n = mgr.run(load)
    st.writer = Autosaver(st.store.write)
    log.info("mlx_kvcache: %d cached tokens (%s) on disk at %s", n,
             human_bytes(st.store.disk_bytes), st.store.directory())
