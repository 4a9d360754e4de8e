"""One request's run: restore, chunked prefill that stops at the planned snapshot offsets,
decode one step ahead (or speculatively, with a draft model: `speculative`), record — on a
live set the request owns.

Every model step runs on the cache's engine thread (`engine`), handed over and waited
for, so requests interleave freely — several generators on one thread, ``next()`` from a
pool of threads — without ever sharing caches or blocking each other across a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import cache as mlc

from ..caches import cache_arrays, settle
from ..prefix.stats import RequestStats
from .speculative import SpeculativeDecoder, clamp_ids
from ..prefix.tokens import TokenBuffer


@dataclass
class CachedGenerationResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse` plus the request's cache facts."""

    cache: Optional[RequestStats] = None


def _eval_caches(leaves) -> None:
    mx.eval(cache_arrays(leaves))


class _Feed:
    """Tokens the caches absorbed (``fed``) and those of a forward pass in flight.

    ``fed`` is extended right after the graph is built (nothing is evaluated yet), so an
    interrupt can only leave it one call behind: the manager recognises that case
    through ``pending``. It is a `TokenBuffer` (an append-only array), so handing it to
    the manager at a checkpoint or at the end copies nothing, however long the prompt.
    With a draft model, every prefill chunk feeds both models.
    """

    def __init__(self, model, caches, fed: TokenBuffer, draft=None, draft_caches=None,
                 draft_vocab=None, before: Optional[Callable[[], Any]] = None):
        self.model, self.caches, self.fed, self.pending = model, caches, fed, []
        self.draft, self.draft_caches, self.draft_vocab = draft, draft_caches, draft_vocab
        # The kv_bits switch, exactly at its start offset; it may replace cache objects, so
        # it hands back the (target, draft) cache lists to use from then on.
        self.before = before

    def __call__(self, toks: List[int]) -> mx.array:
        if self.before is not None:
            self.caches, self.draft_caches = self.before()
        self.pending = toks
        x = mx.array(toks)[None]
        logits = self.model(x, cache=self.caches)
        settle(self.caches, len(toks))
        if self.draft is not None:
            self.draft(clamp_ids(x, self.draft_vocab), cache=self.draft_caches)
            settle(self.draft_caches, len(toks))
        self.fed.extend(toks)
        self.pending = []
        return logits


def run(pc, tokenizer, tokens: List[int], max_tokens: int, sampler: Optional[Callable],
        processors: Sequence[Callable], progress: Optional[Callable[[int, int], None]],
        snapshot_at: Sequence[int], chunk: int,
        num_draft: int = 0) -> Generator[CachedGenerationResponse, None, None]:
    """The body of `PrefixCache.stream_generate` (arguments already checked).

    With ``pc.draft_model`` the live set holds the target's caches, then the draft's; both
    are prefilled together and decoding is speculative (``num_draft`` tokens a round).
    Model work runs on ``pc``'s engine thread; this generator only sequences it, so it
    may be advanced from any thread."""
    t0 = time.perf_counter()
    stats = RequestStats(prompt_tokens=len(tokens))
    pc.last_request = stats
    mgr, engine = pc.manager, pc._engine
    draft = pc.draft_model
    live = spec = dcaches = None
    if mgr is None:
        caches = engine.run(mlc.make_prompt_cache, pc.model)
        if draft is not None:
            dcaches = engine.run(mlc.make_prompt_cache, draft)
        leaves, start, stops = None, 0, []
        stats.reason = f"model caches cannot be reused: {pc.unsupported}"
    else:
        live, plan = mgr.checkout(tokens, snapshot_at)
        caches, leaves = live.caches, live.leaves
        if draft is not None:  # one live set holds both models' caches
            caches, dcaches = caches[: pc.target_entries], caches[pc.target_entries:]
        stats.matched_tokens, stats.restored_tokens = plan.matched, plan.restored
        stats.disk_tokens = plan.from_disk
        stats.reason = plan.reason
        stats.reuse = pc.explain(tokenizer, tokens, plan)
        start, stops = plan.restored, plan.stops
    sampler = sampler or (lambda x: mx.argmax(x, axis=-1))

    def switch():
        """The kv_bits switch on the live set, then its current (target, draft) lists."""
        live.quantize_due()
        if draft is None:
            return live.caches, None
        return live.caches[: pc.target_entries], live.caches[pc.target_entries:]
    quantized = live is not None and live.quant is not None
    feed = _Feed(pc.model, caches, TokenBuffer(tokens[:start]), draft, dcaches, pc.draft_vocab,
                 switch if quantized else None)
    n = len(tokens)
    state = {"history": None, "next": None}

    def prefill(a: int, b: int) -> None:
        feed(tokens[a:b])
        if live is not None:
            _eval_caches(live.leaves)  # the kv_bits switch may have replaced some
        else:
            mx.eval([c.state for c in caches + (dcaches or [])])
        mx.clear_cache()

    def step(toks: List[int]):
        logits = feed(toks)[:, -1, :]
        stats.target_passes += 1
        for p in processors:
            logits = p(state["history"], logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs)
        mx.async_eval(y, logprobs)
        # Recurrent states are not inputs of this step's logits: schedule them too, so
        # nothing the caches hold stays an unevaluated graph between steps.
        if leaves is not None:
            mx.async_eval([x for c in leaves if isinstance(c, mlc.ArraysCache) for x in c.cache
                           if x is not None])
        return y, logprobs.squeeze(0)

    def first():
        state["history"] = mx.array(tokens)
        state["next"] = step(tokens[n - 1:])

    def decode(ntok: int):
        """Read the token computed one step ahead; start the next step unless it is the last."""
        y, logprobs = state["next"]
        tok = int(y.item())
        mx.eval(logprobs)  # handed to the caller's thread: it must hold data, not a graph
        last = tok in eos or ntok + 1 == max_tokens
        if not last:
            state["history"] = mx.concatenate([state["history"], mx.array([tok])])
            state["next"] = step([tok])
        if (ntok + 1) % 256 == 0:
            mx.clear_cache()
        return tok, logprobs, last

    def plain():
        """(token, log-probs, from_draft, last) of plain decoding, one step ahead."""
        engine.run(first)
        ntok = 0
        while True:
            tok, logprobs, last = engine.run(decode, ntok)
            ntok += 1
            yield tok, logprobs, False, last
            if last:
                return

    def speculative():
        """The same, a round of speculative decoding at a time."""
        while True:
            out, done = engine.run(spec.step)
            for i, (tok, logprobs, from_draft) in enumerate(out):
                yield tok, logprobs, from_draft, done and i == len(out) - 1
            if done:
                return

    eos = tokenizer.eos_token_ids
    try:
        # Prefill up to the last prompt token, stopping at every planned snapshot.
        pos = start
        while pos < n - 1:
            end = min(pos + chunk, n - 1)
            nxt = next((s for s in stops if s > pos), None)
            if nxt is not None:
                end = min(end, nxt)
            engine.run(prefill, pos, end)
            stats.prefilled_tokens += end - pos
            pos = end
            if live is not None and pos in stops:
                if mgr.checkpoint(live, feed.fed):
                    stats.snapshots_taken += 1
                else:
                    stats.snapshots_skipped += 1
            if progress:
                progress(pos - start, n - start)
        if draft is None:
            source = plain()
        else:
            spec = SpeculativeDecoder(
                pc.model, feed.caches, draft, feed.draft_caches, tokens, num_draft=num_draft,
                sampler=sampler, processors=processors, eos=eos, max_tokens=max_tokens,
                stats=stats, vocab=pc.target_vocab, draft_vocab=pc.draft_vocab,
                switch=feed.before, quant_start=live.quant.start if quantized else None)
            source = speculative()
        stats.prefilled_tokens += 1
        detok = tokenizer.detokenizer
        detok.reset()
        tic = time.perf_counter()
        ntok = 0
        for tok, logprobs, from_draft, last in source:
            if ntok == 0:
                stats.time_to_first_token = time.perf_counter() - t0
                stats.prompt_tps = (n - start) / max(stats.time_to_first_token, 1e-9)
                tic = time.perf_counter()
            ntok += 1
            stats.generated_tokens = ntok
            if tok not in eos:
                detok.add_token(tok)
            if last:
                detok.finalize()
                stats.finish_reason = "stop" if tok in eos else "length"
            stats.generation_tps = ntok / max(time.perf_counter() - tic, 1e-9)
            stats.cache_bytes = pc.nbytes
            yield CachedGenerationResponse(
                text=detok.last_segment, token=tok, logprobs=logprobs, from_draft=from_draft,
                prompt_tokens=n, prompt_tps=stats.prompt_tps, generation_tokens=ntok,
                generation_tps=stats.generation_tps, peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=stats.finish_reason, cache=stats,
            )
            if last:
                break
    finally:
        state.clear()
        if spec is not None:  # both models at one prefix of the emitted tokens
            feed.fed, _ = engine.run(spec.finish, stats.finish_reason is not None)
            feed.pending = []
        if live is not None:
            fed = feed.fed
            mgr.checkin(live, fed, feed.pending,
                        on_done=lambda recorded: pc.account(stats, fed if recorded else None))
        else:
            pc.account(stats)
