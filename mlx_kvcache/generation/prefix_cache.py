"""`PrefixCache`: generation on an mlx-lm model that reuses every earlier request's work.

Layer 5 (docs/design.md): drives the model through the manager — restore, chunked
prefill that stops exactly at the planned snapshot offsets, decode, record — and keeps
the trie on disk through the store.

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

from ..caches import CacheError, KVQuantization, make_prompt_cache
from ..prefix.explain import Explainer
from ..prefix.manager import PrefixManager
from ..prefix.stats import CacheStats, RequestStats
from . import request, sizing, validation
from .engine import default_engine, materialize
from .persistence import Persistence, check_cold_bits
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


def _check_num_draft(n: Any) -> int:
    if not validation.is_int(n):
        raise TypeError(f"num_draft_tokens must be an int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {n}")
    return int(n)


@atexit.register
def _flush_all() -> None:  # pragma: no cover - runs at interpreter exit
    for pc in list(_OPEN):
        pc.flush(timeout=30)


class PrefixCache(Persistence):
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
        num_draft_tokens: tokens the draft proposes per round (default 3, as mlx-lm's
            ``--num-draft-tokens``); a request may pass its own.

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
        cold_bits: Optional[int] = None,
    ) -> None:
        if cache_dir is not None and not str(cache_dir).strip():
            raise ValueError("cache_dir is empty: pass a directory path, or None for no persistence")
        self.cold_bits = check_cold_bits(cold_bits)
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
        self.model = model
        #: The ``kv_bits`` schedule (None: full precision); raises ValueError when invalid.
        self.kv_quant = KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start)
        self.prefill_step_size = validation.check_positive(
            "prefill_step_size",
            default_prefill_step() if prefill_step_size is None else prefill_step_size)
        #: How the default memory budget was chosen (None when ``max_bytes`` was given).
        self.ram_budget_note: Optional[str] = None
        if max_bytes is None:
            budget, self.ram_budget_note = sizing.default_ram_budget(
                sizing.model_bytes(model, draft_model))
        else:
            budget = int(max_bytes)
        if draft_model is not None and draft_model is model:
            raise ValueError("draft_model is the target model itself: pass a separate (smaller) "
                             "model, or no draft model")
        self.draft_model = draft_model
        self.num_draft_tokens = _check_num_draft(num_draft_tokens)
        materialize(model)  # the engine thread cannot evaluate arrays left lazy here
        if draft_model is not None:
            materialize(draft_model)
        self._engine = default_engine()
        self._stats_lock = threading.Lock()
        self._stats = CacheStats(max_bytes=budget)
        self.last_request: Optional[RequestStats] = None
        self._explainer = Explainer()
        self._clears = 0
        self.vocab_size = validation.model_vocab_size(model)
        #: The target's vocabulary (a wider draft never proposes past it), and the draft's
        #: when it is smaller: ids the draft lacks are fed to it clamped (it only proposes;
        #: MLX does not bound-check an embedding lookup).
        self.target_vocab, self.draft_vocab = self.vocab_size, None
        if draft_model is not None:
            dv = validation.model_vocab_size(draft_model)
            if dv is not None and (self.vocab_size is None or dv < self.vocab_size):
                self.draft_vocab = dv
        try:
            #: Top-level cache entries of the target: a live set holds them, then the draft's.
            self.target_entries = len(make_prompt_cache(model))

            def make_caches():
                caches = make_prompt_cache(model)
                return caches if draft_model is None else caches + make_prompt_cache(draft_model)
            make_caches()
            self.manager: Optional[PrefixManager] = PrefixManager(
                make_caches, max_bytes=budget, pre_end_margin=pre_end_margin,
                snapshot_interval=snapshot_interval, keep_live=keep_live,
                executor=self._engine.run, kv_quant=self.kv_quant)
            self.unsupported: Optional[str] = None
        except CacheError as e:
            self.manager = None
            self.unsupported = str(e)
            warnings.warn(f"mlx_kvcache: this model's caches cannot be reused ({e}); every "
                          f"request will recompute its whole prompt", RuntimeWarning, stacklevel=2)
        self._tokenizer_for_fp = tokenizer
        #: The warning about a budget below one checkpoint of the model (None: it fits).
        self.budget_warning: Optional[str] = None
        if self.manager is not None:
            self._check_budget(budget, snapshot_interval)
        self._open_disk(cache_dir, max_disk_bytes)
        if self._autosaver is not None:
            _OPEN.add(self)

    def _check_budget(self, budget: int, interval: int) -> None:
        tokens = max(1, min(int(interval), 2048) if interval > 0 else 2048)
        try:
            one = self._engine.run(lambda: sum(
                sizing.checkpoint_bytes(m, lambda m=m: make_prompt_cache(m), tokens)
                for m in (self.model, self.draft_model) if m is not None))
        except Exception:  # noqa: BLE001 - a model that cannot take one token: no advice
            return
        self.budget_warning = sizing.budget_problem(budget, one, tokens, live_counted=True)
        if self.budget_warning:
            warnings.warn(f"mlx_kvcache: {self.budget_warning}", RuntimeWarning, stacklevel=3)

    # -- what it holds ------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Everything the cache holds: snapshots plus live caches (what ``max_bytes`` bounds)."""
        return self.manager.peek(lambda: self.manager.nbytes) if self.manager else 0

    @property
    def stats(self) -> CacheStats:
        """Totals over every request served, and what the cache holds now."""
        with self._stats_lock:
            s = CacheStats(**vars(self._stats))
        mgr = self.manager
        if mgr is not None:
            def read():
                s.snapshot_bytes, s.live_bytes = mgr.snapshot_bytes, mgr.live_bytes
                s.nodes, s.disk_nodes = mgr.trie.node_count, mgr.trie.parked_count
                s.evicted_bytes = mgr.evicted_bytes
            mgr.peek(read)
        st = self._store
        if st is not None:
            # the directory's budget in force (one per directory, shared by every process)
            s.disk_bytes, s.max_disk_bytes = st.disk_bytes, st.max_disk_bytes
            s.demoted_bytes, s.promoted_bytes = st.tier.demoted_bytes, st.tier.promoted_bytes
        s.bytes_held = s.snapshot_bytes + s.live_bytes
        return s

    def _explain(self, tokenizer, tokens, plan):
        """Where a request's reuse stops and why (`RequestStats.reuse`)."""
        mgr = self.manager
        decode = getattr(tokenizer, "decode", None)
        try:
            return mgr.peek(lambda: self._explainer.explain(
                mgr.trie, tokens, plan.matched, plan.restored, plan.reason, mgr.ops,
                mgr.evicted_bytes, self._clears, decode=decode))
        except Exception:  # an explanation never fails a request
            return None

    def _account(self, st: RequestStats, stored: Optional[Sequence[int]] = None) -> None:
        # Called once per request when it ends (inside the manager's critical section).
        if stored is not None and self.manager is not None:
            self._explainer.remember(stored, self.manager.evicted_bytes, self._clears)
        st.cache_bytes = self.manager.nbytes if self.manager else 0
        with self._stats_lock:
            self._stats.add(st)
        if self._autosaver is not None:
            try:
                plan = self._store.capture()
            except Exception as e:  # never break the request that just ended
                self._autosaver.failed(e)
            else:
                self._autosaver.submit(plan)

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
        **kwargs,
    ) -> Iterator[CachedGenerationResponse]:
        """Like `mlx_lm.stream_generate`, reusing cached prefixes of ``prompt``.

        Each response also carries ``cache``, the request's `RequestStats`.
        ``prompt_progress_callback(done, total)`` is called after each prefill chunk.
        ``snapshot_at`` adds prompt offsets to snapshot at (e.g. chat message boundaries),
        so a later prompt that diverges there restores exactly on any model.

        Speculative decoding uses the draft model given to the constructor (the trie holds
        its layers); ``draft_model``, if passed, must be that model. ``num_draft_tokens``
        overrides the instance's default for this request. Every cache kind works
        (recurrent and sliding-window layers roll back from snapshots); greedy output is
        the output without a draft; ``from_draft`` says which tokens the draft proposed.

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
        if draft_model is not None and draft_model is not self.draft_model:
            raise ValueError(
                "draft_model must be the draft model this PrefixCache was built with (its trie "
                "holds that model's layers): construct PrefixCache(model, draft_model=...)"
                if self.draft_model is None else
                "draft_model is not the draft model this PrefixCache was built with (its trie "
                "holds that model's layers); use another PrefixCache for another draft model")
        k = self.num_draft_tokens if num_draft_tokens is None else _check_num_draft(num_draft_tokens)
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
                           num_draft=k)

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

    def seed(self, value: int) -> None:
        """Seed the random sampling of requests (MLX keys are per thread, and requests
        sample on the engine thread, so ``mx.random.seed`` in the caller has no effect)."""
        self._engine.run(mx.random.seed, int(value))

    # -- persistence: `Persistence` (fingerprint, save, load, flush, close) ----------------
    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background saves (every request asks for one), retrying once if the
        last failed; later requests are no longer saved. Idempotent."""
        Persistence.close(self, timeout)
        _OPEN.discard(self)

    def clear(self) -> None:
        """Drop every snapshot and the idle live state. Requests running now still answer
        correctly (they own their caches) but record nothing."""
        if self.manager:
            self.manager.clear()
            self._clears += 1
