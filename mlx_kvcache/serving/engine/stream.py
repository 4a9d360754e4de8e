"""``stream_generate`` for mlx-lm's sequential path: mlx-lm's own, except with prompt lookup
or a draft model.

mlx-lm's ``_serve_single`` calls the module attribute ``stream_generate``; `seam.patched`
swaps in `make_stream_generate`'s function for as long as the server runs. It delegates to
mlx-lm's function for every request without a draft model, with two adjustments that keep
answers those of a cold run whatever the fetch reused or prefilled (`sequential`):

* logits processors (repetition, presence and frequency penalties, ...) see the whole
  prompt and the answer, as on a cold run — mlx-lm's see only the tokens it is handed,
  which shrink as reuse grows (so its answers with penalties change with cache hits);
* progress counts on from what the fetch already prefilled; usage reports the tokens
  restored from the cache, not those the fetch computed.

With prompt lookup (the request's sampler carries it: `lookup_request`) or a draft
model, generation is our exact speculative decoder
(`mlx_kvcache.generation.speculative`; a request with images stays mlx-lm's: its prompt
is prefilled from embeddings, which only mlx-lm's path computes): it works on every cache
kind, where mlx-lm's
raises on recurrent layers ("Speculative decoding requires a trimmable prompt cache") and
silently changes answers once a sliding window wraps (it trims rows the window lost).
Greedy answers are token for token those without a draft; sampled ones have the target's
distribution. It takes mlx-lm's cache list — the target's caches, then the draft's, as
mlx-lm builds it on a miss and the prompt cache hands it back on a hit — runs on our cache
classes sharing its arrays, puts mlx-lm's classes back into that list at the end (the
server inserts it), and yields mlx-lm's `GenerationResponse`, ``from_draft`` included.
With ``--kv-bits`` both models switch to quantized rows exactly at ``quantized_kv_start``.
Each round drafts at most ``--num-draft-tokens``: as many as pay for themselves under
``--draft-policy adaptive`` (the request's `SequentialRequest.draft_lengths`), all of them
under ``fixed``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, List, Optional

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import cache as mlc

from ...caches import KVQuantization
from ...generation.decode import Responses, decoder, emitted
from ...generation.lookup import LookupPlan
from ...generation.model_pair import ModelPair
from ...generation.prefill import Feed, Runner, on_stream, prefill
from ...prefix.live import LiveSet
from ..cache import sequential
from ..cache.native import from_native, to_native
from .lookup_request import plan_for

__all__ = ["make_stream_generate"]


def make_stream_generate(original: Callable) -> Callable:
    """Our ``stream_generate``, delegating to ``original`` (mlx-lm's) as described above."""

    def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, draft_model=None,
                        stream=None, **kwargs):
        req = sequential.current()
        rest = prompt if isinstance(prompt, (list, tuple)) else None
        if req is not None and rest is not None and _continues(req, rest):
            if req.ctx is not None:  # usage: what the cache gave, not what the fetch computed
                req.ctx.prompt_cache_count = req.restored
            done = len(req.prompt) - len(rest)
            lookup = plan_for(model, kwargs.get("sampler"))
            if (draft_model is not None or lookup is not None) and max_tokens != 0 \
                    and kwargs.get("input_embeddings") is None:  # (0: mlx-lm's own error)
                return _speculative(model, tokenizer, list(rest), max_tokens, draft_model,
                                    stream, kwargs, req, lookup)
            kwargs = dict(kwargs)
            if done and kwargs.get("logits_processors"):
                kwargs["logits_processors"] = _with_history(kwargs["logits_processors"],
                                                            req.prompt[:done])
            if kwargs.get("prompt_progress_callback") is not None and done > req.restored:
                kwargs["prompt_progress_callback"] = _shifted(
                    kwargs["prompt_progress_callback"], done - req.restored)
        if stream is not None:
            kwargs["stream"] = stream
        return original(model, tokenizer, prompt, max_tokens=max_tokens,
                        draft_model=draft_model, **kwargs)
    stream_generate.__wrapped__ = original
    return stream_generate


def _continues(req, rest) -> bool:
    """Whether ``rest`` is the end of the request's prompt (what the fetch left)."""
    p = req.prompt
    return p is not None and 0 < len(rest) <= len(p) and list(p[len(p) - len(rest):]) == list(rest)


def _with_history(processors: List[Callable], prefix: List[int]) -> List[Callable]:
    head = mx.array(list(prefix))

    def wrap(proc):
        def run(tokens, logits):
            if tokens is None:
                return proc(head, logits)
            return proc(mx.concatenate([head.astype(tokens.dtype), tokens]), logits)
        return run
    return [wrap(p) for p in processors]


def _shifted(callback: Callable[[int, int], None], before: int) -> Callable[[int, int], None]:
    return lambda done, total: callback(done + before, total + before)


def _speculative(model, tokenizer, rest: List[int], max_tokens: int, draft, stream,
                 kwargs, req, lookup: Optional[LookupPlan]) -> Iterator[GenerationResponse]:
    seq = list(req.prompt)
    n, pos = len(seq), len(seq) - len(rest)
    pair = ModelPair(model, draft)
    cache = kwargs.get("prompt_cache")
    if cache is None:  # mlx-lm's layout: the target's caches, then the draft's
        cache = mlc.make_prompt_cache(model) + (
            [] if draft is None else mlc.make_prompt_cache(draft))
    bits = kwargs.get("kv_bits")
    quant = None if bits is None else KVQuantization(
        bits, kwargs.get("kv_group_size", 64), kwargs.get("quantized_kv_start", 5000))
    # The decoder runs on our classes (their restore rules are what makes rollback exact),
    # sharing the arrays of mlx-lm's objects; they go back into the server's list at the end.
    ours = from_native(cache, pos, quant) if pos else None
    if ours is None:  # fresh caches (or ones that do not hold the prefix): from the start
        ours, pos = pair.make_caches(), 0
    feed = Feed(pair, LiveSet(ours, quant=quant), seq[:pos])
    stats = req.stats
    stats.prompt_tokens = n
    progress = kwargs.get("prompt_progress_callback")
    run = on_stream(stream)
    tic = time.perf_counter()
    # Both models absorb the prompt but its last token.
    prefill(feed, seq, pos, n - 1, step=int(kwargs.get("prefill_step_size") or 2048),
            progress=None if progress is None else
            lambda at: progress(at - req.restored, n - req.restored), run=run)
    length = None if req.draft_lengths is None or draft is None \
        else req.draft_lengths.for_pair(model, draft)
    spec = run(lambda: decoder(
        feed, seq, num_draft=int(kwargs.get("num_draft_tokens") or 0),
        sampler=kwargs.get("sampler") or (lambda x: mx.argmax(x, axis=-1)),
        processors=kwargs.get("logits_processors") or [], eos=tokenizer.eos_token_ids,
        max_tokens=max_tokens, stats=stats, draft_length=length, lookup=lookup))
    respond = Responses(tokenizer, prompt_tokens=len(rest), computed=len(rest), since=tic)
    return _responses(spec, feed, respond, run, req, cache)


def _responses(spec, feed: Feed, respond: Responses, run: Runner, req,
               cache: List[Any]) -> Iterator[GenerationResponse]:
    complete = False
    try:
        for tok, logprobs, from_draft, last in emitted(spec, run):
            complete = last  # the server stops reading at the last response
            yield respond(tok, logprobs, from_draft, last)
            if last:
                return
    finally:
        # Both models at one prefix of the emitted tokens, for the server's insert.
        try:
            held, ok = run(spec.finish, complete)
            if ok and complete and len(held) == len(spec.seq) - 1:
                # mlx-lm's decoding has absorbed every token it emitted (it runs a step
                # ahead), and its server stores them all: so do we, for a next turn that
                # reuses as much.
                run(_absorb, feed, spec.seq[-1:])
                held = spec.seq
            req.absorbed = len(held) if ok else -1
        finally:
            cache[:] = to_native(feed.cache_set.caches)  # the server inserts this very list


def _absorb(feed: Feed, toks: List[int]) -> None:
    feed(toks)
    feed.evaluate()
