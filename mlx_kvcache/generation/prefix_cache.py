"""`PrefixCache`: generation on an mlx-lm model that reuses every earlier request's work.

Layer 5 (docs/design.md): an adapter over the composition root (`core.CacheCore`: the
manager, the disk store, the background writer) that drives the model through the
manager — restore, chunked prefill that stops exactly at the planned snapshot offsets,
decode, record (`request`).

Concurrency: any number of requests may be open at once, started, advanced, closed or
abandoned from any threads or event loops, in any order. Each request runs on a live set
of caches it owns (`PrefixManager.checkout`); the trie changes only in short critical
sections; every MLX step runs on the engine thread (`engine`: MLX streams are per-thread),
handed over and waited for, never across a ``yield``. A request abandoned mid-stream
(closed, or garbage collected on any thread) still records what it computed.
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..caches import KVQuantization
from ..prefix.explain import Explainer, Reuse
from ..prefix.manager import Plan
from ..prefix.null import Manager
from ..prefix.stats import CacheStats, RequestStats
from ..store import PersistentStore
from . import request, sizing, validation
from .core import CacheCore, check_cold_bits
from .draft_length import (DraftPolicy, LookupLength, check_policy, draft_length_for,
                           draft_set_aside)
from .engine import default_engine, materialize
from .lookup import DEFAULT_MOST, LookupPlan
from .model_pair import ModelPair
from .request import CachedGenerationResponse

__all__ = ["PrefixCache", "CachedGenerationResponse", "default_prefill_step"]


def default_prefill_step() -> int:
    """Largest prefill chunk: mlx-lm's 2048 on a GPU; 512 on the CPU build, where
    unfused attention over a 2048-token chunk is memory bound (measured on SmolLM2 with
    OpenBLAS: a 2048-token prompt in 18.6 s with 512-token chunks vs 28.8 s)."""
    try:
        gpu = mx.metal.is_available() or mx.cuda.is_available()
    except AttributeError:  # pragma: no cover - older MLX without mx.cuda
        gpu = mx.metal.is_available()
    return 2048 if gpu else 512


_OPEN: "weakref.WeakSet[PrefixCache]" = weakref.WeakSet()


def _check_num_draft(n: Any, name: str = "num_draft_tokens") -> int:
    if not validation.is_int(n):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return int(n)


@atexit.register
def _flush_all() -> None:  # pragma: no cover - runs at interpreter exit
    for pc in list(_OPEN):
        pc.flush(timeout=30)


class PrefixCache:
    """A model and a trie of snapshots reused across requests.

    Args:
        model: an mlx-lm model.
        max_bytes: memory budget for everything the cache holds — snapshots and live
            caches (default: half of what the model's weights leave of the machine's
            memory, at most a quarter of it; ``ram_budget_note`` says the figure).
            Enforced during requests too: a planned snapshot that cannot fit is skipped
            (``RequestStats.snapshots_skipped``). A budget below one checkpoint of the
            model (``budget_warning``) gets one warning with the size needed.
        prefill_step_size: largest prefill chunk, in tokens (default: 2048 on a GPU,
            512 on MLX's CPU build, where attention over smaller chunks is ~1.5x faster).
        pre_end_margin, snapshot_interval: where hybrid / sliding-window models take
            extra snapshots (see `PrefixManager`).
        keep_live: keep the last request's caches for a copy-free next turn (see
            `PrefixManager`; costs that conversation's cache memory, within ``max_bytes``).
        cache_dir: keep a disk tier under this directory (`mlx_kvcache.store`): load it
            now, write each new snapshot once in the background after its request; the
            memory budget then parks nodes that are on disk instead of dropping them, and
            a request that needs them reads them back (``RequestStats.disk_tokens``).
        max_disk_bytes: disk budget for this model's cache directory (default: a quarter
            of the free disk, at most 32 GiB; ``disk_budget_note`` says the figure).
        cold_bits: write KV snapshots to disk compressed to 8 or 4 bits (lossy, so off by
            default: answers restored from disk may differ slightly from a cold run;
            sliding-window and recurrent states stay exact). Such a cache has its own
            directory: an exact cache never serves compressed snapshots.
        tokenizer: included in the model fingerprint that keys the persisted cache.
        kv_bits, kv_group_size, quantized_kv_start: quantized KV for full-attention layers,
            as in mlx-lm's ``generate`` (None: off). The switch is canonical: rows before
            ``quantized_kv_start`` are computed unquantized, the cache converts exactly when
            it reaches that offset, every later row is quantized — so answers never depend
            on chunking or on where a restore landed (`KVQuantization`). Fixed for the
            instance: the trie holds one set of rows per node, and rows computed under one
            schedule are not valid under another.
        draft_model: a draft model for speculative decoding (same tokenizer). It is bound
            here because the trie holds its layers too: every node stores the target's
            and the draft's snapshots together, so a hit skips prefill on both; the
            budget counts both; the persisted cache is keyed on both fingerprints. Every
            request is then speculative (``num_draft_tokens=0`` drafts nothing).
        num_draft_tokens: the most tokens the draft proposes per round (default 3, as
            mlx-lm's ``--num-draft-tokens``); a request may pass its own.
        draft_policy: ``"adaptive"`` (default): each round drafts as many of those as pay
            for themselves — none while the draft costs too much for how often the target
            accepts it, so a poor draft costs little more than no draft (`DraftLength`);
            a draft that could never pay (one as large as the target) is set aside with a
            warning: not run, its layers not cached (`draft_set_aside` says why);
            ``"fixed"``: ``num_draft_tokens`` every round, as mlx-lm (and no prompt lookup
            beside it). Answers are the same either way.
        prompt_lookup: decode with prompt lookup (default on): proposals copied from the
            request's own tokens where its answer repeats them, verified by the model in
            one pass (`lookup`, `speculative`) — greedy answers are token for token those
            without it, sampled ones keep the model's distribution; where nothing is
            copied each round is a plain step. With a draft model, each round takes the
            better proposal. False: plain decoding. Sampling with a seed (`seed`) gives
            the same answers every time only without it: a round draws its samples
            together, as many as it verifies, and how many is timed.
        prompt_lookup_num_tokens: the most tokens a round verifies (default 10; fewer
            where they would not pay: `LookupLength`); a request may pass its own (0: off
            for that request).

    Safe for concurrent use; see the module docstring.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_bytes: Optional[int] = None,
        prefill_step_size: Optional[int] = None,
        pre_end_margin: int = 4,
        snapshot_interval: int = 2048,
        keep_live: bool = False,
        cache_dir: Optional[str] = None,
        max_disk_bytes: Optional[int] = None,
        tokenizer: Any = None,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 5000,
        draft_model: Optional[nn.Module] = None,
        num_draft_tokens: int = 3,
        draft_policy: DraftPolicy = "adaptive",
        cold_bits: Optional[int] = None,
        prompt_lookup: bool = True,
        prompt_lookup_num_tokens: int = DEFAULT_MOST,
    ) -> None:
        if cache_dir is not None and not str(cache_dir).strip():
            raise ValueError("cache_dir is empty: pass a directory path, or None for no persistence")
        self.cold_bits = check_cold_bits(cold_bits)
        check_policy(draft_policy)
        if self.cold_bits is not None and cache_dir is None:
            raise ValueError("cold_bits compresses what is written to disk: give cache_dir "
                             "too, or no cold_bits")
        if max_disk_bytes is not None:
            if not validation.is_int(max_disk_bytes):
                raise TypeError(f"max_disk_bytes must be an int, got "
                                f"{type(max_disk_bytes).__name__} {max_disk_bytes!r}")
            if max_disk_bytes < 0:
                raise ValueError(f"max_disk_bytes must be >= 0 (or None for the default), "
                                 f"got {max_disk_bytes}")
        #: The target and the draft model in use (`ModelPair`): one cache list holds both.
        self.pair = ModelPair(model, draft_model)  # (checks the pair even if set aside below)
        #: The ``kv_bits`` schedule (None: full precision); raises ValueError when invalid.
        self.kv_quant = KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start)
        self.prefill_step_size = validation.check_positive(
            "prefill_step_size",
            default_prefill_step() if prefill_step_size is None else prefill_step_size)
        self.num_draft_tokens = _check_num_draft(num_draft_tokens)
        if not isinstance(prompt_lookup, bool):
            raise TypeError(f"prompt_lookup must be a bool, got {type(prompt_lookup).__name__} "
                            f"{prompt_lookup!r}")
        most = _check_num_draft(prompt_lookup_num_tokens, "prompt_lookup_num_tokens")
        #: Prompt lookup as requests use it (None: off); its policy learns from every
        #: request of this cache.
        self.lookup: Optional[LookupPlan] = LookupPlan(most, LookupLength()) if prompt_lookup \
            else None
        #: Why the draft model is not used (None: it is, or none was given).
        self.draft_set_aside: Optional[str] = draft_set_aside(draft_policy, model, draft_model)
        self._given_draft = draft_model  # still accepted by `stream_generate` once set aside
        if self.draft_set_aside is not None:
            warnings.warn(f"mlx_kvcache: the draft model is not used: {self.draft_set_aside} "
                          f"(draft_policy='fixed' drafts with it anyway)", RuntimeWarning,
                          stacklevel=2)
            draft_model = None
            self.pair = ModelPair(model, None)
        self.model, self.draft_model = model, draft_model
        #: How the default memory budget was chosen (None when ``max_bytes`` was given).
        self.ram_budget_note: Optional[str] = None
        if max_bytes is None:
            budget, self.ram_budget_note = sizing.default_ram_budget(
                sizing.model_bytes(model, draft_model))
        else:
            budget = int(max_bytes)
        #: Each round's draft length (None: ``num_draft_tokens`` every round).
        self.draft_length = draft_length_for(draft_policy, model, draft_model)
        materialize(model)  # the engine thread cannot evaluate arrays left lazy here
        if draft_model is not None:
            materialize(draft_model)
        self._engine = default_engine()
        self._stats_lock = threading.Lock()
        self._stats = CacheStats(max_bytes=budget)
        self.last_request: Optional[RequestStats] = None
        self._explainer = Explainer()
        self._clears = 0
        #: The target's vocabulary (a wider draft never proposes past it), and the draft's
        #: when it is smaller (`ModelPair`).
        self.vocab_size = self.target_vocab = self.pair.vocab
        self.draft_vocab = self.pair.draft_vocab
        #: Top-level cache entries of the target: a live set holds them, then the draft's.
        self.target_entries = self.pair.target_entries
        #: The composition root: manager, disk store, background writer, fingerprint.
        self.core = CacheCore(self.pair, max_bytes=budget, kv_quant=self.kv_quant,
                              pre_end_margin=pre_end_margin, snapshot_interval=snapshot_interval,
                              keep_live=keep_live, executor=self._engine.run,
                              cold_bits=self.cold_bits, tokenizer=tokenizer)
        #: Why this model's caches cannot be reused (None: they can).
        self.unsupported: Optional[str] = self.core.why_not
        if self.unsupported is not None:
            warnings.warn(f"mlx_kvcache: this model's caches cannot be reused ({self.unsupported}); "
                          f"every request will recompute its whole prompt", RuntimeWarning,
                          stacklevel=2)
        #: The warning about a budget below one checkpoint of the model (None: it fits).
        self.budget_warning: Optional[str] = self.core.budget_problem(snapshot_interval)
        if self.budget_warning:
            warnings.warn(f"mlx_kvcache: {self.budget_warning}", RuntimeWarning, stacklevel=2)
        self._open_disk(cache_dir, max_disk_bytes)
        if self.core.autosaver is not None:
            _OPEN.add(self)

    def _open_disk(self, cache_dir: Optional[str], max_disk_bytes: Optional[int]) -> None:
        #: How the default disk budget was chosen (None when given, or no ``cache_dir``).
        self.disk_budget_note: Optional[str] = None
        self.max_disk_bytes = max_disk_bytes
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        if self.cache_dir is None or self.unsupported is not None:
            return  # (caching off: no disk tier for what is never stored)
        try:
            self.core.attach_store(self.cache_dir, max_disk_bytes, default=True)
        except Exception as e:  # fail-open: a cache problem never stops the model
            warnings.warn(f"mlx_kvcache: could not load the prefix cache from "
                          f"{self.cache_dir}: {e}", RuntimeWarning, stacklevel=3)
        finally:
            self.disk_budget_note = self.core.disk_budget_note
            if self.core.disk_budget_note is not None:
                self.max_disk_bytes = self.core.max_disk_bytes

    # -- what it holds ------------------------------------------------------------------
    @property
    def manager(self) -> Manager:
        """The trie and live sets (a `NullManager`, which stores nothing, when this
        model's caches cannot be reused: ``unsupported`` says why)."""
        return self.core.manager

    @property
    def store(self) -> Optional[PersistentStore]:
        """The disk tier (None without ``cache_dir``, `save` or `load`)."""
        return self.core.store

    @property
    def nbytes(self) -> int:
        """Everything the cache holds: snapshots plus live caches (what ``max_bytes`` bounds)."""
        return self.manager.peek(lambda: self.manager.nbytes)

    @property
    def stats(self) -> CacheStats:
        """Totals over every request served, and what the cache holds now."""
        with self._stats_lock:
            s = CacheStats(**vars(self._stats))
        mgr = self.manager

        def read():
            s.snapshot_bytes, s.live_bytes = mgr.snapshot_bytes, mgr.live_bytes
            s.nodes, s.disk_nodes = mgr.trie.node_count, mgr.trie.parked_count
            s.evicted_bytes = mgr.evicted_bytes
        mgr.peek(read)
        st = self.store
        if st is not None:
            # the directory's budget in force (one per directory, shared by every process)
            s.disk_bytes, s.max_disk_bytes = st.disk_bytes, st.max_disk_bytes
            s.demoted_bytes, s.promoted_bytes = st.tier.demoted_bytes, st.tier.promoted_bytes
        s.bytes_held = s.snapshot_bytes + s.live_bytes
        return s

    def explain(self, tokenizer: Any, tokens: Sequence[int], plan: Plan) -> Optional[Reuse]:
        """Where a request's reuse stops and why (`RequestStats.reuse`); None when it
        cannot be told (an explanation never fails a request)."""
        mgr = self.manager
        decode = getattr(tokenizer, "decode", None)
        try:
            return mgr.peek(lambda: self._explainer.explain(
                mgr.trie, tokens, plan.matched, plan.restored, plan.reason, mgr.ops,
                mgr.evicted_bytes, self._clears, decode=decode))
        except Exception:  # an explanation never fails a request
            return None

    def account(self, st: RequestStats, stored: Optional[Sequence[int]] = None) -> None:
        """A request ended: add its stats to the totals, remember what it ``stored`` (the
        tokens recorded, for later miss explanations) and hand the trie's changes to the
        background writer. Inside the manager's critical section (its ``on_done``)."""
        if stored is not None:
            self._explainer.remember(stored, self.manager.evicted_bytes, self._clears)
        st.cache_bytes = self.manager.nbytes
        with self._stats_lock:
            self._stats.add(st)
        self.core.autosave()

    # -- generation -----------------------------------------------------------------------
    def stream_generate(
        self,
        tokenizer: Union[TokenizerWrapper, Any],
        prompt: Union[str, mx.array, Sequence[int]],
        max_tokens: int = 256,
        *,
        sampler: Optional[Callable[[mx.array], mx.array]] = None,
        logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
        prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
        snapshot_at: Sequence[int] = (),
        draft_model: Optional[nn.Module] = None,
        num_draft_tokens: Optional[int] = None,
        prompt_lookup_num_tokens: Optional[int] = None,
        **kwargs,
    ) -> Iterator[CachedGenerationResponse]:
        """Like `mlx_lm.stream_generate`, reusing cached prefixes of ``prompt``.

        Each response also carries ``cache``, the request's `RequestStats`.
        ``prompt_progress_callback(done, total)`` is called after each prefill chunk.
        ``snapshot_at`` adds prompt offsets to snapshot at (e.g. chat message boundaries),
        so a later prompt that diverges there restores exactly on any model.

        Speculative decoding uses the draft model given to the constructor (the trie holds
        its layers; none once set aside: `draft_set_aside`); ``draft_model``, if passed,
        must be that model. ``num_draft_tokens``
        overrides the instance's default for this request, and so does
        ``prompt_lookup_num_tokens`` for prompt lookup (0: off for this request; ignored
        when the instance has it off). Every cache kind works (recurrent and
        sliding-window layers roll back from snapshots); greedy output is the output
        without proposals; ``from_draft`` says which tokens were proposed (by the draft
        or by lookup) and accepted; ``cache`` counts them.

        Arguments are checked here, before anything runs: bad ones raise ``TypeError`` /
        ``ValueError`` naming the problem.
        """
        if kwargs.pop("prompt_cache", None) is not None:
            raise ValueError("PrefixCache manages the prompt cache itself; do not pass prompt_cache")
        # Per request, as in mlx-lm: it must not change the instance's default.
        step = kwargs.pop("prefill_step_size", None)
        chunk = self.prefill_step_size if step is None else validation.check_positive(
            "prefill_step_size", step)
        self._check_kv_kwargs(kwargs)
        if kwargs:
            raise TypeError(f"unsupported arguments: {sorted(kwargs)}")
        if draft_model is not None and draft_model is not self._given_draft:
            raise ValueError(
                "draft_model must be the draft model this PrefixCache was built with (its trie "
                "holds that model's layers): construct PrefixCache(model, draft_model=...)"
                if self._given_draft is None else
                "draft_model is not the draft model this PrefixCache was built with (its trie "
                "holds that model's layers); use another PrefixCache for another draft model")
        k = self.num_draft_tokens if num_draft_tokens is None else _check_num_draft(num_draft_tokens)
        lookup = self.lookup
        if prompt_lookup_num_tokens is not None:
            most = _check_num_draft(prompt_lookup_num_tokens, "prompt_lookup_num_tokens")
            lookup = None if lookup is None else lookup.with_most(most)
        max_tokens = validation.check_max_tokens(max_tokens)
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        tokens = validation.prompt_token_ids(tokenizer, prompt, self.vocab_size)
        stops = []
        for s in snapshot_at:
            if not validation.is_int(s):
                raise TypeError(f"snapshot_at offsets must be ints, got {type(s).__name__} {s!r}")
            stops.append(int(s))
        self._prefetch(tokens)  # files of parked nodes start loading now
        return request.run(self, tokenizer, tokens, max_tokens, sampler,
                           list(logits_processors or []), prompt_progress_callback, stops, chunk,
                           num_draft=k, draft_length=self.draft_length, lookup=lookup)

    def _check_kv_kwargs(self, kwargs: dict) -> None:
        """mlx-lm's per-call ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start`` are
        accepted when they restate the instance's schedule (removed from ``kwargs``)."""
        names = ("kv_bits", "kv_group_size", "quantized_kv_start")
        if not any(k in kwargs for k in names):
            return
        q = self.kv_quant
        mine = dict(zip(names, (None, 64, 5000) if q is None else (q.bits, q.group_size, q.start)))
        asked = {k: kwargs.pop(k, mine[k]) for k in names}
        if asked["kv_bits"] is None and q is None:
            return
        if asked != mine:
            raise ValueError(f"this PrefixCache quantizes KV with {mine}; a request asked for "
                             f"{asked}. The schedule is fixed per PrefixCache (its trie holds "
                             f"rows of one schedule): construct one with those arguments")

    def generate(self, tokenizer, prompt, max_tokens: int = 256, **kwargs) -> str:
        """The whole generated text of `stream_generate`."""
        return "".join(r.text for r in self.stream_generate(tokenizer, prompt, max_tokens, **kwargs))

    @property
    def engine(self):
        """The thread every MLX step of this cache's requests runs on (`engine.Engine`)."""
        return self._engine

    def seed(self, value: int) -> None:
        """Seed the random sampling of requests (MLX keys are per thread, and requests
        sample on the engine thread, so ``mx.random.seed`` in the caller has no effect)."""
        self._engine.run(mx.random.seed, int(value))

    # -- persistence -------------------------------------------------------------------
    def fingerprint(self) -> str:
        """`mlx_kvcache.store.model_fingerprint` of the model (computed once); with a draft
        model, a hash of both models' fingerprints; with ``cold_bits`` or ``kv_bits``, of
        those too (`mlx_kvcache.store.cache_key`)."""
        return self.core.fingerprint()

    @property
    def cache_path(self):
        """The directory this model's persisted cache lives in (None without ``cache_dir``)."""
        return None if self.store is None else self.store.directory()

    def _store_at(self, path) -> PersistentStore:
        if self.store is None and path is None:
            raise ValueError("no cache directory: pass a path or construct with cache_dir")
        return self.core.open_store(path, self.max_disk_bytes)

    def _prefetch(self, tokens) -> None:
        """Start reading the files of parked nodes ``tokens`` will restore (any thread)."""
        store, mgr = self.store, self.manager
        if store is not None:
            mgr.peek(store.prefetch, tokens)

    def save(self, path: Optional[str] = None) -> int:
        """Write the cache under ``path`` (default: ``cache_dir``) now; returns bytes on disk.

        Incremental: snapshots already on disk are not rewritten. Raises ``OSError``
        when the directory cannot be written. 0 when caching is off (``unsupported``).
        """
        if self.unsupported is not None:
            return 0
        store = self._store_at(path)
        return store.write(*self.manager.run(store.capture, path))

    def load(self, path: Optional[str] = None) -> int:
        """Merge the cache saved under ``path`` (default: ``cache_dir``) into the trie.

        Returns the number of cached tokens loaded (on disk; read when first needed).
        Fail-open: a missing, damaged, other-model or other-version cache gives one
        warning and loads nothing; 0 when caching is off (``unsupported``).
        """
        if self.unsupported is not None:
            return 0
        self._store_at(path)
        return self.core.load(path)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the background saves asked for so far are on disk (False on timeout)."""
        return self.core.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background saves (every request asks for one), retrying once if the
        last failed; later requests are no longer saved. Idempotent."""
        self.core.close(timeout)
        _OPEN.discard(self)

    def clear(self) -> None:
        """Drop every snapshot and the idle live state. Requests running now still answer
        correctly (they own their caches) but record nothing."""
        self.manager.clear()
        self._clears += 1
