"""The one generation path of the agent routes: a chat call run through mlx-lm's own chat
machinery and our prompt cache, seen as a stream of neutral `Event`s.

Both agent front ends (`anthropic`: ``/v1/messages``; `responses`: ``/v1/responses``)
translate their request into a `ChatCall` (`call`: OpenAI chat-format messages, tools,
limits) and render the events in their API's shape; `wire.serve` is the one driver both
routes run (read the body, parse it, `run_chat`, the answer whole or streamed, errors in
the route's shape).

The seam, and why this one: `run_chat` builds the body of the ``/v1/chat/completions``
request mlx-lm's handler expects (always streamed, with usage) and runs mlx-lm's own
``APIHandler.do_POST`` on it, in a request object of ours (`_ChatRun`, a subclass of the
server's handler) whose output goes to a capturing writer instead of a socket. Each SSE
chunk mlx-lm writes is translated into events as it is written. So every behaviour of the
chat route is the agent routes' too, streaming included, without a copy of its code: the
request checks and defaults (mlx-lm's and our `validation`), the chat template, the
tool-call parser, the reasoning split, stop words, batching, the prompt cache (fetch,
checkpoints, inserts, the log line, ``GET /v1/cache``), the stop's cut (``length``) and
refusal (503). Calling ``ResponseGenerator.generate`` directly would couple less to the
handler's output format but re-implement its sampling defaults, its text state machine loop
and its tool-call formatting; the chunk format the capture reads (OpenAI's chat completion
chunk) is a public wire format, stable by definition.

What the bridge adds before mlx-lm sees the conversation (`conversation`): system messages
stay where the client put them (folded into the adjacent user turn where the model's
template refuses them), the billing line and user-named volatile lines are dropped, and
the rendered prompt's layout — where each message and content part starts — rides along
on the request (`MarkedRequest`): the client's ``cache_control`` breakpoints become
checkpoint offsets, and the prompt cache's miss explanation names the part a request
diverged in. The prompt is rendered and encoded once, in the HTTP thread, for the layout,
with the served model's tokenizer (`_served`: an agent request runs on the served model,
whatever model mlx-lm's provider holds at that moment); its ids ride along too, with the
``model_key`` they were encoded for, and mlx-lm's tokenizing takes them instead of
rendering and encoding it again — on that model only (`MarkedRequest.tokenizer_for`).

Two contracts of the agent APIs are kept here, not in mlx-lm: a conversation that ends with
the assistant's text is rendered open (``continue_final_message``, no generation prompt)
so the answer continues it; and a tool call mlx-lm's parser cannot read comes back as the
model's text instead of vanishing (`_ChatRun._keeping_unread_calls`).

Two things mlx-lm's chunks do not say are recovered here: which stop sequence ended an
answer (mlx-lm reports ``stop`` for an end-of-sequence token and a stop word alike; the
answer's last tokens, kept on the request's `lifecycle.Ticket`, tell them apart, matched
as mlx-lm matches them), and whether the prompt was stored for reuse
(`TriePromptCache.stores_prompts`).

Admission during a stop is the caller's (`CacheAPIHandler._admitted` wraps the route);
mlx-lm's handler runs here on a worker thread (it writes, the front end reads), which ends
when the answer does or, once the front end stops reading (its client left), at the next
write, as a broken connection ends mlx-lm's own route.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from queue import Empty, Queue
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.server import APIHandler

from ...engine.templates import (REASONING_SWITCHES, answer_extends_prompt, honours_thinking,
                                 reasoning_switches, system_policy)
from ...engine.generator import MarkedRequest, ServedModel
from ...guards.context import ContextTooLong, answer_tokens, explicit_max_tokens, served_context
from ...guards.images import ImagePolicy, decode_bytes, inline
from ...guards.memory import MemoryRefused
from ...guards.lifecycle import current_ticket
from ..handler import KEEPALIVE_S, CacheAPIHandler
from . import conversation
from .call import AgentRequestError, ChatCall, Event, Usage

__all__ = ["ChatEvents", "NOTHING", "run_chat", "count_tokens", "prompt_ids", "served_model",
           "served_key"]

#: What `ChatEvents.next_event` returns when no event came in time.
NOTHING = object()

log = logging.getLogger("mlx_kvcache")


def served_model(handler) -> str:
    """The name of the model the server serves (what answers any model name)."""
    provider = handler.response_generator.model_provider
    key = getattr(provider, "model_key", None)
    if key and key[0]:
        return str(key[0])
    return str(getattr(provider.cli_args, "model", None) or "default_model")


# -- preparing a call ------------------------------------------------------------------------
@dataclass
class _Prepared:
    messages: List[Dict[str, Any]]   # what mlx-lm renders
    tools: Optional[List[Dict[str, Any]]]
    layout: "conversation.Layout"
    template_args: Dict[str, Any]    # the chat template's arguments it was rendered with
    model: ServedModel               # whose tokenizer rendered and encoded it
    marked_end: int = 0              # where the client's last breakpoint ends (0: none)


def _served(generator) -> ServedModel:
    """The model an agent request runs on — the served one (its request names no other) —
    once the generation thread has loaded it (a request that comes first waits, as a chat
    request waits in mlx-lm's queue). Not the tokenizer mlx-lm's provider holds now: a chat
    request naming another local model makes it hold that one's, and a prompt encoded with
    it would run on the served model as ids of another vocabulary."""
    provider = generator.model_provider
    served = getattr(generator, "served", lambda: None)
    while served() is None and provider.tokenizer is None:
        if not generator.generation_available():
            raise AgentRequestError("the model could not be loaded", 503, "overloaded_error")
        time.sleep(0.05)
    # (no served model recorded: no --model; mlx-lm's provider holds the one it runs)
    return served() or ServedModel(provider.model_key, provider.tokenizer, provider.processor)


def _prepare(handler, call: ChatCall) -> _Prepared:
    provider = handler.response_generator.model_provider
    model = _served(handler.response_generator)
    tokenizer = model.tokenizer
    args = provider.cli_args
    base_args = dict(getattr(args, "chat_template_args", None) or {})
    template_args = dict(base_args)
    templated = getattr(tokenizer, "has_chat_template", False)
    if templated and call.thinking is not None:
        if honours_thinking(tokenizer, base_args):
            template_args["enable_thinking"] = call.thinking
        else:
            log.debug("mlx_kvcache: the chat template ignores enable_thinking: the "
                      "request's thinking setting is ignored")
    keep = call.keep_reasoning if call.keep_reasoning is not None else \
        bool(getattr(args, "keep_reasoning", False))
    inline = False
    if templated and keep and getattr(tokenizer, "has_thinking", False):
        switches = reasoning_switches(tokenizer, template_args)
        inline = switches is None
        template_args.update(switches or {})
    breakpoints = list(call.breakpoints)
    route_mark = call.end_mark is not None and call.end_mark not in breakpoints and \
        not answer_extends_prompt(tokenizer, template_args)
    if route_mark:
        breakpoints.append(call.end_mark)
    try:
        conv = conversation.Conversation.from_call(
            call.messages, call.labels, call.part_labels, breakpoints, call.call_breakpoints)
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    conv.drop_lines(conversation.line_filter(
        keep_billing=bool(getattr(args, "keep_billing_header", False)),
        extra=getattr(args, "drop_lines", None)))
    if templated:
        conv.fit_template(system_policy(tokenizer, base_args))
    if inline:
        conv.inline_reasoning(tokenizer.think_start, tokenizer.think_end)
    messages = conv.messages()
    if templated and _continues(messages):
        # Anthropic's prefill contract (and a Responses input that ends with the
        # assistant's text): the answer goes on from the last assistant message — rendered
        # open, with no generation prompt after it (no new turn, no injected <think>).
        template_args["continue_final_message"] = True
    tools = call.tools or None
    try:
        layout = conversation.layout(tokenizer, conv, tools, template_args,
                                     vision=model.processor is not None,
                                     marked_tools=call.tool_breakpoints)
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    problem = ImagePolicy.of(args).problem(messages)  # before anything fetches or decodes
    if problem is not None:
        raise AgentRequestError(problem)
    # The client's breakpoints (not the route's own end mark, at the input's end: after
    # every one of them) say what a request stores for reuse: its usage's cache creation.
    client_cuts = layout.cuts[:-1] if route_mark else layout.cuts
    marked = call.breakpoints or call.tool_breakpoints or call.call_breakpoints
    return _Prepared(messages, tools, layout, template_args, model,
                     max(client_cuts, default=0) if marked else 0)


def _answer_limit(handler, call: ChatCall, prep: _Prepared) -> Optional[int]:
    """The answer's ``max_tokens`` (`context.answer_tokens`: the client's, else the user's
    ``--max-tokens``, else what the context leaves; clamped to what it leaves). A prompt
    over the context is refused here, before any work: Anthropic's message, OpenAI's
    ``context_length_exceeded`` code."""
    generator = handler.response_generator
    try:
        return answer_tokens(served_context(generator), prep.layout.prompt_tokens,
                             call.max_tokens, explicit_max_tokens(generator.cli_args))
    except ContextTooLong as e:
        raise AgentRequestError(str(e), 400, "invalid_request_error",
                                code="context_length_exceeded") from None


def _continues(messages: List[Dict[str, Any]]) -> bool:
    """Whether the conversation ends with assistant text to continue (an assistant
    message last, with text and no tool calls)."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    text = content if isinstance(content, str) else "".join(
        p.get("text") or "" for p in content or () if isinstance(p, dict))
    return last.get("role") == "assistant" and bool(text.strip()) and not last.get("tool_calls")


def _body(call: ChatCall, prep: _Prepared, max_tokens: Optional[int]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"messages": prep.messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    asked = {k: v for k, v in prep.template_args.items()
             if k in ("enable_thinking", "continue_final_message") or k in REASONING_SWITCHES}
    if asked:  # mlx-lm renders as the layout did
        body["chat_template_kwargs"] = asked
    if prep.tools:
        body["tools"] = prep.tools
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if call.stop:
        body["stop"] = list(call.stop)
    for k in ("temperature", "top_p", "top_k"):
        if call.sampling.get(k) is not None:
            body[k] = call.sampling[k]
    return body


def count_tokens(handler, call: ChatCall) -> int:
    """The prompt tokens `run_chat` would give the model for ``call`` (the chat template
    applied as mlx-lm's chat route applies it, each image expanded by the model's image
    processor)."""
    prep = _prepare(handler, call)
    lay, processor = prep.layout, prep.model.processor
    if not lay.images or processor is None:
        return lay.prompt_tokens
    generator = handler.response_generator
    cap = ImagePolicy.of(generator.model_provider.cli_args).max_pixels
    try:
        # The URL forms the message route serves (an allowed http(s) one is fetched here,
        # as mlx-lm's route fetches it), each checked against the pixel cap first; then
        # decoded as the message route decodes them: on the generation thread, once the
        # memory guard admits their decoding.
        lay = replace(lay, images=[inline(u, cap) for u in lay.images])
        return generator.decode(
            lambda: conversation.processed_tokens(prep.model.tokenizer, processor, lay),
            decode_bytes(lay.images))
    except MemoryRefused as e:  # 400 where it never fits, else 503 (retry later)
        raise AgentRequestError(str(e), e.status, "invalid_request_error" if e.status == 400
                                else "overloaded_error") from None
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    except RuntimeError as e:  # the generation thread is gone (the server stops)
        raise AgentRequestError(str(e), 503, "overloaded_error") from None


def prompt_ids(handler, call: ChatCall) -> Optional[List[int]]:
    """The prompt's token ids `run_chat` would give the model for ``call`` (rendered and
    encoded exactly as it would be, by the served model's tokenizer: `served_key`), or
    None where images make them the processor's."""
    ids = _prepare(handler, call).layout.ids
    return None if ids is None else list(ids)


def served_key(handler) -> Any:
    """The ``model_key`` of the model agent requests run on and are encoded for."""
    return _served(handler.response_generator).key


# -- running it through mlx-lm's handler ------------------------------------------------------
class _Closed(BrokenPipeError):
    """The front end stopped reading (its client left)."""


class _Capture(io.RawIOBase):
    """The ``wfile`` of a `_ChatRun`: mlx-lm's SSE chunks, parsed as they are written."""

    def __init__(self, run: "_ChatRun") -> None:
        super().__init__()
        self._run = run
        self._buf = b""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._run.closed:
            raise _Closed("the client of this answer left")
        data = bytes(data)
        if self._run.status not in (None, 200):
            self._run.error_body += data
            return len(data)
        self._buf += data
        while b"\n\n" in self._buf:
            chunk, self._buf = self._buf.split(b"\n\n", 1)
            self._run.chunk(chunk.decode("utf-8"))
        return len(data)


class _ChatRun(CacheAPIHandler):
    """One chat call, served by mlx-lm's ``do_POST`` as if it came over HTTP, with its
    output captured (never constructed by ``BaseHTTPRequestHandler``: no socket)."""

    stream_keepalive = False  # the route's own writer keeps its stream alive (`wire`)

    @classmethod
    def make(cls, handler, body: Dict[str, Any], prep: _Prepared, call: ChatCall) -> "_ChatRun":
        run = cls.__new__(cls)
        raw = json.dumps(body).encode()
        run.response_generator = handler.response_generator
        run.routes, run.admin = {}, handler.admin  # (mlx-lm's chat route only)
        run.system_fingerprint = handler.system_fingerprint
        run.created = handler.created
        run.client_address = handler.client_address
        run.server = handler.server
        run.command, run.path, run.request_version = "POST", "/v1/chat/completions", "HTTP/1.1"
        run.requestline = f"POST /v1/chat/completions HTTP/1.1 (for {handler.path})"
        run.route = handler.path.split("?", 1)[0]
        run.headers = {"Content-Length": str(len(raw)), "Origin": None}
        run.rfile = io.BytesIO(raw)
        run.wfile = _Capture(run)
        run.prep, run.call = prep, call
        run.events: "Queue[Optional[Event]]" = Queue()
        run.status = None
        run.started = threading.Event()
        run.closed = False
        run.error_body = b""
        run.finish: Optional[str] = None
        run.usage: Optional[Dict[str, Any]] = None
        run.ended = False
        run.calls = 0  # tool calls the answer returned
        run.prompt_tokens = prep.layout.prompt_tokens
        run.cached_tokens: Optional[int] = None
        run.ctx = None
        return run

    # -- what mlx-lm's handler calls -----------------------------------------------------------
    def handle_chat_completions(self):
        request = super().handle_chat_completions()
        lay = self.prep.layout
        # The prompt was rendered and encoded once, for its layout: mlx-lm takes those ids.
        return MarkedRequest(request.request_type, request.prompt, request.messages,
                             request.tools, request.role_mapping, cuts=list(lay.cuts),
                             marks=list(lay.marks), session=self.call.session,
                             tokens=lay.ids, template_kwargs=dict(self.prep.template_args),
                             reasoning_budget=self.call.reasoning_budget,
                             namespace=self.call.namespace,
                             model_key=self.prep.model.key,
                             image_bytes=getattr(request, "image_bytes", None))

    def send_response(self, code, message=None) -> None:
        self.status = code

    def send_header(self, keyword, value) -> None:
        pass

    def end_headers(self) -> None:
        ctx = getattr(current_ticket(), "ctx", None)  # this thread's request (`generate`)
        if ctx is not None:
            self.ctx = ctx
            self.prompt_tokens = len(ctx.prompt)
            if ctx.prompt_cache_count >= 0:  # the batch path fetched already
                self.cached_tokens = ctx.prompt_cache_count
            if ctx.tool_parser is not None:
                ctx.tool_parser = self._keeping_unread_calls(ctx.tool_parser)
        self.started.set()

    def _keeping_unread_calls(self, parse):
        """mlx-lm's tool-call parser, except that a call it cannot read (mlx-lm would drop
        it with a warning, and a parse without a name or arguments would end the answer)
        comes back as the model's text — its markup as generated — and is logged; the
        answer's stop reason then follows what is returned (`_done`). The seam: the
        request's `GenerationContext.tool_parser`, which mlx-lm's handler calls on each
        call's text just before it writes the chunk that follows it."""
        tok = self.response_generator.model_provider.tokenizer
        start, end = tok.tool_call_start or "", tok.tool_call_end or ""

        def parse_or_keep(text, tools):
            try:
                parsed = parse(text, tools)
                calls = parsed if isinstance(parsed, list) else [parsed]
                if calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                 and "arguments" in c for c in calls):
                    return parsed
                problem = "it names no function and arguments"
            except Exception as e:  # noqa: BLE001 - whatever the parser raises
                problem = f"{type(e).__name__}: {e}"
            closed = _closed(tuple(getattr(current_ticket(), "last_tokens", ()) or ()),
                             tok.tool_call_start_tokens, tok.tool_call_end_tokens)
            raw = start + text + (end if closed else "")
            log.warning("mlx_kvcache: a tool call the model's parser cannot read (%s) is "
                        "returned as text: %.200r", problem, raw)
            self.events.put(Event("text", text=raw))
            return []

        return parse_or_keep

    def log_message(self, format, *args) -> None:
        pass

    # -- the captured output ----------------------------------------------------------------------
    def chunk(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith(": keepalive"):
                self.events.put(Event("progress", text=line.split()[-1]))
            elif line.startswith("data: "):
                self._data(line[len("data: "):])

    def _data(self, payload: str) -> None:
        if payload.strip() == "[DONE]":
            self.ended = True
            return self.events.put(self._done())
        msg = json.loads(payload)
        if msg.get("usage") is not None:
            self.usage = msg["usage"]
        for choice in msg.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                self.events.put(Event("reasoning", text=delta["reasoning"]))
            if delta.get("content"):
                self.events.put(Event("text", text=delta["content"]))
            for tc in delta.get("tool_calls") or []:
                self.calls += 1
                fn = tc.get("function") or {}
                self.events.put(Event("tool_call", tool_call={
                    "id": tc.get("id"), "name": fn.get("name"),
                    "arguments": fn.get("arguments") or "{}"}))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.last_tokens = tuple(getattr(current_ticket(), "last_tokens", ()) or ())

    def _done(self) -> Event:
        u = self.usage or {}
        prompt = int(u.get("prompt_tokens") or 0)
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        usage = Usage.split(prompt, cached, self.prep.marked_end, self.stores(),
                            int(u.get("completion_tokens") or 0))
        finish, which = self.finish or "stop", None
        if finish == "tool_calls" and not self.calls:  # the calls came back as text
            finish = "stop"
        if finish == "stop" and self.call.stop:
            which = _stop_word(self.prep.model.tokenizer,
                               self.call.stop, getattr(self, "last_tokens", ()))
            if which is not None:
                finish = "stop_sequence"
        return Event("done", finish_reason=finish, stop_sequence=which, usage=usage)

    def stores(self) -> bool:
        """Whether the prompt cache stores the prompts it computes."""
        cache = getattr(self.response_generator, "prompt_cache", None)
        return bool(getattr(cache, "stores_prompts", lambda: False)())

    def fetched(self) -> Optional[int]:
        """What the prompt cache restored for this prompt, once its fetch ran: waits for it
        (the batch path fetches before the answer starts, the sequential path right after),
        bounded by progress — None when the answer produced events or ended first."""
        while self.cached_tokens is None:
            ctx = self.ctx
            if ctx is not None and ctx.prompt_cache_count >= 0:
                self.cached_tokens = ctx.prompt_cache_count
            elif ctx is None or self.events.qsize() or self.closed:
                return None  # (an event says the generation moved on: the end has usage)
            else:
                time.sleep(0.002)
        return self.cached_tokens

    # -- the worker thread ------------------------------------------------------------------------
    def serve(self) -> None:
        try:
            APIHandler.do_POST(self)  # mlx-lm's route, with this handler's overrides
            if not self.started.is_set():
                self.status = self.status or 500
            if self.status == 200 and not self.ended and not self.closed:
                self.events.put(Event("error", text="the answer ended early"))
        except _Closed:
            ticket = current_ticket()
            log.info("mlx_kvcache: %s: its client left; the answer stopped after %d tokens",
                     self.route, getattr(ticket, "answered", 0))
        except Exception as e:  # never into the HTTP thread unsaid
            log.exception("mlx_kvcache: an agent request failed")
            if self.status == 200 and self.started.is_set():
                self.events.put(Event("error", text=f"the answer failed: {e}"))
            else:
                self.status = 500
                self.error_body = json.dumps({"error": str(e)}).encode()
        finally:
            self.started.set()
            self.events.put(None)

    def refusal(self) -> AgentRequestError:
        try:
            err = json.loads(self.error_body.decode() or "{}").get("error") or ""
        except (ValueError, AttributeError):
            err = self.error_body.decode(errors="replace")
        code = err.get("code") if isinstance(err, dict) else None  # (OpenAI's shape)
        msg = err.get("message") if isinstance(err, dict) else err
        msg = str(msg or f"the request failed (HTTP {self.status})")
        if self.status == 503 or "generation thread" in msg:
            return AgentRequestError(msg, 503, "overloaded_error")
        if self.status in (400, 404):  # mlx-lm answers 404 to what failed its tokenizing
            return AgentRequestError(msg, 400, "invalid_request_error", code=code)
        return AgentRequestError(msg, 500, "api_error")


def _closed(last: Tuple[int, ...], start, end) -> bool:
    """Whether the tool call the answer's last tokens ``last`` opened last (``start``) was
    closed (``end``), i.e. it was not cut off by the token limit."""
    def rfind(seq) -> int:
        seq = tuple(seq or ())
        for i in range(len(last) - len(seq), -1, -1):
            if seq and last[i:i + len(seq)] == seq:
                return i
        return -1
    return rfind(end) > rfind(start)


def _stop_word(tokenizer, stops: List[str], last: Tuple[int, ...]) -> Optional[str]:
    """The stop string whose tokens end ``last`` (how mlx-lm matched it), or None (an end
    of sequence token stopped the answer)."""
    if not last or last[-1] in set(getattr(tokenizer, "eos_token_ids", ()) or ()):
        return None
    for s in stops:
        ids = tuple(tokenizer.encode(s, add_special_tokens=False))
        if ids and tuple(last[-len(ids):]) == ids:
            return s
    return None


def run_chat(handler, call: ChatCall, waiting: Optional[Callable[[], None]] = None,
             every: float = KEEPALIVE_S) -> "ChatEvents":
    """Run ``call`` for the live request ``handler`` (a `CacheAPIHandler`, already
    admitted) and return its events. Raises `AgentRequestError` before anything is
    generated (bad input, the server stopping); afterwards a failure is an ``"error"``
    event. ``waiting``: called every ``every`` seconds while the request waits for
    mlx-lm's generation thread to take it (the memory guard's line, a busy batch) — a
    streamed answer's keep-alive; what it raises ends the request. Closing the iterator
    early (the client left) stops the generation."""
    prep = _prepare(handler, call)
    run = _ChatRun.make(handler, _body(call, prep, _answer_limit(handler, call, prep)), prep,
                        call)
    worker = threading.Thread(target=run.serve, name="mlx_kvcache-agent", daemon=True)
    worker.start()
    try:
        while not run.started.wait(every if waiting is not None else None):
            waiting()
    except BaseException:
        run.closed = True  # the worker ends at its next write
        raise
    if run.status != 200:
        worker.join()
        raise run.refusal()
    return ChatEvents(run)


class ChatEvents:
    """The events of one answer (an iterator; `close` it to stop early; `next_event`
    waits with a timeout). Known before the first event: ``prompt_tokens``, the prompt's
    length, and ``cached_tokens``, what the prompt cache restored, where it has already
    fetched (else None until `start_usage` waited for the fetch; the ``done`` event's usage
    says it too)."""

    def __init__(self, run: _ChatRun) -> None:
        self._run = run
        self.prompt_tokens: int = run.prompt_tokens
        self.cached_tokens: Optional[int] = run.cached_tokens
        self._ended = False

    def start_usage(self) -> Usage:
        """The prompt's usage before the answer (no output yet), split as the ``done``
        event's is (`Usage.split`): waits for the prompt cache's fetch, which comes before
        any prefill (see `_ChatRun.fetched`)."""
        run = self._run
        cached = run.fetched()
        if cached is not None:
            self.cached_tokens = cached
        return Usage.split(self.prompt_tokens, self.cached_tokens or 0, run.prep.marked_end,
                           run.stores())

    def __iter__(self) -> "ChatEvents":
        return self

    def __next__(self) -> Event:
        ev = self.next_event(None)
        if ev is None:
            raise StopIteration
        return ev

    def next_event(self, timeout: Optional[float]) -> Any:
        """The next event; `NOTHING` when none came within ``timeout`` seconds (None:
        as long as it takes); None once the answer ended."""
        if self._ended:
            return None
        try:
            ev = self._run.events.get(timeout=timeout)
        except Empty:
            return NOTHING
        if ev is None or ev.kind in ("done", "error"):
            self._ended = True
            if ev is None:
                self._run.closed = True
        return ev

    def close(self) -> None:
        self._ended = True
        self._run.closed = True

    def abandon(self) -> None:
        """The client left (safe from any thread): the generation stops at its next step
        (mlx-lm's next write, a token or a prefill progress report, fails) and the events
        end now (`next_event` answers None)."""
        self._run.closed = True
        self._run.events.put(None)
