"""The typed front door to generation: a request and its generation arguments in, an
iterator of typed events out.

The agent routes (and the chat route, for models whose output only our parsers read) call
`start`: the request goes through the same admission, memory guard, batching and prompt
cache as every request of mlx-lm's own routes — it is put on the generator's request queue
(`ServerResponseGenerator.submit`) — and its answer is read from its response queue on the
caller's thread (the HTTP thread): no handler of mlx-lm's, no worker thread, no
re-parsed wire format. Each generated token is fed to the model's output parser
(`parsers.registry`), whose typed outputs (`Text`, `Reasoning`, `CallBegin`,
`CallArguments`, `Call`, `CallCut`) are passed on as they come; around them the answer's own
events:

* `Started` — the prompt's length and what the prompt cache restored of it, known before any
  token (the batch path knows at once; the sequential path's fetch announces it with
  `Fetched` before it prefills);
* `Progress` — prompt processing (``done`` of ``total``);
* `Finished` — the stop reason named from the tokens (``"stop"``, ``"length"``,
  ``"tool_calls"``, ``"stop_sequence"`` with the sequence), and the usage;
* `Failed` — the answer failed after it started (the last event).

A call the parser cannot read comes back as `Text` (its markup, never lost) with a warning
in the log — or, where it had begun streaming, as `UnreadCall` with its index, for the route
to close the call it opened before the markup follows as text; the stop reason then follows
what came back (no complete call: not ``"tool_calls"``). Closing the answer (`Answer.close`,
safe from any thread: a client that left) stops it — a request not yet taken is dropped when
the generation thread reaches it, a running one stops at its next step. The server's stop
cuts an answer short (``"length"``) or refuses one not started (`Refused`, 503).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Union

from mlx_lm.server import (GenerationArguments, GenerationContext, LogitsProcessorArguments,
                           ModelDescription, SamplingArguments)

from ..guards.context import ContextTooLong
from ..guards.lifecycle import ServerStopping
from ..guards.memory import MemoryNeverFits, MemoryRefused
from ..parsers.base import (Call, CallArguments, CallBegin, CallCut, Output, Reasoning, Text,
                            UnreadCall)
from .generator import ServerResponseGenerator
from .lookup_request import RequestLookup, lookup_of
from .requests import Fetched, MarkedRequest

__all__ = ["Sampling", "AnswerRequest", "Started", "Progress", "Finished", "Failed",
           "AnswerEvent", "Answer", "Refused", "start", "NOTHING"]

log = logging.getLogger("mlx_kvcache")

#: What `Answer.next_event` returns when nothing came in time.
NOTHING = object()


@dataclass(frozen=True)
class Sampling:
    """The sampling a client asked for; None: the server's default (``--temp``, ``--top-p``,
    ``--top-k``, ``--min-p``: what mlx-lm's handler falls back to)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None


@dataclass
class AnswerRequest:
    """One answer to make: ``request`` (the prompt — rendered and encoded by the route, with
    its layout — as the generator takes it), ``max_tokens`` (None: the server's
    ``--max-tokens``), ``stop`` strings, ``sampling``; ``model`` names the model as requests
    naming it are named (what mlx-lm batches by: `ServerResponseGenerator.submit` names it
    as every request the same model answers)."""

    request: MarkedRequest
    max_tokens: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    model: str = "default_model"
    #: The chat template arguments the request asks for (beside the server's).
    template_kwargs: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class Started:
    """The answer started: the prompt's tokens and how many of them the prompt cache
    restored (the rest are computed for this request)."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Progress:
    """Prompt processing: ``done`` of ``total`` tokens computed."""

    done: int
    total: int


@dataclass(frozen=True)
class Finished:
    """The answer is complete: ``reason`` is ``"stop"`` (the end-of-sequence token),
    ``"stop_sequence"`` (``stop_sequence`` says which), ``"tool_calls"`` (it ended after
    tool calls) or ``"length"`` (the token limit, the memory guard's cut, the server's
    stop); the usage in tokens."""

    reason: str
    stop_sequence: Optional[str]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    #: Answer tokens proposed (by prompt lookup or a draft model) and kept, and proposed
    #: and not: what OpenAI's usage calls accepted and rejected prediction tokens.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True)
class Failed:
    """The answer failed after it started (``message`` says why); the last event."""

    message: str


AnswerEvent = Union[Started, Progress, Text, Reasoning, CallBegin, CallArguments, Call,
                    CallCut, UnreadCall, Finished, Failed]


class Refused(Exception):
    """The request was not started: ``status`` (HTTP), ``message``, ``code`` (a
    machine-readable reason: ``"context_length_exceeded"``, ``"memory_limit_exceeded"``,
    ``"server_stopping"``, or None) and whether the client is at fault (``client_error``:
    a 4xx) — the routes say it in their API's shape."""

    def __init__(self, message: str, status: int, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    @property
    def client_error(self) -> bool:
        return 400 <= self.status < 500


def _refusal(e: BaseException) -> Refused:
    """What an exception the generation thread put in place of the request's context
    means for its client."""
    if isinstance(e, MemoryRefused):
        return Refused(str(e), e.status,
                       "memory_limit_exceeded" if isinstance(e, MemoryNeverFits) else None)
    if isinstance(e, ContextTooLong):  # (counted by the route that says it)
        return Refused(str(e), 400, "context_length_exceeded")
    if isinstance(e, ServerStopping):
        return Refused(str(e), 503, "server_stopping")
    if isinstance(e, (ValueError, TypeError, KeyError)):  # mlx-lm's tokenizing: the request's
        return Refused(str(e), 400)
    return Refused(f"the request failed: {e}", 500)


def arguments(generator: ServerResponseGenerator, req: AnswerRequest) -> GenerationArguments:
    """mlx-lm's generation arguments for ``req``, with the server's defaults where the
    client sent nothing (as mlx-lm's handler fills them in)."""
    cli, s = generator.cli_args, req.sampling
    return GenerationArguments(
        model=ModelDescription(model=req.model, draft="default_model", adapter=None),
        sampling=SamplingArguments(
            temperature=cli.temp if s.temperature is None else s.temperature,
            top_p=cli.top_p if s.top_p is None else s.top_p,
            top_k=cli.top_k if s.top_k is None else s.top_k,
            min_p=cli.min_p if s.min_p is None else s.min_p,
            xtc_probability=0.0, xtc_threshold=0.1),
        logits=LogitsProcessorArguments(
            logit_bias=None, repetition_penalty=0.0, repetition_context_size=20,
            presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0,
            frequency_context_size=20),
        stop_words=list(req.stop),
        max_tokens=cli.max_tokens if req.max_tokens is None else req.max_tokens,
        num_draft_tokens=cli.num_draft_tokens, logprobs=False, top_logprobs=-1,
        seed=s.seed, chat_template_kwargs=dict(req.template_kwargs) if req.template_kwargs
        else None)


def start(generator: ServerResponseGenerator, req: AnswerRequest,
          waiting: Optional[Callable[[], None]] = None, every: float = 5.0) -> "Answer":
    """Submit ``req`` and wait until the generation thread takes it: returns its `Answer`,
    or raises `Refused` (the server stops, the memory guard or the context refuses it, its
    prompt cannot be tokenized...). ``waiting`` is called every ``every`` seconds while it
    waits (a streamed answer's keep-alive: what it raises — the client left — drops the
    request and is raised here)."""
    args = arguments(generator, req)
    try:
        queue = generator.submit(req.request, args)
    except (ServerStopping, RuntimeError) as e:
        raise Refused(str(e), 503, "server_stopping" if isinstance(e, ServerStopping)
                      else None) from None
    answer = Answer(generator, req, queue, lookup_of(args))
    try:
        answer.wait_started(waiting, every)
    except BaseException:
        answer.close()
        raise
    return answer


class Answer:
    """One answer's events (an iterator; `next_event` waits with a timeout; `close` stops
    it, from any thread). Before the first event: ``prompt_tokens``; ``cached_tokens`` once
    `Started` was given (`started`, which waits for it)."""

    def __init__(self, generator: ServerResponseGenerator, req: AnswerRequest,
                 queue: "Queue[Any]", lookup: Optional[RequestLookup] = None) -> None:
        self._generator, self._req, self._queue = generator, req, queue
        #: The request's prompt lookup (its counters: the usage's predictions).
        self._lookup = lookup
        self._ctx: Optional[GenerationContext] = None
        self._parser = None
        self._pending: Deque[AnswerEvent] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._ended = False
        self.prompt_tokens = 0
        self.cached_tokens: Optional[int] = None
        self._started: Optional[Started] = None
        self._output = 0
        self._last: List[int] = []
        self._calls = 0

    # -- waiting for the generation thread ----------------------------------------------------
    def wait_started(self, waiting: Optional[Callable[[], None]], every: float) -> None:
        """Block until the generation thread took the request (its context came), calling
        ``waiting`` every ``every`` seconds meanwhile; `Refused` when it was refused."""
        while self._ctx is None:
            item = self._get(every if waiting is not None else 0.25)
            if item is _TIMEOUT:
                self._refuse_if_stopping()
                if waiting is not None:
                    waiting()
                continue
            if isinstance(item, BaseException):
                raise _refusal(item)
            if isinstance(item, GenerationContext):
                self._take(item)
            elif item is None:
                raise Refused("the request ended before it started", 500)

    def _refuse_if_stopping(self) -> None:
        gen = self._generator
        if gen.lifecycle.cut.is_set():
            raise Refused("the server is stopping; this request was not started", 503,
                          "server_stopping")
        if not gen.generation_available():
            raise Refused("the generation thread is not running", 503)

    def _take(self, ctx: GenerationContext) -> None:
        self._ctx = ctx
        with self._lock:
            if self._closed:
                ctx.stop()
        self.prompt_tokens = len(ctx.prompt)
        served = self._generator.served_model()
        self._parser = served.parser(self._req.request.tools, ctx.initial_state,
                                     list(self._req.stop))
        if ctx.prompt_cache_count >= 0:  # the batch path fetched already
            self._start(ctx.prompt_cache_count)

    def _start(self, cached: int) -> None:
        if self._started is None:
            self.cached_tokens = cached
            self._started = Started(self.prompt_tokens, cached)
            self._pending.append(self._started)

    def started(self, timeout: Optional[float] = None) -> Optional[Started]:
        """The `Started` event, once the prompt cache's fetch said what it restored (waits
        for it, reading ahead: later events are kept for `next_event`); None when the
        answer ended first or nothing came within ``timeout``."""
        while self._started is None and not self._ended:
            if self._read(timeout) is NOTHING:
                return None
        return self._started

    # -- the events ---------------------------------------------------------------------------
    def __iter__(self) -> "Answer":
        return self

    def __next__(self) -> AnswerEvent:
        ev = self.next_event(None)
        if ev is None:
            raise StopIteration
        return ev

    def next_event(self, timeout: Optional[float]) -> Any:
        """The next event; `NOTHING` when none came within ``timeout`` seconds (None: as
        long as it takes); None once the answer ended."""
        while not self._pending:
            if self._ended:
                return None
            if self._read(timeout) is NOTHING:
                return NOTHING
        return self._pending.popleft()

    def _read(self, timeout: Optional[float]) -> Any:
        """Read one item of the response queue into `_pending`; `NOTHING` on a timeout."""
        step = 0.25 if timeout is None else min(timeout, 0.25)
        waited = 0.0
        while True:
            if self._generator.lifecycle.cut.is_set():
                return self._end(self._finish("length"))  # the server's stop cuts it here
            item = self._get(step)
            if item is not _TIMEOUT:
                break
            if not self._generator.generation_available():
                return self._end(Failed("the generation thread ended"))
            with self._lock:
                if self._closed:
                    return self._end(None)
            waited += step
            if timeout is not None and waited >= timeout:
                return NOTHING
        if item is _CLOSED:
            return self._end(None)
        if isinstance(item, Fetched):
            self._start(item.restored)
        elif isinstance(item, tuple):
            self._pending.append(Progress(*item))
        elif isinstance(item, BaseException):
            log.error("mlx_kvcache: an answer failed: %s", item)
            self._end(Failed(f"the answer failed: {item}"))
        elif item is None:  # the generation thread ended the answer without a last token
            self._end(self._finish("stop"))
        else:
            self._token(item)
        return True

    def _get(self, timeout: float) -> Any:
        try:
            return self._queue.get(timeout=timeout)
        except Empty:
            return _TIMEOUT

    def _token(self, r) -> None:
        """One generated token (mlx-lm's ``Response``): its parsed outputs, and the end."""
        if self._started is None:  # (a path that did not announce its fetch)
            self._start(max(self._ctx.prompt_cache_count, 0))
        self._output += 1
        self._last.append(r.token)
        del self._last[:-64]
        for out in self._parser.feed(r.token, r.text, r.finish_reason):
            self._pending.append(self._kept(out))
        if r.finish_reason is not None:
            self._end(self._finish(r.finish_reason))

    def _kept(self, out: Output) -> AnswerEvent:
        if isinstance(out, UnreadCall):
            log.warning("mlx_kvcache: a tool call the model's parser cannot read (%s) is "
                        "returned as text: %.200r", out.problem, out.raw)
            # A call that began streaming is closed by the route, then its markup follows
            # as text; one that never began is text only.
            return Text(out.raw) if out.index is None else out
        return out

    def _finish(self, reason: str) -> Finished:
        which = None
        if reason == "stop" and self._parser is not None and self._parser.made_calls:
            reason = "tool_calls"
        elif reason == "stop" and self._req.stop:
            which = _stop_word(self._generator.served_model().tokenizer, self._req.stop,
                               self._last)
            if which is not None:
                reason = "stop_sequence"
        cached = self.cached_tokens or 0
        st = self._lookup.stats if self._lookup is not None else None
        return Finished(reason, which, self.prompt_tokens, cached, self._output,
                        st.accepted_tokens if st is not None else 0,
                        st.drafted_tokens - st.accepted_tokens if st is not None else 0)

    def _end(self, last: Optional[AnswerEvent]) -> None:
        if self._ended:
            return
        self._ended = True
        if last is not None:
            self._pending.append(last)
        if self._ctx is not None:
            self._ctx.stop()  # (a no-op once mlx-lm ended it: it has forgotten the request)

    def close(self) -> None:
        """Stop the answer (any thread): a running answer ends at its next step, a request
        not yet taken is dropped when the generation thread reaches it; `next_event`
        answers None from now on."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._req.request.abandon()
        if self._ctx is not None:
            self._ctx.stop()
        self._queue.put(_CLOSED)

    @property
    def prompt(self) -> Any:
        """The prompt's token ids as the generation thread made them (carrying the
        request's cache namespace), or [] before it took the request."""
        return self._ctx.prompt if self._ctx is not None else []

    @property
    def output_tokens(self) -> int:
        """The answer's tokens read so far."""
        return self._output

    @property
    def ended(self) -> bool:
        """Whether the answer's last event was read from the generation thread."""
        return self._ended

    @property
    def usage(self) -> Started:
        """The prompt's usage so far (`Started`; zeros before the fetch)."""
        return self._started or Started(self.prompt_tokens, 0)


_TIMEOUT = object()
_CLOSED = object()


def _stop_word(tokenizer, stops: Sequence[str], last: Sequence[int]) -> Optional[str]:
    """The stop string whose tokens end ``last`` (how mlx-lm matched it), or None (an end
    of sequence token stopped the answer)."""
    if not last or last[-1] in set(tokenizer.eos_token_ids or ()):
        return None
    for s in stops:
        ids = tuple(tokenizer.encode(s, add_special_tokens=False))
        if ids and tuple(last[-len(ids):]) == ids:
            return s
    return None
