"""The HTTP side of both agent routes: a request body read, a `Route` (the API's parser,
answer builder and error shape) run through the front door (`generation.run`: the engine's
typed events), and the answer sent whole or as server-sent events.

A streamed answer is never silent for longer than `handler.keepalive_interval`
(`KEEPALIVE_S`) from the moment the request is accepted — while it waits for the
generation thread (the memory guard's line, a batch), while its prompt is processed, while
it decodes (a slow token rate, a long tool call mlx-lm holds back until it closes): the
writer waits for the next event with that timeout and, when none came, writes the route's
keep-alive
(Anthropic: a ``ping`` event; Responses: an SSE comment line, which every SSE parser
ignores). The stream's headers go out with the first keep-alive, so a request that waits
longer than one interval before mlx-lm takes it is refused, if it then is, in the
stream (the route's ``stream_error``), not with an HTTP status.

The events an answer builder is fed are the engine's (`engine.answer`): `Text`,
`Reasoning`, `CallBegin` / `CallArguments` (a call streaming), `Call`, `CallCut`, and at the
end `Finished` or `Failed`; `Progress` and `Started` are the wire's own business.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Protocol,
                    Tuple)

from ...engine.answer import NOTHING as _NOTHING, Failed, Finished, Progress, Started
from ...guards.counters import Refusal
from .. import body as body_reader
from ..handler import (KEEPALIVE_ENV, KEEPALIVE_S, keepalive_interval, send_json,
                       watch_client)
from ..namespace import request_namespace
from ..sessions import agent_of
from . import foresight
from .call import AgentRequestError, ChatCall
from .generation import Accounting, run as run_call

__all__ = ["SSE", "DONE", "Answer", "Route", "read_body", "serve", "send_json", "KEEPALIVE_S",
           "KEEPALIVE_ENV", "keepalive_interval"]


log = logging.getLogger("mlx_kvcache")

#: A stream event: its name (None: an unnamed ``data:`` line, as OpenAI's chat stream
#: sends) and its JSON data (`DONE`: the chat stream's closing ``[DONE]``).
SSE = Tuple[Optional[str], Any]

#: The data of the chat stream's last line, ``data: [DONE]``.
DONE = "[DONE]"


class Answer(Protocol):
    """One answer in an API's shape, fed the engine's events (a route's builder)."""

    def start(self) -> List[SSE]:
        """The stream's opening events."""

    def feed(self, ev: Any) -> List[SSE]:
        """The stream events ``ev`` makes; a `Failed` event is the API's closing
        failure."""

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The status and body of the non-streamed answer, once every event was fed."""


@dataclass(frozen=True)
class Route:
    """What one agent API puts around the front door: ``parse`` (a request body to a
    `ChatCall`, `AgentRequestError` naming the problem), ``answer`` (the builder of one
    answer), ``error`` (an `AgentRequestError` in the
    API's error shape), ``headers`` (extra headers on every reply), ``follow`` (the
    request body the client sends after an answer — the body, the answer's whole body,
    and a stand-in text for what the client adds: each tool call's result, or the next
    user message after a text answer —, or None: no `foresight`), ``keepalive`` (what a
    silent stream writes every `keepalive_interval`) and ``stream_error`` (a refusal as
    stream events, for a request refused after its stream's headers went out)."""

    parse: Callable[[Any], ChatCall]
    #: The builder of one answer: from the handler, the body, the prompt's usage before the
    #: answer (a callable: it may wait for the prompt cache's fetch) and the `Accounting`.
    answer: Callable[[Any, Any, Callable[[], Any], Accounting], Answer]
    error: Callable[[AgentRequestError], Dict[str, Any]]
    headers: Callable[[], Dict[str, str]] = dict
    follow: Optional[Callable[[Dict[str, Any], Dict[str, Any], str],
                              Optional[Dict[str, Any]]]] = None
    keepalive: bytes = b": keep-alive\n\n"
    stream_error: Optional[Callable[[AgentRequestError], List[SSE]]] = None
    #: The session the request's headers name, where its body names none (or None).
    session: Optional[Callable[[Mapping[str, str]], Optional[str]]] = None


def read_body(handler) -> Any:
    """The request's JSON body (an object); `AgentRequestError` naming the problem when it
    has none, is over the server's cap or the body budget (413), shorter than its
    Content-Length, late (408), not JSON, nested too deeply, or holds a string no tokenizer
    can encode (`body`); 503 when the body budget has no room for it now."""
    try:
        raw = handler.raw_body if handler.raw_body is not None else body_reader.read_raw(handler)
        out = body_reader.parse(raw, handler)  # (reserved in the body budget till the end)
    except body_reader.BodyError as e:
        kind = {413: "request_too_large", 503: "overloaded_error"}.get(
            e.status, "invalid_request_error")
        raise AgentRequestError(e.message, e.status, kind) from None
    where = body_reader.lone_surrogate(raw, out)
    if where is not None:
        raise AgentRequestError(body_reader.surrogate_message(where), param=where)
    return out


def _sse(batch: Iterable[SSE]) -> bytes:
    return b"".join(((f"event: {k}\n" if k is not None else "")
                     + f"data: {d if d is DONE else json.dumps(d)}\n\n").encode()
                    for k, d in batch)


def serve(handler, route: Route, run: Optional[Callable[..., Any]] = None) -> None:
    """Answer one agent request on ``handler`` (the live `CacheAPIHandler`, admitted, its
    body unread): read the body, ``route.parse`` it, run it (``run``: `generation.run`,
    given the generator, the call and ``waiting``, called every interval until the
    generation thread takes the request; it returns the answer's events and its
    `Accounting`), and send the answer whole or streamed (``"stream": true``); the call's
    cache namespace is the request's (`namespace`: ``cache_salt``, the header, or the API
    key). Bad input is a reply in the route's error shape, never an exception; a client
    gone mid-answer ends the generation."""
    headers = route.headers()
    every = keepalive_interval()
    stream = _Stream(handler, headers, route.keepalive)
    generator = handler.response_generator
    try:
        body = read_body(handler)
        call = route.parse(body)
        if call.session is None and route.session is not None:
            call.session = route.session(handler.headers)
        call.agent = agent_of(handler.headers)
        try:
            call.namespace = request_namespace(body, handler.headers, handler.by_api_key())
        except ValueError as e:
            raise AgentRequestError(str(e), param="cache_salt") from None
        waiting = stream.keepalive if isinstance(body, dict) and body.get("stream") else None
        events, acct = (run or run_call)(generator, call, waiting=waiting, every=every)
    except AgentRequestError as e:
        if e.status in (400, 413) and e.code != "memory_limit_exceeded":  # (the memory
            # guard counts its own refusals where it decides them)
            generator.lifecycle.counters.refused(
                Refusal.CONTEXT if e.code == "context_length_exceeded" else Refusal.BAD_INPUT)
        if not stream.opened:
            return send_json(handler, e.status, route.error(e), headers)
        batch = route.stream_error(e) if route.stream_error else []
        return stream.write(_sse(batch)) if batch else None
    except (BrokenPipeError, ConnectionResetError):
        return  # the client left while the request waited
    ended: List[Optional[int]] = []  # the answer's end, once seen: its foresight's epoch
    finished: List[Finished] = []

    def on_done(ev: Finished) -> None:
        finished.append(ev)
        # A one-shot (a title, a suggestion) has no next request to foresee, and no
        # request of another agent takes, settles or replaces the main loop's.
        if route.follow is not None and ev.reason != "length" and not call.one_shot:
            epoch = foresight.expecting(generator)
            if epoch is not None:
                ended.append(epoch)

    def start_usage():
        started = events.started()  # waits for the prompt cache's fetch (no keep-alive
        # is due: the stream writes its opening first, `_Stream.run` waits with a timeout)
        return acct.usage(started.prompt_tokens, started.cached_tokens) if started \
            else acct.usage(events.prompt_tokens, 0)
    answer = None
    try:
        answer = route.answer(handler, body, start_usage, acct)
        watched = _Ending(events, on_done)
        if body.get("stream"):
            left = not stream.run(answer, watched, every, events)
        else:
            left = not _whole(answer, watched, handler, headers, events.close)
        if left:
            log.info("mlx_kvcache: %s: its client left; the answer stopped after %d tokens",
                     handler.path.split("?", 1)[0], events.output_tokens)
    finally:
        events.close()  # a client gone mid-answer ends the generation
        if ended:  # (counted by `foresight.expecting`: `follow` always ends it)
            foresight.follow(generator, route, body, answer, call, ended[0])
        # Retention follows the tree: a one-shot's prompt, and a subagent's once it answers
        # without calls (it reports and is done), go first under the budget.
        if finished and (call.one_shot or (call.agent is not None
                                           and finished[0].reason != "tool_calls")):
            generator.prompt_cache.idle_work.retire(events.prompt)


class Events(Protocol):
    """An answer's events as the wire reads them (`engine.answer.Answer`)."""

    prompt_tokens: int
    output_tokens: int
    ended: bool
    #: The prompt's token ids (as the prompt cache keys them).
    prompt: Any

    def started(self, timeout: Optional[float] = None) -> Optional[Started]:
        """The prompt's usage once known (None: not within ``timeout``, or it ended)."""

    def next_event(self, timeout: Optional[float]) -> Any:
        """The next event, `_NOTHING` when none came within ``timeout`` seconds (None:
        as long as it takes), None at the end."""

    def close(self) -> None:
        """Stop the answer (any thread)."""


class _Ending:
    """``events``, calling ``on_done`` with the `Finished` event before it is passed on."""

    def __init__(self, events: Events, on_done: Callable[[Finished], None]) -> None:
        self._events = events
        self._on_done = on_done

    def next_event(self, timeout: Optional[float]) -> Any:
        ev = self._events.next_event(timeout)
        if isinstance(ev, Finished):
            self._on_done(ev)
        return ev


def _answer_events(events: Events, timeout: Callable[[], Optional[float]] = lambda: None
                   ) -> Iterator[Any]:
    """``events`` up to the first `Finished` or `Failed` (`_NOTHING` each time
    ``timeout()`` seconds pass without one); a `Failed` when they end without either."""
    while True:
        ev = events.next_event(timeout())
        if ev is None:
            break
        yield ev
        if isinstance(ev, (Finished, Failed)):
            return
    yield Failed("the answer ended early")


def _silent(ev: Any) -> bool:
    """Whether ``ev`` writes nothing to the client (the wire's own business)."""
    return isinstance(ev, (Progress, Started))


def _whole(answer: Answer, events: Events, handler, headers: Dict[str, str],
           abandon: Optional[Callable[[], None]] = None) -> bool:
    """The answer sent whole once ``events`` end; meanwhile the connection is watched, and
    a client that leaves has ``abandon`` called (`engine.answer.Answer.close`: the
    generation stops) and gets nothing. False when the client left."""
    done, left = threading.Event(), threading.Event()
    watch_client(handler, done, left, abandon)
    try:
        for ev in _answer_events(events):
            if ev is not _NOTHING and not _silent(ev):
                answer.feed(ev)
    finally:
        done.set()
    if left.is_set():  # no one to answer
        handler.close_connection = True
        return False
    status, body = answer.whole()
    try:
        send_json(handler, status, body, headers)
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True  # the client left first
        return False
    return True


class _Stream:
    """One streamed reply: its headers sent once (at the first keep-alive or event), then
    events and keep-alives."""

    def __init__(self, handler, headers: Dict[str, str], keepalive: bytes) -> None:
        self._handler, self._headers, self._keepalive = handler, headers, keepalive
        self.opened = False
        self._written = time.monotonic()

    def open(self) -> None:
        if self.opened:
            return
        self.opened = True
        h = self._handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        for k, v in self._headers.items():
            h.send_header(k, v)
        h.end_headers()

    def write(self, data: bytes) -> None:
        self.open()
        if data:
            self._handler.wfile.write(data)
            self._handler.wfile.flush()
            self._written = time.monotonic()

    def keepalive(self) -> None:
        """The route's keep-alive (headers first, if not sent yet)."""
        self.write(self._keepalive)

    def run(self, answer: Answer, events: Events, every: float, source) -> bool:
        """Stream ``answer`` fed ``events``; ``source`` (the engine's `Answer`) is asked for
        the prompt's usage first, with keep-alives while its fetch is not known. False when
        the client left."""
        def left() -> float:  # until the next keep-alive is due: silence, not events, counts
            return max(0.0, self._written + every - time.monotonic())

        try:
            while source.started(max(left(), 0.01)) is None and not source.ended:
                self.keepalive()  # the prompt's usage opens the stream: wait for it, alive
            self.write(_sse(answer.start()))
            for ev in _answer_events(events, left):
                if ev is _NOTHING:
                    self.keepalive()  # nothing written for a whole interval
                elif not _silent(ev):
                    self.write(_sse(answer.feed(ev)))
                if left() == 0.0:  # progress reports and empty deltas write nothing
                    self.keepalive()
        except (BrokenPipeError, ConnectionResetError):
            return False  # the client left; closing the events ends the generation
        return True
