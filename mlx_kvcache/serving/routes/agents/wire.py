"""The HTTP side of both agent routes: a request body read, a `Route` (the API's parser,
answer builder and error shape) run over the bridge, and the answer sent whole or as
server-sent events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from ..handler import send_json
from . import foresight
from .bridge import run_chat
from .call import AgentRequestError, ChatCall, Event

__all__ = ["SSE", "Answer", "Route", "read_body", "serve", "send_json"]


#: A stream event: its name and its JSON data.
SSE = Tuple[str, Dict[str, Any]]


class Answer(Protocol):
    """One answer in an API's shape, fed the bridge's events (a route's builder)."""

    def start(self) -> List[SSE]:
        """The stream's opening events."""

    def feed(self, ev: Event) -> List[SSE]:
        """The stream events ``ev`` makes; an ``"error"`` event is the API's closing
        failure."""

    def keepalive(self, ev: Event) -> bytes:
        """What a long prefill's ``"progress"`` event writes on the stream (may be empty)."""

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The status and body of the non-streamed answer, once every event was fed."""


@dataclass(frozen=True)
class Route:
    """What one agent API puts around the bridge: ``parse`` (a request body to a
    `ChatCall`, `AgentRequestError` naming the problem), ``answer`` (the builder of one
    answer, from the handler, the body and the events), ``error`` (an `AgentRequestError` in the
    API's error shape), ``headers`` (extra headers on every reply) and ``follow`` (the
    request body the client sends after an answer — the body, the answer's whole body,
    and a stand-in text for what the client adds: each tool call's result, or the next
    user message after a text answer —, or None: no `foresight`)."""

    parse: Callable[[Any], ChatCall]
    answer: Callable[[Any, Any, Any], Answer]
    error: Callable[[AgentRequestError], Dict[str, Any]]
    headers: Callable[[], Dict[str, str]] = dict
    follow: Optional[Callable[[Dict[str, Any], Dict[str, Any], str],
                              Optional[Dict[str, Any]]]] = None


def read_body(handler) -> Any:
    """The request's JSON body; `AgentRequestError` when it has none or it is not JSON."""
    n = handler.headers.get("Content-Length")
    if n is None:
        raise AgentRequestError("a Content-Length header is required", 411)
    try:
        n = int(n)
    except ValueError:
        raise AgentRequestError("the Content-Length header is not an integer") from None
    raw = handler.rfile.read(n) if n > 0 else b""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AgentRequestError(f"the request body is not valid JSON: {e}") from None


def _sse(batch: Iterable[SSE]) -> bytes:
    return b"".join(f"event: {k}\ndata: {json.dumps(d)}\n\n".encode() for k, d in batch)


def serve(handler, route: Route, run: Optional[Callable[[Any, ChatCall], Any]] = None) -> None:
    """Answer one agent request on ``handler`` (the live `CacheAPIHandler`, admitted, its
    body unread): read the body, ``route.parse`` it, run it (``run``: `run_chat`), and
    send the answer whole or streamed (``"stream": true``). Bad input is a reply in the
    route's error shape, never an exception; a client gone mid-answer ends the generation."""
    headers = route.headers()
    try:
        body = read_body(handler)
        events = (run or run_chat)(handler, route.parse(body))
    except AgentRequestError as e:
        return send_json(handler, e.status, route.error(e), headers)
    ended = []  # the answer's end, once seen: the session's next prompt is foreseen

    def on_done(ev: Event) -> None:
        if route.follow is not None and ev.finish_reason != "length" and \
                foresight.expecting(handler):
            ended.append(ev)
    try:
        answer = route.answer(handler, body, events)
        if body.get("stream"):
            _stream(handler, answer, _ending(events, on_done), headers)
        else:
            _whole(handler, answer, _ending(events, on_done), headers)
    finally:
        events.close()  # a client gone mid-answer ends the generation
        if ended:  # (counted by `foresight.expecting`: `follow` always ends it)
            foresight.follow(handler, route, body, answer)


def _ending(events: Iterable[Event], on_done: Callable[[Event], None]) -> Iterator[Event]:
    """``events``, calling ``on_done`` with the ``done`` event before it is passed on."""
    for ev in events:
        if ev.kind == "done":
            on_done(ev)
        yield ev


def _answer_events(events: Iterable[Event]) -> Iterator[Event]:
    """``events`` up to the first ``done`` or ``error``; an ``error`` when they end
    without either."""
    for ev in events:
        yield ev
        if ev.kind in ("done", "error"):
            return
    yield Event("error", text="the answer ended early")


def _whole(handler, answer: Answer, events, headers: Dict[str, str]) -> None:
    for ev in _answer_events(events):
        if ev.kind != "progress":
            answer.feed(ev)
    status, body = answer.whole()
    send_json(handler, status, body, headers)


def _stream(handler, answer: Answer, events, headers: Dict[str, str]) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.end_headers()

    def write(data: bytes) -> None:
        if data:
            handler.wfile.write(data)
            handler.wfile.flush()

    try:
        write(_sse(answer.start()))
        for ev in _answer_events(events):
            write(answer.keepalive(ev) if ev.kind == "progress" else _sse(answer.feed(ev)))
    except (BrokenPipeError, ConnectionResetError):
        return  # the client left; closing the events ends the generation

