"""mlx-lm's `ResponseGenerator` with our overrides: checkpoints inside long prompt
segments, requests checked before they can end the generation thread, commands that reach
every rank (``DELETE /v1/cache``, stop), and answers that end properly on a stop.

Checkpoints: the batch path of mlx-lm's server pauses prefill at the end of every prompt *segment*
(system prompt, user context, thinking tail) and inserts the cache there — the only
places a hybrid or sliding-window model can later restore. We split the segments further
at the offsets the prompt cache asks for (`TriePromptCache.checkpoints`: every
``--checkpoint-interval`` tokens and the branch point of this prompt), so a prompt that
diverges inside a long message restores to within one interval of the divergence, and
exactly from the second time.

Work in flight (`cache.inflight`): the batch's requests are flights (`flight_batch`); a request
sharing one is held until it stored their shared point (`followers`, `_next_request`).

The rest (see `lifecycle`): `_next_request` is where mlx-lm's generation thread of every
rank receives each request in lockstep (rank 0 reads its queue and shares the request), so
a `Control` put on that queue reaches every rank at the same turn of its loop; one small
collective there also carries a stop signal from any rank to rank 0. `_await_response` is
where an HTTP thread waits for its answer, so that is where the stop's cut ends it.
Everything else is mlx-lm's own code.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext
from queue import Empty, Queue
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.server import (CompletionRequest, GenerationContext, ResponseGenerator,
                           process_message_content)

from ...generation.draft_length import DraftLengths
from ...generation.lookup import DEFAULT_MOST
from ...prefix.stats import RequestStats
from ..cache import extract, sequential
from ..cache.profile import count_share, loop_phase
from ..cache.namespace import Namespaced
from ..cache.prompt_cache import TriePromptCache
from ..guards.context import ContextTooLong, answer_tokens, loaded_context
from ..guards.counters import Refusal
from ..guards.lifecycle import Control, Lifecycle, ServerStopping, Ticket, current_ticket, set_ticket
from ..guards.images import ImagePolicy
from ..guards.admission import AdmissionQueue, DecodeJob
from ..guards.memory import MemoryGuard, MemoryNeverFits, MemoryRefused
from ..guards.validation import generation_problem
from .requests import Fetched, MarkedRequest, ServedModel, tokenizer_for
from . import flight_batch
from .segments import split_segments
from .followers import Followers, prompt_reader
from .lookup_request import RequestLookup, attach, lookup_of
from .templates import answer_extends_prompt, answer_turn_differs
from .reasoning_budget import ReasoningBudget

log = logging.getLogger("mlx_kvcache")


#: Tokens of each answer's end kept on its ticket (a stop sequence's, to name it).
LAST_TOKENS = 64


def _watched(response, ticket: Ticket, parser=None, ending: Optional[Callable[[], int]] = None):
    """mlx-lm's answer, keeping its last tokens on ``ticket`` — and, given a ``parser``
    (the model's output parser), what it says (`Ticket.heard`), with ``ending`` called as
    its last token passes (unless cut by the token limit: nothing to foresee) so the
    foresight rendering it starts is counted before the client has the answer."""
    last: List[int] = []
    for r in response:
        ticket.answered += 1
        last.append(r.token)
        if len(last) > 2 * LAST_TOKENS:
            del last[:-LAST_TOKENS]
        ticket.last_tokens = tuple(last[-LAST_TOKENS:])
        if parser is not None:
            ticket.heard.extend(parser.feed(r.token, r.text, r.finish_reason))
            if r.finish_reason not in (None, "length") and ending is not None:
                ticket.epoch = ending()
        yield r


class _SequentialQueue:
    """A sequential request's answer queue: hands the request's `GenerationContext` to the
    prompt cache's view of it (`sequential.SequentialRequest`: usage reports what the cache
    restored). On a sharded model (``keep_going``) the request also runs to its end when
    its client leaves (its output is dropped): mlx-lm stops it on rank 0 only
    (NotImplementedError), which leaves the other ranks one request behind, hung."""

    def __init__(self, queue: Queue, request: "sequential.SequentialRequest",
                 keep_going: bool = False) -> None:
        self._queue, self._request, self._keep_going = queue, request, keep_going

    def put(self, item, *args, **kwargs) -> None:
        if isinstance(item, GenerationContext):
            self._request.ctx = item
            if self._keep_going:
                item.stop = lambda: None  # the handler's ``ctx.stop()`` must not stop rank 0 alone
        self._queue.put(item, *args, **kwargs)


class ServerResponseGenerator(ResponseGenerator):
    """`ResponseGenerator` with checkpoints, request checks, commands shared by every rank
    and a stop that ends answers properly.

    Args:
        model_provider: as mlx-lm's.
        prompt_cache: our `TriePromptCache` (what the engine calls on the cache, called
            directly: fetch and insert as mlx-lm does, plus checkpoints, the request's
            layout, idle / busy, the ranks' turn, stats and clear).
        lifecycle: the stop state shared with the HTTP handler and the app.
        agree: the ranks' `Agreement` (forwards stop signals to rank 0).
        same_model: given each request's generation arguments, names its model as every
            other request answered by the same model is named (mlx-lm batches only
            requests whose ``args.model`` compare equal); default: as requested.
    """

    def __init__(self, model_provider, prompt_cache, lifecycle: Optional[Lifecycle] = None,
                 agree=None, memory: Optional[MemoryGuard] = None,
                 same_model: Optional[Callable[[Any], Any]] = None) -> None:
        # Set before mlx-lm's __init__, which starts the generation thread.
        self.lifecycle = lifecycle or Lifecycle()
        self._served: Optional[ServedModel] = None
        self._current: Optional[ServedModel] = None  # without --model: the provider's
        load_default = model_provider.load_default

        def load_default_kept() -> None:
            load_default()
            if model_provider.tokenizer is not None:
                self._served = ServedModel.of(model_provider.model_key,
                                              model_provider.tokenizer,
                                              model_provider.processor)
                log.info("mlx_kvcache: %s", self._served.parser.describe())
        model_provider.load_default = load_default_kept
        self._same_model = same_model or (lambda args: args)
        self._agree = agree
        #: The memory guard (``--memory-limit``): it gates the request queue.
        self.memory = memory or MemoryGuard()
        self._sized: Dict[int, Tuple[Any, Any, tuple]] = {}  # request id -> tokenized
        self._gate = AdmissionQueue(self.memory, self._request_size,
                                    lambda item: isinstance(item[1], Control),
                                    lambda item: self._sized.pop(id(item[1]), None),
                                    self._image_bytes)
        # (--draft-policy; mlx-lm refuses a draft model under mlx.launch)
        self._draft_lengths = DraftLengths(
            getattr(getattr(model_provider, "cli_args", None), "draft_policy", "adaptive"))
        # The prompt cache copies only the rows it lacks: mlx-lm's extraction as views.
        extract.install()
        self.prompt_cache: TriePromptCache = prompt_cache
        # Work in flight: the batch's requests are flights; requests sharing one are held.
        self._admitting: Any = None  # ``args.model`` of the request the batch takes next
        self.followers = Followers(prompt_cache, self._prefill_step, prompt_reader(
            prompt_cache, self._tokenized, self._image_bytes, self._is_batchable))
        self._hooks = flight_batch.hooks(prompt_cache, lambda: self.model_provider.model_key,
                                         lambda: self._admitting)
        super().__init__(model_provider, prompt_cache)

    def _run_generate(self):
        with flight_batch.attached(self._hooks):  # the batch this thread builds: flights
            super()._run_generate()

    def served(self) -> Optional[ServedModel]:
        """The served model (`ServedModel`) once the generation thread loaded it, else
        None (no ``--model``, or not loaded yet)."""
        return self._served

    def served_model(self) -> ServedModel:
        """The model a request naming no other runs on — the served one — once the
        generation thread has loaded it (waits for the load; `RuntimeError` when the
        generation thread ended first). Not the model mlx-lm's provider holds now: a chat
        request naming another local model makes it hold that one, and a prompt encoded
        with its tokenizer would run on the served model as ids of another vocabulary.
        Without ``--model`` (no served model recorded) it is the one the provider holds."""
        provider = self.model_provider
        while self._served is None and provider.tokenizer is None:
            if not self.generation_available():
                raise RuntimeError("the model could not be loaded")
            time.sleep(0.05)
        if self._served is not None:
            return self._served
        key = provider.model_key
        if self._current is None or self._current.key != key:
            self._current = ServedModel.of(key, provider.tokenizer, provider.processor)
        return self._current

    def submit(self, request: MarkedRequest, args) -> Queue:
        """Put ``request`` (with mlx-lm's ``GenerationArguments`` ``args``) in line for the
        generation thread, as mlx-lm's ``generate`` does, and return its response queue:
        the request's ``GenerationContext`` (or the exception that refused it), then
        (front-door requests) `Fetched`, progress tuples, mlx-lm's ``Response`` per token
        and None at the end. `ServerStopping` while the server stops, `RuntimeError` when
        the generation thread is gone."""
        if self.lifecycle.cut.is_set() or self.lifecycle.stopped.is_set():
            raise ServerStopping("the server is stopping; this request was not started")
        if not self.generation_available():
            raise RuntimeError("the generation thread is not running")
        queue: Queue = Queue()
        args = self._same_model(args)
        self._with_lookup(request, args)
        self.requests.put((queue, request, args))
        return queue

    def _log_cache_stats(self) -> None:
        """Nothing: mlx-lm's "Prompt Cache: N sequences, X GB" lines count its own LRU
        entries, which this cache does not have; each request's ``[cache]`` line says what
        our cache holds (``held X of Y``), and ``GET /v1/cache`` the rest."""

    # -- admission (the memory guard) ---------------------------------------------------------
    @property
    def requests(self) -> AdmissionQueue:
        """mlx-lm's request queue, gated by the memory guard (`memory`)."""
        return self._gate

    @requests.setter
    def requests(self, queue) -> None:
        pass  # mlx-lm's __init__ makes a plain queue: ours stands in its place

    def _request_size(self, item) -> Optional[Tuple[int, int, Tuple[int, ...]]]:
        """``(prompt tokens, max tokens, tokens of each image)`` of a queued request,
        tokenized as mlx-lm will (kept for its `_tokenize`), or None when it cannot be told
        here."""
        out = self._tokenized(item)
        if out is None:
            return None
        vision = out[4]
        return (len(out[0]), int(item[2].max_tokens or 0),
                sequential.image_sizes(vision.cache_key) if vision is not None else ())

    def _tokenized(self, item) -> Optional[tuple]:
        """mlx-lm's tokenizing of a queued request (kept for its `_tokenize`), or None when
        it cannot be done here."""
        _, request, args = item
        tokenizer = self.model_provider.tokenizer
        if tokenizer is None:
            return None
        kept = self._sized.get(id(request))
        if kept is not None and kept[0] is request and kept[1] is tokenizer:
            return kept[2]
        try:
            out = super()._tokenize(tokenizer_for(tokenizer, request, self.model_provider.model_key),
                                    request, args)
        except Exception:  # noqa: BLE001 - mlx-lm reports it when it tokenizes
            return None
        if len(self._sized) > 1024:  # requests that ended before mlx-lm tokenized them
            self._sized.clear()
        self._sized[id(request)] = (request, tokenizer, out)
        return out

    def _image_bytes(self, item) -> int:
        """What decoding a queued request's images takes (`images.decode_bytes`: read as
        the handler checked them, where it did): 0 for a text request, or where the model
        has no image processor (mlx-lm drops the images)."""
        request = item[1]
        if not isinstance(request, CompletionRequest) or request.request_type != "chat" \
                or self.model_provider.processor is None:
            return 0
        known = request.image_bytes if isinstance(request, MarkedRequest) else None
        return ImagePolicy.decode_bytes(request.messages) if known is None else known

    def decode(self, run: Callable[[], Any], nbytes: int) -> Any:
        """``run()`` on the generation thread once the memory guard admits decoding images
        that take ``nbytes`` at their peak (``count_tokens``: never in an HTTP thread, where
        any number of clients could decode at once); returns what it returned, raises what
        it raised, or the guard's `MemoryRefused`."""
        q: Queue = Queue()
        if not self.generation_available():
            raise RuntimeError("the generation thread is not running")
        self.requests.put((q, DecodeJob(run, nbytes), None))
        while True:
            try:
                out = q.get(timeout=0.1)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("the generation thread ended first") from None
                continue
            if isinstance(out, BaseException):
                raise out
            return out

    # -- prompts ------------------------------------------------------------------------------
    def _tokenize(self, tokenizer, request, args):
        if isinstance(request, MarkedRequest) and request.abandoned and not self._is_distributed:
            self._sized.pop(id(request), None)
            raise ValueError("its client left before it started")  # (no one reads this)
        kept = self._sized.pop(id(request), None)
        if kept is not None and kept[0] is request and kept[1] is tokenizer:
            prompt, segments, types, state, vision = kept[2]  # tokenized at admission
        else:
            prompt, segments, types, state, vision = super()._tokenize(
                tokenizer_for(tokenizer, request, self.model_provider.model_key), request, args)
        # Here mlx-lm's ``try`` still catches (the request fails, the thread lives on); the
        # same problems past this point would end the generation thread.
        problem = generation_problem(prompt, args, self.model_provider.model)
        if problem:
            raise ValueError(problem)
        self._fit_context(len(prompt), args)
        mr = request if isinstance(request, MarkedRequest) else None
        namespace = mr.namespace if mr is not None else None
        if namespace:  # the prompt cache keys this request's fetch and inserts apart
            prompt = Namespaced(prompt, namespace)
            if vision is not None:
                vision.cache_key = Namespaced(vision.cache_key, namespace)
        self._make_state_machine(self.model_provider.model_key, tokenizer, args.stop_words)
        budget = mr.reasoning_budget if mr is not None else None
        if budget:  # mlx-lm makes this request's logits processors next (`reasoning_budget`)
            args.reasoning_budget = ReasoningBudget.for_tokenizer(tokenizer, budget)
        # An agent request's layout is offsets in the vocabulary it was encoded with: read
        # only on the model it was encoded for (mlx-lm encoded it again otherwise).
        laid_out = mr is None or mr.encoded_for(self.model_provider.model_key)
        marked = [c for c in mr.cuts if 0 < c < len(prompt)] if mr is not None and laid_out \
            else []
        # This request's layout, for its fetch's explanation.
        self.prompt_cache.expect(prompt, mr.marks if mr is not None and laid_out else (),
                                 mr.session if mr is not None else None,
                                 mr.agent if mr is not None else None,
                                 mr.one_shot if mr is not None else False,
                                 self.followers.waited(request))
        guess_end = not self._goes_on_past_answer(tokenizer, request, args)
        if guess_end and not marked and not self.prompt_cache.restores_anywhere():
            # Where the next request leaves this prompt (the answer's turn renders part of
            # the generation prompt otherwise): a checkpoint there, not only a few tokens
            # before the end, for layers that restore only at checkpoints. (An agent
            # route's layout marks its input's end itself.)
            differs = self._answer_turn_differs(tokenizer, request, args)
            if 0 < differs < len(prompt) - 1:
                marked = [len(prompt) - differs]
        seq = sequential.current()
        if seq is not None:  # the sequential fetch plans its own stops
            seq.prompt, seq.vision, seq.extra_stops = prompt, vision, marked
            seq.guess_end = guess_end
            return prompt, segments, types, state, vision
        self._admitting = args.model  # the batch inserts it next: a flight on this model
        if vision is None and self.model_provider.model is not None:
            cuts = self.prompt_cache.checkpoints(self.model_provider.model_key, prompt, marked,
                                                 guess_end)
            if cuts:
                segments, types = split_segments(segments, types, cuts)
        return prompt, segments, types, state, vision

    def _fit_context(self, prompt_tokens: int, args) -> None:
        """Refuse a prompt over the loaded model's context (`ContextTooLong`, before any
        work) and clamp the answer to what the context leaves (every route; the agent
        routes did both in the HTTP thread already, against the served model's)."""
        limit = answer_tokens(loaded_context(self), prompt_tokens, args.max_tokens, None)
        if limit is not None:
            args.max_tokens = limit

    def _goes_on_past_answer(self, tokenizer, request, args) -> bool:
        """Whether this chat request's next turn will extend its prompt and answer (the
        template's generation prompt re-renders as the answer's turn: `templates`), so
        the prompt cache need not guess a stop before the prompt's end."""
        if request.request_type != "chat":
            return False
        return answer_extends_prompt(tokenizer, self._template_args(request, args))

    def _answer_turn_differs(self, tokenizer, request, args) -> int:
        """How many of this chat request's last tokens its next request renders otherwise
        (`templates.answer_turn_differs`); 0 for a text request."""
        if request.request_type != "chat":
            return 0
        return answer_turn_differs(tokenizer, self._template_args(request, args))

    def _template_args(self, request, args) -> Dict[str, Any]:
        """The chat template arguments a request renders with: its own (an agent route's),
        or the server's merged with the body's, as mlx-lm's own ``_tokenize`` merges them
        — less a continued last message (this request's rendering, not the template's)."""
        template_args = request.template_kwargs if isinstance(request, MarkedRequest) else None
        if template_args is None:
            template_args = dict(self.model_provider.cli_args.chat_template_args or {})
            template_args.update(args.chat_template_kwargs or {})
        return {k: v for k, v in template_args.items() if k != "continue_final_message"}

    def _request_waiting(self) -> bool:
        """Whether work the idle time must give way to has arrived: a request or command
        queued, or the server stopping."""
        return self.requests.qsize() > 0 or self._stop or self.lifecycle.cut.is_set()

    def _prefill_step(self) -> int:
        return int(self.cli_args.prefill_step_size or 2048)

    def _serve_single(self, request, stream):
        # The fetch inside is sequential: it prefills through the planned stops, storing
        # the caches at each, reporting progress on the request's queue (`sequential`).
        rqueue, req, args = request
        announce = isinstance(req, MarkedRequest) and req.announce_fetch
        lookup = lookup_of(args)
        seq = sequential.SequentialRequest(
            progress=lambda done, total: rqueue.put((done, total)), stream=stream,
            prefill_step=self._prefill_step(),
            draft_lengths=self._draft_lengths,
            on_restored=(lambda n: rqueue.put(Fetched(n))) if announce else None,
            model=args.model, between=None if self._is_distributed else
            lambda: self.followers.scan(self.requests.waiting()),
            stats=lookup.stats if lookup is not None else RequestStats())
        self.followers.begin_scan()
        with sequential.serving(seq):
            super()._serve_single((_SequentialQueue(rqueue, seq, self._is_distributed), req, args),
                                  stream)

    # -- commands shared with every rank ------------------------------------------------------
    def _phase(self, name: str):
        profile = getattr(self._agree, "profile", None)
        return profile.phase(name) if profile is not None else nullcontext()

    def _share_object(self, obj):
        # mlx-lm's own sharing (each turn's request, the batch's removals): counted and
        # timed beside ours.
        profile = getattr(self._agree, "profile", None)
        if not self._is_distributed or profile is None:
            return super()._share_object(obj)
        t0 = time.perf_counter()
        out = super()._share_object(obj)
        count_share(profile, out, t0)
        return out

    def _next_request(self, timeout=None):
        if not (self._is_distributed and self._agree is not None):
            released = self.followers.release()  # held for a prefix in flight, free now
            if released is not None:
                return released
            if timeout is not None and not self.followers.holding():
                # no request in flight: work that waited for that: foreseen prompts, a
                # chunk at a time (`foresight`)
                self.prompt_cache.ahead(self._request_waiting, self._prefill_step())
                self.prompt_cache.idle()
            request = super()._next_request(timeout)
            if request is not None and not isinstance(request[1], Control):
                self.prompt_cache.busy()  # from here to the next idle loop, the disk writer waits
                if self.followers.hold(request):
                    return None  # kept aside: the loop goes on with its batch
        else:
            with self._phase(loop_phase(timeout)):
                # One tiny collective a turn: a stop signal on any rank reaches rank 0,
                # and the prompt cache settles what its inserts left rank-local.
                cache = self.prompt_cache
                flags = cache.turn_flags()
                agreed = self._agree.all_max([int(self.lifecycle.signals > 0), *flags])
                if agreed[0] and self._rank == 0:
                    self.lifecycle.stop_asked.set()
                cache.end_turn(agreed[1:])
                request = super()._next_request(timeout)
        if request is None or not isinstance(request[1], Control):
            return request
        self._run_control(request[0], request[1])
        return None

    def _run_control(self, rqueue: Queue, control: Control) -> None:
        if control.kind == "stop":
            self.followers.refuse_all(ServerStopping("the server is stopping; this request "
                                                     "was not started"))
            if not self._is_distributed:
                self.prompt_cache.idle()  # what waited for an idle batch is captured here, on this thread
            self._stop = True
            self.lifecycle.stopped.set()
            rqueue.put(None)
        elif control.kind == "stats":  # every rank's counters, gathered for GET /v1/cache
            self.prompt_cache.share_stats()
            rqueue.put({})
        elif control.kind == "clear":
            try:
                result = self.prompt_cache.clear()
            except Exception as e:  # never into the generation loop
                log.exception("mlx_kvcache: clearing the prompt cache failed")
                result = {"error": f"clearing the prompt cache failed: {e}"}
            rqueue.put(result)

    def command(self, kind: str, timeout: Optional[float] = None) -> Any:
        """Run a `Control` on every rank's generation thread and return rank 0's result;
        waits while the generation thread lives (requests ahead of it run first), at most
        ``timeout`` seconds (then `TimeoutError`). ``stop`` returns None once the
        generation thread has ended, not when its loop takes the command: mlx-lm's loop
        finishes the turn it took the stop in first."""
        q: Queue = Queue()
        if not self.generation_available():
            raise RuntimeError("the generation thread is not running")
        self.requests.put((q, Control(kind), None))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                result = q.get(timeout=0.1)
                if kind != "stop":
                    return result
                # The rest of that turn can be a round of the batch (an answer the stop
                # cut whose removal the loop had not seen yet): on a sharded model, the
                # model's collectives, which every other rank runs too. Rank 0 exiting
                # before its loop ends would leave them waiting inside one forever.
            except Empty:
                pass
            if not self.generation_available():
                if kind == "stop" and self.lifecycle.stopped.is_set():
                    return None
                raise RuntimeError("the generation thread ended first")
            if deadline is not None and time.monotonic() > deadline:
                what = "end after" if kind == "stop" and self.lifecycle.stopped.is_set() else "take"
                raise TimeoutError(f"the generation thread did not {what} {kind!r} in time")

    # -- answers end properly on a stop -------------------------------------------------------
    def generate(self, request, generation_args, progress_callback=None):
        ticket = Ticket()
        set_ticket(ticket)
        generation_args = self._same_model(generation_args)
        lookup = self._with_lookup(request, generation_args)
        if self.lifecycle.cut.is_set():
            self._refuse(ticket)
        try:
            ctx, response = super().generate(request, generation_args, progress_callback)
        except MemoryRefused as e:  # answered 503 (or 400: it never fits), not mlx-lm's 404
            ticket.refuse(e.status, {"message": str(e), "type": "invalid_request_error",
                                     "param": None, "code": "memory_limit_exceeded"}
                          if isinstance(e, MemoryNeverFits) else None)
            raise
        except ContextTooLong as e:  # the client's to fix: a 400, not mlx-lm's 404
            self.lifecycle.counters.refused(Refusal.CONTEXT)
            ticket.refuse(400, {"message": str(e), "type": "invalid_request_error",
                                "param": "prompt" if request.request_type == "text"
                                else "messages",
                                "code": "context_length_exceeded"})
            raise
        if self.lifecycle.cut.is_set():  # it started just as the stop cut everything
            ctx.stop()
            self._refuse(ticket)
        ticket.started = True
        ticket.ctx = ctx
        parser, ending = self._hearing(request, generation_args, ctx)
        if parser is not None:
            ticket.heard = []
        attach(ctx, lookup)  # usage reads its counters (`lookup_request.lookup_of(ctx)`)
        return ctx, _watched(response, ticket, parser, ending)

    def _hearing(self, request, args, ctx):
        """The output parser a chat answer of mlx-lm's route is read with as it streams
        out (to foresee its next request), and what counts the rendering to come — where
        foresight is on and the answer runs on the served model; else ``(None, None)``."""
        fs = self.prompt_cache.foresight
        served = self._served
        if (not fs.enabled or served is None or request.request_type != "chat"
                or self.model_provider.model_key != served.key):
            return None, None
        return served.parser(request.tools, ctx.initial_state, list(args.stop_words)), fs.expect

    def render_chat(self, messages: List[Dict[str, Any]], tools: Optional[List[Any]],
                    template_kwargs: Optional[Dict[str, Any]] = None) -> Optional[List[int]]:
        """The prompt mlx-lm's chat route makes of ``messages`` (a chat body's, with its
        ``tools`` and ``chat_template_kwargs``) on the served model: its tokenizing's
        rendering (mlx-lm's message processing, the chat template with the server's
        template arguments); None for a model without a chat template, or images (their
        rows are the processor's). Any thread: it renders, runs nothing."""
        served = self.served_model()
        tok = served.tokenizer
        if not tok.has_chat_template:
            return None
        msgs = copy.deepcopy(list(messages))
        if process_message_content(msgs, keep_images=served.processor is not None):
            return None
        kwargs = dict(self.cli_args.chat_template_args or {})
        kwargs.update(template_kwargs or {})
        return list(tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, **kwargs))

    def _with_lookup(self, request, args) -> RequestLookup:
        """The request's `RequestLookup`, put on its generation arguments ``args`` (its
        sampler carries it on either path; `lookup_request.lookup_of(args)` reads it)."""
        lookup = RequestLookup(self._lookup_tokens(request, args))
        attach(args, lookup)
        return lookup

    def _lookup_tokens(self, request, args) -> int:
        """How many tokens a round of this request's prompt lookup may verify: its own
        ``prompt_lookup_num_tokens`` or the server's. 0 (off) with ``--no-prompt-lookup``;
        on a sharded model, where how long a round is follows the time each rank measures
        its passes (the ranks would step their collectives differently); for XTC
        sampling, whose one coin per call would tie the positions of a round; and for
        sampling with a seed, which asks for the same answer every time: a round draws its
        samples together, as many as it verifies, which is timed — the answer would have
        the model's distribution but not the seed's samples."""
        cli = self.cli_args
        if not getattr(cli, "prompt_lookup", True) or self._is_distributed:
            return 0
        sampling = args.sampling  # (mlx-lm's GenerationArguments)
        if sampling.xtc_probability or (args.seed is not None and sampling.temperature):
            return 0
        own = request.prompt_lookup_num_tokens if isinstance(request, MarkedRequest) else None
        return int(getattr(cli, "prompt_lookup_num_tokens", DEFAULT_MOST)) if own is None else own

    @staticmethod
    def _refuse(ticket: Ticket) -> None:
        ticket.refuse(503)
        raise ServerStopping("the server is stopping; this request was not started")

    def _await_response(self, response_queue):
        ticket = current_ticket()
        while True:
            if ticket is not None and self.lifecycle.cut.is_set():
                if ticket.started:  # the answer ends here: mlx-lm's handler sends its end
                    ticket.cut = True
                    return None
                self._refuse(ticket)
            if ticket is not None and ticket.started and ticket.left is not None \
                    and ticket.left.is_set():
                return None  # its client left: mlx-lm's handler ends it (``ctx.stop()``)
            try:
                return response_queue.get(timeout=0.1)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None
                if ticket is not None and ticket.keepalive is not None:
                    try:
                        ticket.keepalive()  # a streamed answer silent for an interval
                    except (BrokenPipeError, ConnectionResetError):
                        if ticket.started or ticket.left is None:
                            raise
                        # Its client left while it waited to be taken: it ends as soon as
                        # it starts (above), as a client that leaves later ends it.
                        ticket.left.set()
                        ticket.keepalive = None

