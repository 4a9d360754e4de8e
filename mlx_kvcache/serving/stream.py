"""``stream_generate`` for mlx-lm's sequential path: mlx-lm's own, except with a draft model.

mlx-lm's ``_serve_single`` calls the module attribute ``stream_generate``; `seam.patched`
swaps in `make_stream_generate`'s function for as long as the server runs. It delegates to
mlx-lm's function for every request without a draft model, with two adjustments that keep
answers those of a cold run whatever the fetch reused or prefilled (`sequential`):

* logits processors (repetition, presence and frequency penalties, ...) see the whole
  prompt and the answer, as on a cold run — mlx-lm's see only the tokens it is handed,
  which shrink as reuse grows (so its answers with penalties change with cache hits);
* progress counts on from what the fetch already prefilled; usage reports the tokens
  restored from the cache, not those the fetch computed.

With a draft model, generation is our exact speculative decoder
(`mlx_kvcache.generation.speculative`): it works on every cache kind, where mlx-lm's
raises on recurrent layers ("Speculative decoding requires a trimmable prompt cache") and
silently changes answers once a sliding window wraps (it trims rows the window lost).
Greedy answers are token for token those without a draft; sampled ones have the target's
distribution. It takes mlx-lm's cache list — the target's caches, then the draft's, as
mlx-lm builds it on a miss and the prompt cache hands it back on a hit — runs on our cache
classes sharing its arrays, puts mlx-lm's classes back into that list at the end (the
server inserts it), and yields mlx-lm's `GenerationResponse`, ``from_draft`` included.
With ``--kv-bits`` both models switch to quantized rows exactly at ``quantized_kv_start``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import cache as mlc

from ..caches import KVQuantization, cache_arrays, leaf_caches, make_prompt_cache, settle
from ..generation.speculative import SpeculativeDecoder, clamp_ids
from . import sequential
from .native import from_native, to_native
from .validation import vocab_size

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
            if draft_model is not None and max_tokens != 0:  # (0: mlx-lm's own error)
                return _speculative(model, tokenizer, list(rest), max_tokens, draft_model,
                                    stream, kwargs, req)
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


def _target_entries(model) -> int:
    return len(mlc.make_prompt_cache(model))


def _speculative(model, tokenizer, rest: List[int], max_tokens: int, draft, stream,
                 kwargs, req) -> Iterator[GenerationResponse]:
    if kwargs.get("input_embeddings") is not None:
        raise ValueError("Speculative decoding does not support input embeddings.")  # as mlx-lm
    seq = list(req.prompt)
    n, pos = len(seq), len(seq) - len(rest)
    nt = _target_entries(model)
    cache = kwargs.get("prompt_cache")
    if cache is None:  # mlx-lm's layout: the target's caches, then the draft's
        cache = mlc.make_prompt_cache(model) + mlc.make_prompt_cache(draft)
    bits = kwargs.get("kv_bits")
    quant = None if bits is None else KVQuantization(
        bits, kwargs.get("kv_group_size", 64), kwargs.get("quantized_kv_start", 5000))
    # The decoder runs on our classes (their restore rules are what makes rollback exact),
    # sharing the arrays of mlx-lm's objects; they go back into the server's list at the end.
    ours = from_native(cache, pos, quant) if pos else None
    if ours is None:  # fresh caches (or ones that do not hold the prefix): from the start
        ours, pos = make_prompt_cache(model) + make_prompt_cache(draft), 0

    def lists():
        if quant is not None:
            quant.convert(ours)  # the switch, exactly at its start (before every pass)
        return ours[:nt], ours[nt:]
    tv, dv = vocab_size(model), vocab_size(draft)
    draft_vocab = dv if dv is not None and (tv is None or dv < tv) else None
    stats = req.stats
    stats.prompt_tokens = n
    step = int(kwargs.get("prefill_step_size") or 2048)
    progress = kwargs.get("prompt_progress_callback")
    stream = stream if stream is not None else mx.default_stream(mx.default_device())
    tic = time.perf_counter()
    with mx.stream(stream):
        while pos < n - 1:  # both models absorb the prompt but its last token
            end = min(pos + step, n - 1)
            if quant is not None and pos < quant.start:
                end = min(end, quant.start)
            tc, dc = lists()
            x = mx.array(seq[pos:end])[None]
            model(x, cache=tc)
            settle(tc, end - pos)
            draft(clamp_ids(x, draft_vocab), cache=dc)
            settle(dc, end - pos)
            mx.eval(cache_arrays(leaf_caches(ours)))
            pos = end
            if progress is not None:
                progress(pos - req.restored, n - req.restored)
        tc, dc = lists()
        spec = SpeculativeDecoder(
            model, tc, draft, dc, seq, num_draft=int(kwargs.get("num_draft_tokens") or 0),
            sampler=kwargs.get("sampler") or (lambda x: mx.argmax(x, axis=-1)),
            processors=kwargs.get("logits_processors") or [], eos=tokenizer.eos_token_ids,
            max_tokens=max_tokens, stats=stats, vocab=tv, draft_vocab=draft_vocab,
            switch=lists if quant is not None else None,
            quant_start=quant.start if quant is not None else None)

    def hand_back() -> None:
        cache[:] = to_native(ours)  # the server inserts this very list

    def absorb_last() -> List[int]:
        # mlx-lm's decoding has absorbed every token it emitted (it runs a step ahead),
        # and its server stores them all: so do we, for a next turn that reuses as much.
        tc, dc = lists()
        x = mx.array(spec.seq[-1:])[None]
        model(x, cache=tc)
        settle(tc, 1)
        draft(clamp_ids(x, draft_vocab), cache=dc)
        settle(dc, 1)
        mx.eval(cache_arrays(leaf_caches(ours)))
        return spec.seq
    return _responses(spec, tokenizer, len(rest), max_tokens, stream, tic, req, hand_back,
                      absorb_last)


def _responses(spec, tokenizer, prompt_size: int, max_tokens: int, stream, tic, req,
               hand_back: Callable[[], None],
               absorb_last: Callable[[], List[int]]) -> Iterator[GenerationResponse]:
    detok = tokenizer.detokenizer
    detok.reset()
    eos = tokenizer.eos_token_ids
    complete, ntok, prompt_tps = False, 0, 0.0
    try:
        while True:
            with mx.stream(stream):
                out, done = spec.step()
            for i, (tok, logprobs, from_draft) in enumerate(out):
                if ntok == 0:
                    prompt_tps = prompt_size / max(time.perf_counter() - tic, 1e-9)
                    tic = time.perf_counter()
                ntok += 1
                last = done and i == len(out) - 1
                finish: Optional[str] = None
                if tok not in eos:
                    detok.add_token(tok)
                if last:
                    detok.finalize()
                    finish = "stop" if tok in eos else "length"
                    complete = True  # the server stops reading at this response
                yield GenerationResponse(
                    text=detok.last_segment, token=tok, logprobs=logprobs,
                    from_draft=from_draft, prompt_tokens=prompt_size, prompt_tps=prompt_tps,
                    generation_tokens=ntok,
                    generation_tps=ntok / max(time.perf_counter() - tic, 1e-9),
                    peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)
            if done:
                return
    finally:
        # Both models at one prefix of the emitted tokens, for the server's insert.
        try:
            with mx.stream(stream):
                held, ok = spec.finish(complete)
                if ok and complete and len(held) == len(spec.seq) - 1:
                    held = absorb_last()
            req.absorbed = len(held) if ok else -1
        finally:
            hand_back()
