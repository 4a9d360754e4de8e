"""The one decode: plain (mlx-lm's, one step ahead) or speculative (`SpeculativeDecoder`:
proposals from prompt lookup or a draft model) after a `prefill`, and the one builder of
mlx-lm's responses from the emitted tokens.

`PrefixCache` (`request`) and the server's draft-model stream (`serving.stream`) both
decode through `decoder` and `emitted` and answer through `Responses`. (The server's plain
sequential requests are mlx-lm's own ``stream_generate``: see `serving.stream`.)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Type, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse

from ..caches.factory import recurrent_arrays
from ..prefix.stats import RequestStats
from .draft_length import DraftLength
from .lookup import LookupPlan
from .prefill import Feed, Runner, inline
from .speculative import Emitted, SpeculativeDecoder

__all__ = ["PlainDecoder", "decoder", "emitted", "Responses"]


class PlainDecoder:
    """mlx-lm's decoding over a `Feed` whose caches hold ``tokens[:-1]``: each `step`
    reads the token computed one step ahead and starts the next (every method on the
    thread that runs the model: the engine thread, a stream)."""

    def __init__(self, feed: Feed, tokens: Sequence[int], *, sampler: Callable,
                 processors: Sequence[Callable], eos, max_tokens: int,
                 stats: RequestStats) -> None:
        self.feed, self.tokens = feed, tokens
        self.sampler, self.processors, self.eos = sampler, list(processors), eos
        self.max_tokens, self.stats = max_tokens, stats
        self.generated = 0
        self._history: Optional[mx.array] = None
        self._next: Optional[Tuple[mx.array, mx.array]] = None

    def _pass(self, toks: Sequence[int]) -> Tuple[mx.array, mx.array]:
        logits = self.feed(toks)[:, -1, :]
        self.stats.target_passes += 1
        for p in self.processors:
            logits = p(self._history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = self.sampler(logprobs)
        mx.async_eval(y, logprobs)
        # Recurrent states are not inputs of this step's logits: schedule them too, so
        # nothing the caches hold stays an unevaluated graph between steps.
        leaves = self.feed.leaves
        if leaves is not None:
            mx.async_eval(recurrent_arrays(leaves))
        return y, logprobs.squeeze(0)

    def step(self) -> Tuple[List[Emitted], bool]:
        """The next token and whether the request is done (end of sequence or
        ``max_tokens``); unless done, the pass for the token after it is under way."""
        if self._next is None:
            self._history = mx.array(self.tokens)
            self._next = self._pass(self.tokens[len(self.tokens) - 1:])
        y, logprobs = self._next
        tok = int(y.item())
        mx.eval(logprobs)  # handed to the caller's thread: it must hold data, not a graph
        self.generated += 1
        last = tok in self.eos or self.generated == self.max_tokens
        if not last:
            self._history = mx.concatenate([self._history, mx.array([tok])])
            self._next = self._pass([tok])
        if self.generated % 256 == 0:
            mx.clear_cache()
        return [(tok, logprobs, False)], last

    def finish(self, complete: bool = False) -> Tuple[Sequence[int], bool]:
        """Drop the pass computed ahead; the tokens the caches absorbed (the feed's)."""
        self._history = self._next = None
        return self.feed.fed, True


Decoder = Union[PlainDecoder, SpeculativeDecoder]


def decoder(feed: Feed, tokens: Sequence[int], *, num_draft: int, sampler: Callable,
            processors: Sequence[Callable], eos, max_tokens: int,
            stats: RequestStats, draft_length: Optional[DraftLength] = None,
            lookup: Optional[LookupPlan] = None) -> Decoder:
    """The decoder of a request whose caches (``feed``'s) hold ``tokens[:-1]``: plain, or
    speculative with prompt lookup (``lookup``, when its ``most`` is positive) and/or
    when the pair has a draft (``num_draft`` tokens a round, or as many of them as
    ``draft_length`` finds worth drafting); both models switch to quantized rows exactly
    at the feed's ``kv_bits`` start."""
    pair = feed.pair
    if lookup is not None and lookup.most <= 0:
        lookup = None
    if pair.draft is None and lookup is None:
        return PlainDecoder(feed, tokens, sampler=sampler, processors=processors, eos=eos,
                            max_tokens=max_tokens, stats=stats)
    target, drafted = feed.lists()
    quantized = feed.quant_start is not None
    return SpeculativeDecoder(
        pair.model, target, pair.draft, drafted, tokens, num_draft=num_draft, sampler=sampler,
        processors=processors, eos=eos, max_tokens=max_tokens, stats=stats, vocab=pair.vocab,
        draft_vocab=pair.draft_vocab, switch=feed.lists if quantized else None,
        quant_start=feed.quant_start, length=draft_length, lookup=lookup)


def emitted(dec: Decoder, run: Runner = inline) -> Iterator[Tuple[int, mx.array, bool, bool]]:
    """``(token, log-probs, from_draft, last)`` of each emitted token, a `step` of ``dec``
    at a time (each one call of ``run``)."""
    while True:
        out, done = run(dec.step)
        for i, (tok, logprobs, from_draft) in enumerate(out):
            yield tok, logprobs, from_draft, done and i == len(out) - 1
        if done:
            return


class Responses:
    """mlx-lm's `GenerationResponse` (or ``cls``, a subclass) for each emitted token: the
    detokenized text, ``finish_reason`` on the last, the prompt's and the answer's speed.

    Args:
        prompt_tokens: what a response reports as the prompt's length.
        computed: prompt tokens this request computed (``prompt_tps`` counts them).
        since: ``time.perf_counter()`` when the request started computing them.
        stats: a request's `RequestStats`, kept up to date (time to first token, speeds,
            generated tokens, finish reason), or None.
    """

    def __init__(self, tokenizer: Any, *, prompt_tokens: int, computed: int, since: float,
                 stats: Optional[RequestStats] = None,
                 cls: Type[GenerationResponse] = GenerationResponse) -> None:
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos = tokenizer.eos_token_ids
        self.prompt_tokens, self.computed, self.since = prompt_tokens, computed, since
        self.stats, self.cls = stats, cls
        self.ntok, self.prompt_tps, self.tic = 0, 0.0, since

    def __call__(self, tok: int, logprobs: mx.array, from_draft: bool, last: bool,
                 **extra: Any) -> GenerationResponse:
        st = self.stats
        if self.ntok == 0:
            ttft = time.perf_counter() - self.since
            self.prompt_tps = self.computed / max(ttft, 1e-9)
            self.tic = time.perf_counter()
            if st is not None:
                st.time_to_first_token, st.prompt_tps = ttft, self.prompt_tps
        self.ntok += 1
        finish: Optional[str] = None
        if tok not in self.eos:
            self.detok.add_token(tok)
        if last:
            self.detok.finalize()
            finish = "stop" if tok in self.eos else "length"
        tps = self.ntok / max(time.perf_counter() - self.tic, 1e-9)
        if st is not None:
            st.generated_tokens, st.generation_tps = self.ntok, tps
            if last:
                st.finish_reason = finish
        return self.cls(
            text=self.detok.last_segment, token=tok, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=self.prompt_tokens, prompt_tps=self.prompt_tps,
            generation_tokens=self.ntok, generation_tps=tps,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, **extra)
