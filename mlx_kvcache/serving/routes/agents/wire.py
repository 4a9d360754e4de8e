"""The HTTP side of both agent routes: a request body read, a `Route` (the API's parser,
answer builder and error shape) run over the bridge, and the answer sent whole or as
server-sent events.

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
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from .. import body as body_reader
from ..handler import (KEEPALIVE_ENV, KEEPALIVE_S, keepalive_interval, send_json,
                       watch_client)
from ..namespace import request_namespace
from . import foresight
from .bridge import NOTHING as _NOTHING, run_chat
from .call import AgentRequestError, ChatCall, Event

__all__ = ["SSE", "Answer", "Route", "read_body", "serve", "send_json", "KEEPALIVE_S",
           "KEEPALIVE_ENV", "keepalive_interval"]


#: A stream event: its name and its JSON data.
SSE = Tuple[str, Dict[str, Any]]


class Answer(Protocol):
    """One answer in an API's shape, fed the bridge's events (a route's builder)."""

    def start(self) -> List[SSE]:
        """The stream's opening events."""

    def feed(self, ev: Event) -> List[SSE]:
        """The stream events ``ev`` makes; an ``"error"`` event is the API's closing
        failure."""

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The status and body of the non-streamed answer, once every event was fed."""


@dataclass(frozen=True)
class Route:
    """What one agent API puts around the bridge: ``parse`` (a request body to a
    `ChatCall`, `AgentRequestError` naming the problem), ``answer`` (the builder of one
    answer, from the handler, the body and the events), ``error`` (an `AgentRequestError` in the
    API's error shape), ``headers`` (extra headers on every reply), ``follow`` (the
    request body the client sends after an answer — the body, the answer's whole body,
    and a stand-in text for what the client adds: each tool call's result, or the next
    user message after a text answer —, or None: no `foresight`), ``keepalive`` (what a
    silent stream writes every `keepalive_interval`) and ``stream_error`` (a refusal as
    stream events, for a request refused after its stream's headers went out)."""

    parse: Callable[[Any], ChatCall]
    answer: Callable[[Any, Any, Any], Answer]
    error: Callable[[AgentRequestError], Dict[str, Any]]
    headers: Callable[[], Dict[str, str]] = dict
    follow: Optional[Callable[[Dict[str, Any], Dict[str, Any], str],
                              Optional[Dict[str, Any]]]] = None
    keepalive: bytes = b": keep-alive\n\n"
    stream_error: Optional[Callable[[AgentRequestError], List[SSE]]] = None


def read_body(handler) -> Any:
    """The request's JSON body (an object); `AgentRequestError` naming the problem when it
    has none, is over the server's cap or the body budget (413), shorter than its
    Content-Length, late (408), not JSON, nested too deeply, or holds a string no tokenizer
    can encode (`body`); 503 when the body budget has no room for it now."""
    try:
        raw = body_reader.read_raw(handler)
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
    return b"".join(f"event: {k}\ndata: {json.dumps(d)}\n\n".encode() for k, d in batch)


def serve(handler, route: Route, run: Optional[Callable[..., Any]] = None) -> None:
    """Answer one agent request on ``handler`` (the live `CacheAPIHandler`, admitted, its
    body unread): read the body, ``route.parse`` it, run it (``run``: `run_chat`, given
    ``waiting``, called every interval until mlx-lm takes the request), and send the
    answer whole or streamed (``"stream": true``); the call's cache namespace is the
    request's (`namespace`: ``cache_salt``, the header, or the API key). Bad input is a
    reply in the route's error shape, never an exception; a client gone mid-answer ends
    the generation."""
    headers = route.headers()
    every = keepalive_interval()
    stream = _Stream(handler, headers, route.keepalive)
    try:
        body = read_body(handler)
        call = route.parse(body)
        try:
            call.namespace = request_namespace(body, handler.headers, handler.by_api_key())
        except ValueError as e:
            raise AgentRequestError(str(e), param="cache_salt") from None
        waiting = stream.keepalive if isinstance(body, dict) and body.get("stream") else None
        events = (run or run_chat)(handler, call, waiting=waiting, every=every)
    except AgentRequestError as e:
        if not stream.opened:
            return send_json(handler, e.status, route.error(e), headers)
        batch = route.stream_error(e) if route.stream_error else []
        return stream.write(_sse(batch)) if batch else None
    except (BrokenPipeError, ConnectionResetError):
        return  # the client left while the request waited
    ended = []  # the answer's end, once seen: the session's next prompt is foreseen

    def on_done(ev: Event) -> None:
        if route.follow is not None and ev.finish_reason != "length" and \
                foresight.expecting(handler):
            ended.append(ev)
    answer = None
    try:
        answer = route.answer(handler, body, events)
        watched = _Ending(events, on_done)
        if body.get("stream"):
            stream.run(answer, watched, every)
        else:
            _whole(answer, watched, handler, headers, getattr(events, "abandon", None))
    finally:
        events.close()  # a client gone mid-answer ends the generation
        if ended:  # (counted by `foresight.expecting`: `follow` always ends it)
            foresight.follow(handler, route, body, answer, call.namespace)


class _Ending:
    """``events`` (a `ChatEvents` or any iterator), calling ``on_done`` with the ``done``
    event before it is passed on; waits with a timeout as ``events`` does (`_next`)."""

    def __init__(self, events, on_done: Callable[[Event], None]) -> None:
        self._events = events if hasattr(events, "next_event") else iter(events)
        self._on_done = on_done

    def next_event(self, timeout: Optional[float]) -> Any:
        ev = _next(self._events, timeout)
        if ev is not None and ev is not _NOTHING and ev.kind == "done":
            self._on_done(ev)
        return ev


def _next(events, timeout: Optional[float]) -> Any:
    """The next event, `_NOTHING` when none came within ``timeout`` seconds (None: wait
    as long as it takes), or None at the end. ``events``: a `ChatEvents` (it waits with
    a timeout) or any iterator."""
    wait = getattr(events, "next_event", None)
    if wait is not None:
        return wait(timeout)
    return next(events, None)


def _answer_events(events, timeout: Callable[[], Optional[float]] = lambda: None
                   ) -> Iterator[Any]:
    """``events`` up to the first ``done`` or ``error`` (`_NOTHING` each time
    ``timeout()`` seconds pass without one); an ``error`` when they end without either."""
    events = events if hasattr(events, "next_event") else iter(events)
    while True:
        ev = _next(events, timeout())
        if ev is None:
            break
        yield ev
        if ev is not _NOTHING and ev.kind in ("done", "error"):
            return
    yield Event("error", text="the answer ended early")


def _whole(answer: Answer, events, handler, headers: Dict[str, str],
           abandon: Optional[Callable[[], None]] = None) -> None:
    """The answer sent whole once ``events`` end; meanwhile the connection is watched, and
    a client that leaves has ``abandon`` called (`ChatEvents.abandon`: the generation
    stops) and gets nothing."""
    done, left = threading.Event(), threading.Event()
    watch_client(handler, done, left, abandon)
    try:
        for ev in _answer_events(events):
            if ev is not _NOTHING and ev.kind != "progress":
                answer.feed(ev)
    finally:
        done.set()
    if left.is_set():  # no one to answer
        handler.close_connection = True
        return
    status, body = answer.whole()
    try:
        send_json(handler, status, body, headers)
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True  # the client left first


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

    def run(self, answer: Answer, events, every: float) -> None:
        def left() -> float:  # until the next keep-alive is due: silence, not events, counts
            return max(0.0, self._written + every - time.monotonic())

        try:
            self.write(_sse(answer.start()))
            for ev in _answer_events(events, left):
                if ev is _NOTHING:
                    self.keepalive()  # nothing written for a whole interval
                elif ev.kind != "progress":
                    self.write(_sse(answer.feed(ev)))
                if left() == 0.0:  # progress reports and empty deltas write nothing
                    self.keepalive()
        except (BrokenPipeError, ConnectionResetError):
            return  # the client left; closing the events ends the generation
