"""`PrefixCache`: generation on an mlx-lm model that reuses every earlier request's work.

Layer 5 (docs/design.md): drives the model through the manager — restore, chunked prefill
that stops exactly at the planned snapshot offsets, decode, record.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import cache as mlc
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..caches import CacheError, layer_signature, leaf_caches, make_prompt_cache, settle
from ..prefix.manager import PrefixManager, default_max_bytes
from ..prefix.stats import CacheStats, RequestStats


@dataclass
class CachedGenerationResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse` plus the request's cache facts."""

    cache: Optional[RequestStats] = None


def default_prefill_step() -> int:
    """Largest prefill chunk: mlx-lm's 2048 on a GPU; 512 on the CPU build, where
    unfused attention over a 2048-token chunk is memory bound (measured on SmolLM2 with
    OpenBLAS: a 2048-token prompt in 18.6 s with 512-token chunks vs 28.8 s)."""
    try:
        gpu = mx.metal.is_available() or mx.cuda.is_available()
    except AttributeError:  # pragma: no cover - older MLX without mx.cuda
        gpu = mx.metal.is_available()
    return 2048 if gpu else 512


def _eval_caches(leaves) -> None:
    arrays = []
    for c in leaves:
        if isinstance(c, mlc.ArraysCache):
            arrays.extend(x for x in c.cache if x is not None)
        elif c.keys is not None:
            arrays.extend((c.keys, c.values))
    mx.eval(arrays)


class PrefixCache:
    """A model, its live caches, and a trie of snapshots reused across requests.

    Args:
        model: an mlx-lm model.
        max_bytes: budget for the snapshots the trie holds (default: 20% of memory).
        prefill_step_size: largest prefill chunk, in tokens (default: 2048 on a GPU,
            512 on MLX's CPU build, where attention over smaller chunks is ~1.5x faster).
        pre_end_margin, snapshot_interval: where hybrid / sliding-window models take
            extra snapshots (see `PrefixManager`).
        cache_dir: persist the trie under this directory (`mlx_kvcache.store`): load
            it now, save it after every request and on `close()`.
        max_disk_bytes: disk budget for this model's persisted cache (None: no limit).
        tokenizer: included in the model fingerprint that keys the persisted cache.

    Thread-safe: requests from several threads run one at a time on the model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_bytes: Optional[int] = None,
        prefill_step_size: Optional[int] = None,
        pre_end_margin: int = 4,
        snapshot_interval: int = 2048,
        cache_dir: Optional[str] = None,
        max_disk_bytes: Optional[int] = None,
        tokenizer: Any = None,
    ) -> None:
        self.model = model
        self.prefill_step_size = int(prefill_step_size or default_prefill_step())
        self._lock = threading.RLock()
        self.stats = CacheStats()
        self.last_request: Optional[RequestStats] = None
        budget = default_max_bytes() if max_bytes is None else int(max_bytes)
        self.stats.max_bytes = budget
        try:
            caches = make_prompt_cache(model)
            self.manager: Optional[PrefixManager] = PrefixManager(
                caches, max_bytes=budget, pre_end_margin=pre_end_margin,
                snapshot_interval=snapshot_interval,
            )
            self.unsupported: Optional[str] = None
        except CacheError as e:
            self.manager = None
            self.unsupported = str(e)
            warnings.warn(
                f"mlx_kvcache: this model's caches cannot be reused ({e}); every request "
                f"will recompute its whole prompt",
                RuntimeWarning,
                stacklevel=2,
            )
        # Persistence (layer 5): see save / load / close.
        self._tokenizer_for_fp = tokenizer
        self._fingerprint: Optional[str] = None
        self._store = None
        self.max_disk_bytes = max_disk_bytes
        self.cache_dir = cache_dir
        if cache_dir is not None and self.manager is not None:
            try:
                self.load(cache_dir)
            except Exception as e:  # fail-open: a cache problem never stops the model
                warnings.warn(f"mlx_kvcache: could not load the prefix cache from "
                              f"{cache_dir}: {e}", RuntimeWarning, stacklevel=2)

    # -- public API ------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of snapshots the trie holds."""
        return self.manager.trie.nbytes if self.manager else 0

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
        **kwargs,
    ) -> Generator[CachedGenerationResponse, None, None]:
        """Like `mlx_lm.stream_generate`, reusing cached prefixes of ``prompt``.

        Each response also carries ``cache``, the request's `RequestStats`.
        ``prompt_progress_callback(done, total)`` is called after each prefill chunk.
        ``snapshot_at`` adds prompt offsets to snapshot at (e.g. chat message boundaries),
        so a later prompt that diverges there restores exactly on any model.
        """
        if kwargs.pop("prompt_cache", None) is not None:
            raise ValueError("PrefixCache manages the prompt cache itself; do not pass prompt_cache")
        # Per request, as in mlx-lm: it must not change the instance's default.
        chunk = int(kwargs.pop("prefill_step_size", None) or self.prefill_step_size)
        if kwargs:
            raise TypeError(f"unsupported arguments: {sorted(kwargs)}")
        if max_tokens == 0:
            raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        tokens = self._encode(tokenizer, prompt)
        with self._lock:
            yield from self._run(tokenizer, tokens, max_tokens, sampler, logits_processors,
                                 prompt_progress_callback, snapshot_at, chunk)

    def generate(self, tokenizer, prompt, max_tokens: int = 256, **kwargs) -> str:
        """The whole generated text of `stream_generate`."""
        return "".join(r.text for r in self.stream_generate(tokenizer, prompt, max_tokens, **kwargs))

    def fingerprint(self) -> str:
        """`mlx_kvcache.store.model_fingerprint` of the model (computed once)."""
        if self._fingerprint is None:
            from ..store import model_fingerprint

            self._fingerprint = model_fingerprint(self.model, self._tokenizer_for_fp)
        return self._fingerprint

    def _persistent(self, path):
        from ..store import PersistentStore

        if self._store is None:
            if path is None:
                raise ValueError("no cache directory: pass a path or construct with cache_dir")
            mgr = self.manager
            self._store = PersistentStore(mgr.trie, layer_signature(mgr.leaves), path,
                                          self.fingerprint(), self.max_disk_bytes, keep=mgr._keep)
        return self._store

    def save(self, path: Optional[str] = None) -> int:
        """Write the cache under ``path`` (default: ``cache_dir``); returns bytes on disk.

        Incremental: snapshots already on disk are not rewritten. Raises ``OSError``
        when the directory cannot be written.
        """
        with self._lock:
            if self.manager is None:
                return 0
            return self._persistent(path).save(path)

    def load(self, path: Optional[str] = None) -> int:
        """Merge the cache saved under ``path`` (default: ``cache_dir``) into the trie.

        Returns the number of cached tokens loaded. Fail-open: a missing, damaged,
        other-model or other-version cache gives one warning and loads nothing.
        """
        with self._lock:
            if self.manager is None:
                return 0
            store = self._persistent(path)
            n = store.load(path)
            self.manager.enforce_budget()
            store.purge_bad()
            return n

    def close(self) -> None:
        """Save the cache (when constructed with ``cache_dir``). Idempotent."""
        with self._lock:
            if self._store is not None and self.cache_dir is not None:
                self._autosave()

    def _autosave(self) -> None:
        try:
            self._store.save()
        except Exception as e:  # a full or read-only disk must not break generation
            warnings.warn(f"mlx_kvcache: could not save the prefix cache: {e}",
                          RuntimeWarning, stacklevel=3)

    def clear(self) -> None:
        """Drop every snapshot and the live state."""
        with self._lock:
            if self.manager:
                self.manager.clear()

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _encode(tokenizer: TokenizerWrapper, prompt) -> List[int]:
        if isinstance(prompt, str):
            add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
            tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        elif isinstance(prompt, mx.array):
            tokens = prompt.reshape(-1).tolist()
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty")
        return tokens

    def _forward(self, caches, toks: List[int], fed: List[int]) -> mx.array:
        """Run ``toks`` through the model and record them as absorbed.

        ``fed`` is extended right after the graph is built (nothing is evaluated yet),
        so an interrupt can only leave it one call behind: `PrefixManager.finish`
        recognises that case through ``self._pending``.
        """
        self._pending = toks
        logits = self.model(mx.array(toks)[None], cache=caches)
        settle(caches, len(toks))
        fed.extend(toks)
        self._pending = []
        return logits

    def _run(self, tokenizer, tokens, max_tokens, sampler, processors, progress, snapshot_at=(),
             chunk=None):
        t0 = time.perf_counter()
        stats = RequestStats(prompt_tokens=len(tokens))
        self.last_request = stats
        mgr = self.manager
        if mgr is None:
            caches = mlc.make_prompt_cache(self.model)
            leaves, start, stops = None, 0, []
            stats.reason = f"model caches cannot be reused: {self.unsupported}"
        else:
            caches, leaves = mgr.caches, mgr.leaves
            if self._store is not None:
                self._store.before_request(tokens)  # check lazily loaded snapshots
            plan = mgr.begin(tokens, snapshot_at)
            stats.matched_tokens, stats.restored_tokens = plan.matched, plan.restored
            stats.reason = plan.reason
            start, stops = plan.restored, plan.stops
        chunk = chunk or self.prefill_step_size
        sampler = sampler or (lambda x: mx.argmax(x, axis=-1))
        processors = processors or []
        fed: List[int] = list(tokens[:start])
        self._pending: List[int] = []
        n = len(tokens)
        try:
            # Prefill up to the last prompt token, stopping at every planned snapshot.
            pos = start
            while pos < n - 1:
                end = min(pos + chunk, n - 1)
                nxt = next((s for s in stops if s > pos), None)
                if nxt is not None:
                    end = min(end, nxt)
                self._forward(caches, tokens[pos:end], fed)
                if leaves is not None:
                    _eval_caches(leaves)
                else:
                    mx.eval([c.state for c in caches])
                stats.prefilled_tokens += end - pos
                pos = end
                mx.clear_cache()
                if mgr is not None and pos in stops:
                    mgr.checkpoint(fed)
                    stats.snapshots_taken += 1
                if progress:
                    progress(pos - start, n - start)

            history = mx.array(tokens)

            def step(toks: List[int]):
                nonlocal history
                logits = self._forward(caches, toks, fed)[:, -1, :]
                if processors:
                    for p in processors:
                        logits = p(history, logits)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                y = sampler(logprobs)
                return y, logprobs.squeeze(0)

            y, logprobs = step(tokens[n - 1 :])
            stats.prefilled_tokens += 1
            mx.async_eval(y, logprobs)
            detok = tokenizer.detokenizer
            detok.reset()
            tic = time.perf_counter()
            ntok = 0
            while True:
                tok = int(y.item())
                if ntok == 0:
                    stats.time_to_first_token = time.perf_counter() - t0
                    stats.prompt_tps = (n - start) / max(stats.time_to_first_token, 1e-9)
                    tic = time.perf_counter()
                ntok += 1
                stats.generated_tokens = ntok
                last = tok in tokenizer.eos_token_ids or ntok == max_tokens
                if not last:
                    # One step ahead: the next forward runs while the caller handles this token.
                    history = mx.concatenate([history, mx.array([tok])])
                    ny, nlp = step([tok])
                    mx.async_eval(ny, nlp)
                if tok not in tokenizer.eos_token_ids:
                    detok.add_token(tok)
                if last:
                    detok.finalize()
                    stats.finish_reason = "stop" if tok in tokenizer.eos_token_ids else "length"
                stats.generation_tps = ntok / max(time.perf_counter() - tic, 1e-9)
                stats.cache_bytes = self.nbytes
                yield CachedGenerationResponse(
                    text=detok.last_segment,
                    token=tok,
                    logprobs=logprobs,
                    from_draft=False,
                    prompt_tokens=n,
                    prompt_tps=stats.prompt_tps,
                    generation_tokens=ntok,
                    generation_tps=stats.generation_tps,
                    peak_memory=mx.get_peak_memory() / 1e9,
                    finish_reason=stats.finish_reason,
                    cache=stats,
                )
                if last:
                    break
                y, logprobs = ny, nlp
                if ntok % 256 == 0:
                    mx.clear_cache()
        finally:
            if mgr is not None:
                evicted = mgr.finish(fed, pending=self._pending)
                self.stats.evicted_bytes += evicted
                self.stats.bytes_held = mgr.trie.nbytes
                self.stats.nodes = sum(1 for _ in mgr.trie.nodes())
            stats.cache_bytes = self.nbytes
            self.stats.add(stats)
            if self._store is not None and self.cache_dir is not None and mgr is not None:
                self._autosave()
