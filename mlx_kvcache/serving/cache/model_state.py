"""The trie (and disk store) of the model mlx-lm's server has loaded: its `CacheCore`.

Made in the generation thread when the model loads. The served model's (the first one
opened: the ``--model``) is kept while a request has mlx-lm load another model
(`ModelStates`): switching back finds its cached prompts as they were — mlx-lm's provider
holds one model at a time and unloads the served one's weights meanwhile; another model's
trie is closed (its writes flushed) when the next switch comes. On the ranks of a sharded model every
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
from typing import Any, Callable, List, Optional, Tuple

from ...caches import CacheError, KVQuantization
from ...generation import sizing
from ...generation.core import CacheCore
from ...generation.model_pair import ModelPair, vocab_size
from ...prefix.agreement import Agreement, any_rank, every
from ...prefix.manager import PrefixManager
from ...prefix.stats import human_bytes
from ...store import PersistentStore, directory_fingerprint, directory_identity, model_fingerprint
from ...store.autosave import Autosaver
from .padding import padded_rows_exact, recurrent_kinds

log = logging.getLogger("mlx_kvcache")


@dataclass
class ModelState:
    """The server's view of one loaded model: its `CacheCore` and what only the server
    needs beside it."""

    key: Any
    core: CacheCore
    #: mlx-lm's batch path is not exact for this model's padded recurrent rows: hand out
    #: `TrackedArraysCache` and store no padded row (`serving.padding`).
    track_padding: bool = False

    @property
    def manager(self) -> Optional[PrefixManager]:
        return self.core.manager

    @property
    def store(self) -> Optional[PersistentStore]:
        return self.core.store

    @property
    def writer(self) -> Optional[Autosaver]:
        return self.core.autosaver

    @property
    def why_not(self) -> Optional[str]:
        return self.core.why_not

    @property
    def max_bytes(self) -> int:
        """The memory budget in force (its default follows the model)."""
        return self.core.max_bytes

    @property
    def pair(self) -> ModelPair:
        return self.core.pair


class ModelStates:
    """The `ModelState` of the model loaded now, and the served model's, kept while
    another is loaded (see the module doc). Generation thread only."""

    def __init__(self) -> None:
        self.served: Optional[ModelState] = None
        self.current: Optional[ModelState] = None

    def switch(self, provider, key, open_state: Callable[[Any], ModelState],
               close_state: Callable[[ModelState], None]) -> ModelState:
        """The state of the model ``provider`` has just loaded under ``key``: the current
        one, the served one kept (its budget given back to mlx-lm), or one opened with
        ``open_state`` — the first one opened is the served model's. A current state
        other than the served one is closed with ``close_state`` first."""
        cur = self.current
        if cur is not None and cur.key == key:
            return cur
        if cur is not None and cur is not self.served:
            self.current = None
            close_state(cur)
        if self.served is not None and self.served.key == key:
            self.current = self.served
            _share_budget(provider, self.served.max_bytes)
        else:
            self.current = open_state(key)
            if self.served is None:
                self.served = self.current
        return self.current

    def held(self) -> List[ModelState]:
        """Every state held: the current one first, then the served one when it is kept
        while another model is loaded."""
        out = [st for st in (self.current, self.served) if st is not None]
        return out[:1] if len(out) == 2 and out[0] is out[1] else out


def open_model(provider, key, agree: Agreement, *, max_bytes: Optional[int],
               checkpoint_interval: int, pre_end_margin: int, cache_dir: Optional[str],
               max_disk_bytes: Optional[int], sharding: str = "",
               cold_bits: Optional[int] = None) -> ModelState:
    """The state for the model ``provider`` just loaded under ``key``. ``max_bytes`` /
    ``max_disk_bytes`` None: the defaults (`generation.sizing`), said in the log."""
    model = provider.model
    pair = ModelPair(model, getattr(provider, "draft_model", None))
    if max_bytes is None:
        max_bytes, why = sizing.default_ram_budget(sizing.model_bytes(model, pair.draft))
        log.info("mlx_kvcache: prompt cache memory budget %s (--prompt-cache-bytes)", why)
    _share_budget(provider, max_bytes)
    quant, off = None, None
    try:
        quant = _quantization(getattr(provider, "cli_args", None))
    except CacheError as e:
        off = str(e)
    core = CacheCore(pair, max_bytes=max_bytes, kv_quant=quant, pre_end_margin=pre_end_margin,
                     snapshot_interval=checkpoint_interval, agree=agree,
                     defer_budget=agree.size > 1, off=off, cold_bits=cold_bits,
                     identify=lambda: _identity(provider, key, cache_dir), sharding=sharding)
    track = False
    # Only models with recurrent layers are checked (attention masks its padding; that is
    # mlx-lm's batch path for every model). The forward passes involve every rank.
    if core.why_not is None and every(agree, bool(getattr(provider, "is_batchable", False))) \
            and any_rank(agree, bool(recurrent_kinds(model))):
        attention_ok, recurrent_ok = _padding_exact(model, agree)
        if not every(agree, attention_ok):
            core.turn_off("mlx-lm's batch path does not compute exact attention caches for "
                          "padded rows of this model")
        track = not every(agree, recurrent_ok)
    st = ModelState(key, core, track_padding=track)
    if core.why_not is not None:
        log.warning("mlx_kvcache: prompt caching is off for this model: %s", core.why_not)
        return st
    problem = core.budget_problem(checkpoint_interval)
    if problem:
        log.warning("mlx_kvcache: %s (--prompt-cache-bytes)", problem)
    if track:
        log.info("mlx_kvcache: mlx-lm's batch path computes wrong recurrent states for "
                 "padded rows of this model: states of requests batched with longer ones "
                 "are not stored")
    if cache_dir is not None:
        _open_store(st, cache_dir, max_disk_bytes)
    return st


def _share_budget(provider, max_bytes: int) -> None:
    """Give mlx-lm the budget in force as its ``--prompt-cache-bytes``: its batch loop
    then asks the cache (`TriePromptCache.trim_to`) to hold at most the budget less the
    running batch's caches, after every request it adds — so the budget bounds snapshots
    plus running requests' caches, as in `PrefixCache` (docs/design.md, "The memory
    budget"). With the default budget mlx-lm would not ask at all."""
    args = getattr(provider, "cli_args", None)
    if args is not None:
        args.prompt_cache_bytes = int(max_bytes)


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


def _identity(provider, key, cache_dir) -> Tuple[str, Optional[str]]:
    """The identities the persisted cache is keyed by: an export of ours is keyed as the
    chat keys it, a directory by its files, a hub id by the loaded weights; with a draft
    model, the draft's too (nodes hold both models' layers)."""
    path = key[0] if isinstance(key, tuple) else key
    adapter = key[1] if isinstance(key, tuple) and len(key) > 1 else None
    draft = key[2] if isinstance(key, tuple) and len(key) > 2 else None
    if path and os.path.isdir(str(path)):  # an export of ours: the chat's identity
        fp = directory_identity(path, adapter, cache_root=cache_dir)
    else:  # a hub id: the loaded weights themselves
        fp = model_fingerprint(provider.model, provider.tokenizer)
    dfp = None
    if getattr(provider, "draft_model", None) is not None:
        if draft and os.path.isdir(str(draft)):
            dfp = directory_fingerprint(draft, cache_root=cache_dir)
        else:
            dfp = model_fingerprint(provider.draft_model)
    return fp, dfp


def _open_store(st: ModelState, cache_dir, max_disk_bytes) -> None:
    """Attach the disk tier (fail-open: the server runs without one; on a sharded model
    all ranks persist, or none do)."""
    core = st.core
    try:
        core.open_store(cache_dir, max_disk_bytes, default=True)
    except Exception as e:  # fail-open: the server runs without a disk tier
        log.warning("mlx_kvcache: the prompt cache will not persist: %s", e)
        return
    finally:
        if core.disk_budget_note is not None:
            log.info("mlx_kvcache: prompt cache disk budget %s (--max-disk-bytes; a budget "
                     "already set for this directory is followed instead)", core.disk_budget_note)
    n = core.attach_store(cache_dir)
    log.info("mlx_kvcache: %d cached tokens (%s) on disk at %s", n,
             human_bytes(core.store.disk_bytes), core.store.directory())
