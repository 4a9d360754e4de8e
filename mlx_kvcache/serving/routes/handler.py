"""mlx-lm's HTTP handler plus ``GET /v1/cache`` (what the prompt cache holds, as JSON),
``DELETE /v1/cache`` (drop it, in memory and on disk, on every rank, before answering) and
``GET /metrics`` (the same counters for Prometheus: `metrics`; the admin route's rules).

Every other route is mlx-lm's, CORS headers included, or one of the ``POST`` routes the
app hands the handler (`PostRoute`: the agent APIs). Ours add: the admin route's access
rules (`admin`), a 400 for request fields that would end mlx-lm's generation thread
(`validation`), a refusal before the answer starts in its own status and OpenAI's error
shape where mlx-lm would answer 404 (a prompt over the model's context: 400
``context_length_exceeded``; memory: 503, or 400 when it never fits), and the stop (`lifecycle`): a
request that arrives while the server stops gets a 503; an answer the stop cuts short ends
with ``finish_reason: "length"``.

Streams are never silent for longer than `keepalive_interval`, from the moment the request
is accepted: a ``: keepalive`` comment goes out whenever nothing was written for an
interval while the answer waits — to be taken (the memory guard's line, a sequential
request ahead of it: the stream's headers go out with the first comment, and a refusal
after that is an ``error`` event in the stream), for its next token (a slow token rate; a
tool call, which mlx-lm writes only once it closes). The generator calls the request's
`Ticket.keepalive` as it waits. The agent routes keep their own streams alive
(`agents.wire`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from mlx_lm.server import APIHandler

from ...generation.model_pair import vocab_size
from ..engine.requests import MarkedRequest
from ..engine.lookup_request import lookup_tokens, with_predictions
from ..guards.admin import AdminPolicy
from ..guards.connections import Connection, DeadlinePassed, Evicted
from ..guards.context import served_context
from ..guards.images import ImagePolicy, image_urls, url_problem
from ..guards.counters import Refusal
from ..guards.lifecycle import current_ticket, set_client_watch, set_stream_waiting, set_ticket
from ..guards.validation import body_problem
from . import body, metrics
from .model_names import DEFAULT, ModelRefusal, model_entry, models_listing, refusal, resolve
from .namespace import request_namespace
from .sessions import agent_of, chat_session


#: The longest a streamed answer stays silent, in seconds: clients' idle timeouts are
#: longer (Anthropic's API pings about this often; agent clients give up after 10 s or more).
KEEPALIVE_S = 5.0
#: The environment variable that sets another interval (seconds, positive; tests lower it).
KEEPALIVE_ENV = "MLX_KVCACHE_KEEPALIVE_S"


def keepalive_interval() -> float:
    """`KEEPALIVE_S`, or the positive number of seconds `KEEPALIVE_ENV` names."""
    raw = os.environ.get(KEEPALIVE_ENV)
    if raw:
        try:
            v = float(raw)
        except ValueError:
            v = 0.0
        if v > 0:
            return v
    return KEEPALIVE_S


class _TimedWriter:
    """A stream's ``wfile`` that remembers when it was last written to."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.written = time.monotonic()

    def write(self, data) -> int:
        n = self._raw.write(data)
        self.written = time.monotonic()
        return n

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


@dataclass(frozen=True)
class PostRoute:
    """A ``POST`` route served beside mlx-lm's (the app hands the handler its table).

    ``serve`` answers one request on the live handler (admitted, its body unread);
    ``refusal`` is the API's error body for a request the handler refuses itself (the
    server stopping), from its message — so each API's error shape is written once, by
    its route."""

    serve: Callable[["CacheAPIHandler"], None]
    refusal: Callable[[str], Dict[str, Any]]
    #: For a path mlx-lm serves too (chat completions): whether this route takes the
    #: request, given its raw body (else mlx-lm's route does); None: it takes every one.
    takes: Optional[Callable[["CacheAPIHandler", bytes], bool]] = None
    #: For a request mlx-lm's route answered on this path: what follows its answer, given
    #: what the answer said (`Ticket.heard`) and the foresight epoch its end counted a
    #: rendering in (it must end that count: foresee the next request, or cancel).
    followed: Optional[Callable[["CacheAPIHandler", list, int], None]] = None


log = logging.getLogger("mlx_kvcache")


#: The most request body read (and dropped) before refusing a request.
_DRAIN_LIMIT = 64 << 20
#: Seconds ``GET /v1/cache`` on a sharded model waits for the ranks' counters (the
#: generation thread gathers them between two steps; a long step answers with the last).
STATS_WAIT = 10.0


def send_json(handler, status: int, body: Dict[str, Any],
              headers: Optional[Dict[str, str]] = None) -> None:
    """One JSON reply with ``headers`` (no others: mlx-lm's CORS headers are its routes' own)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()


class _ErrorBody:
    """A handler's ``wfile`` for one refusal: mlx-lm writes its error body as
    ``{"error": text}``; that one write becomes ``{"error": error}`` (OpenAI's shape:
    ``error`` names the message, type and code; where the refusal has none, it is made
    from the text) — the reply's body, or, ``streamed`` (the stream went out while the
    request waited: `CacheAPIHandler.keep_waiting`), an SSE ``data:`` line, as OpenAI's API
    sends an error inside a stream — and the handler's own ``wfile`` is back."""

    def __init__(self, handler, wfile, error: Optional[Dict[str, Any]],
                 streamed: bool = False) -> None:
        self._handler, self._wfile, self._error = handler, wfile, error
        self._streamed = streamed

    def write(self, data) -> int:
        try:
            body = json.loads(bytes(data))
        except ValueError:  # the status line and headers
            return self._wfile.write(data)
        if not (isinstance(body, dict) and isinstance(body.get("error"), str)):
            return self._wfile.write(data)
        self._handler.wfile = self._wfile
        error = json.dumps({"error": self._error or {
            "message": body["error"], "type": "server_error", "param": None, "code": None}})
        if not self._streamed:
            self._wfile.write(error.encode())
        else:
            self._wfile.write(f"data: {error}\n\n".encode())
            self._wfile.flush()
        return len(data)

    def __getattr__(self, name: str):
        return getattr(self._wfile, name)


#: Seconds between two looks at a watched connection (`watch_client`).
WATCH_EVERY = 0.25


def watch_client(handler, done: threading.Event, left: threading.Event,
                 on_leave: Optional[Callable[[], None]] = None) -> None:
    """Until ``done``, watch the connection of ``handler``'s request while its answer is
    made (a non-streamed answer writes nothing until its end, so no failed write would
    tell that the client left): when the client closes it, set ``left`` and call
    ``on_leave``. The close is seen as nginx sees it, an end of file on a peek; a
    connection that turns readable with data (a client sending its next request early)
    is left alone."""
    conn = getattr(handler, "connection", None)
    if not isinstance(conn, socket.socket):
        return

    def watch() -> None:
        while not done.is_set():
            try:
                readable, _, _ = select.select([conn], [], [], WATCH_EVERY)
                if not readable:
                    continue
                gone = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                continue
            except (OSError, ValueError):  # reset, or closed under us
                gone = True
            if gone and not done.is_set():
                left.set()
                log.info("mlx_kvcache: %s: the client left before its answer; stopping it",
                         handler.path)
                if on_leave is not None:
                    on_leave()
            return

    threading.Thread(target=watch, name="mlx_kvcache-client-watch", daemon=True).start()


class CacheAPIHandler(APIHandler):
    """mlx-lm's handler with ``/v1/cache`` and the routes of ``routes``.

    Args:
        response_generator, system_fingerprint: as mlx-lm's.
        routes: the ``POST`` routes besides mlx-lm's, by path (any query string accepted:
            Claude Code sends ``?beta=true``).
        admin: who may use ``/v1/cache`` (from ``--admin-token`` and ``--host``).
    """

    #: The connection as the server tracks it (`connections.limited`: its deadlines, its
    #: share of the body budget), or None (a server that does not, a captured chat run).
    tracked: Optional[Connection] = None

    def __init__(self, response_generator, *args, routes: Mapping[str, PostRoute] = {},
                 admin: Optional[AdminPolicy] = None, **kwargs) -> None:
        # Set before mlx-lm's __init__, which serves the request.
        self.routes = routes
        self.admin = admin or AdminPolicy.make(None, "127.0.0.1")
        super().__init__(response_generator, *args, **kwargs)

    # -- reading the request: deadlines for its head and body (`connections`) -----------------
    def setup(self) -> None:
        super().setup()
        registry = getattr(self.server, "connections", None)  # (mlx-lm's server has none)
        self.tracked = registry.of(self.request) if registry is not None else None
        if self.tracked is not None:
            self.rfile = self.tracked.reader(self.rbufsize)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if self.tracked is not None:
            self.tracked.head_read()
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except Evicted:
            self.close_connection = True  # (it got its 503 when the server closed it)
        except DeadlinePassed:
            self.close_connection = True
            if self.tracked is not None and self.tracked.in_head:
                self.tracked.head_late()

    # -- admitting requests (a stop refuses new ones) ----------------------------------------
    # Counted per request, not per connection: an idle keep-alive connection waiting for
    # its next request line is no open answer, and a request on it after a stop gets 503.
    def _admitted(self, serve: Callable[[], None], counted: bool = True) -> None:
        """Run ``serve`` as an admitted request, or answer 503 while the server stops
        (``counted``: see `Lifecycle.admit`)."""
        set_ticket(None)
        life = self.response_generator.lifecycle
        if not life.admit(counted):
            return self._refuse_while_stopping()
        try:
            serve()
        finally:
            if counted:
                life.done()

    def _refuse_while_stopping(self) -> None:
        self._drain_body()
        route = self._post_route() if self.command == "POST" else None
        message = "the server is stopping"
        body = route.refusal(message) if route is not None else {"error": message}
        if self._is_cache_route():
            self._send_admin(503, body)
        else:
            self._send_json(503, body)

    def _drain_body(self) -> None:
        # Answering before reading the body makes the kernel reset the connection (unread
        # data at close), and the client may never see the answer. (Within the body's
        # deadline: a client that trickles it is not waited for.)
        try:
            n = min(int(self.headers.get("Content-Length") or 0), _DRAIN_LIMIT)
        except ValueError:
            return
        if self.tracked is not None:
            self.tracked.body_started(body.body_timeout(self))
        try:
            while 0 < n:
                chunk = self.rfile.read1(min(n, 1 << 16))
                if not chunk:
                    return
                n -= len(chunk)
        except (DeadlinePassed, OSError):
            self.close_connection = True
        finally:
            if self.tracked is not None:
                self.tracked.body_read()

    # -- mlx-lm's routes and the agent routes ----------------------------------------------
    def _post_route(self) -> Optional[PostRoute]:
        return self.routes.get(self.path.split("?", 1)[0].rstrip("/"))

    def do_POST(self):
        route = self._post_route()
        if route is None:
            return self._admitted(self._mlx_post)
        if route.takes is None:
            return self._admitted(lambda: route.serve(self))
        self._admitted(lambda: self._shared_path(route))

    def _shared_path(self, route: PostRoute) -> None:
        """A path both mlx-lm and ``route`` serve: the route when it takes the request,
        else mlx-lm's (the body read once, here)."""
        try:
            raw = body.read_raw(self)
        except body.BodyError as e:
            return self._send_json(e.status, {"error": e.message})
        if route.takes(self, raw):
            self.raw_body = raw  # (read once: its bytes are in the body budget already)
            try:
                return route.serve(self)
            finally:
                self.raw_body = None
        self._mlx_post(raw)

    def _mlx_post(self, raw: Optional[bytes] = None) -> None:
        """mlx-lm's ``do_POST`` on a body read here first (`body`): its own read has no
        size cap or timeout, and its parse lets `RecursionError` (deeply nested JSON) and
        `UnicodeDecodeError` escape — no answer, a traceback in the log (its parse error
        logs the raw body, lines and all) — and a lone surrogate reaches its tokenizer (a
        404 with the tokenizer's words). Here the body is parsed first under the body
        budget (`body.parse`), then mlx-lm parses the same bytes again."""
        try:
            raw = body.read_raw(self) if raw is None else raw
            # (reserved in the body budget until the request ends: mlx-lm parses it again,
            # after this parse is dropped)
            where = body.lone_surrogate(raw, body.parse(raw, self))
            if where is not None:
                return self._send_json(400, {"error": body.surrogate_message(where)})
        except body.BodyError as e:
            if e.status < 500:
                self.response_generator.lifecycle.counters.refused(Refusal.BAD_INPUT)
            return self._send_json(e.status, {"error": e.message})
        sock = self.rfile
        self.rfile = io.BytesIO(raw)  # what mlx-lm reads; the connection's stream comes back
        done, left = threading.Event(), threading.Event()
        watch_client(self, done, left)
        set_client_watch(left)  # the generator ends a started answer whose client left
        try:
            super().do_POST()
        except (BrokenPipeError, ConnectionResetError):
            if not left.is_set():
                raise
        finally:
            done.set()
            set_client_watch(None)
            self.rfile = sock
        if left.is_set():
            self.close_connection = True
            ticket = current_ticket()
            log.info("mlx_kvcache: %s: its client left; the answer stopped after %d tokens",
                     self.path, ticket.answered if ticket is not None else 0)

    def do_OPTIONS(self):
        self._admitted(lambda: self._admin_route("OPTIONS") if self._is_cache_route()
                       else self._metrics("OPTIONS") if self._is_metrics_route()
                       else super(CacheAPIHandler, self).do_OPTIONS(), counted=False)

    #: The refusal of a request naming a model this server does not load (`model_names`):
    #: answered 404 in OpenAI's error shape (`_set_completion_headers`).
    model_refusal: Optional[ModelRefusal] = None

    def validate_model_parameters(self) -> None:
        try:
            super().validate_model_parameters()
            self.model_refusal = refusal(self.response_generator.cli_args, self.requested_model,
                                         self.requested_draft_model)
            if self.model_refusal is not None:
                raise ValueError(self.model_refusal.message)
            route = "text" if self.path == "/v1/completions" else "chat"  # mlx-lm's two kinds
            problem = body_problem(route, self.body, self._vocab())
            if problem:
                raise ValueError(problem)
            self.prompt_lookup_num_tokens = lookup_tokens(self.body)
        except ValueError:  # mlx-lm answers it with a 400
            self.response_generator.lifecycle.counters.refused(Refusal.BAD_INPUT)
            raise
        if isinstance(self.stream_options, dict):  # mlx-lm reads the key without a default
            self.stream_options = {"include_usage": False, **self.stream_options}
        self.cache_namespace = request_namespace(self.body, self.headers, self.by_api_key())

    def by_api_key(self) -> bool:
        """Whether a request's API key is its cache namespace (``--cache-namespace-by``)."""
        args = self.response_generator.cli_args
        return args.cache_namespace_by == "api-key"

    # mlx-lm's two request kinds, with the request's cache namespace (`namespace`) and what
    # decoding its images takes.
    def handle_text_completions(self):
        return self._marked(super().handle_text_completions())

    def _marked(self, request, image_bytes: Optional[int] = None):
        chat = request.request_type == "chat"
        # A chat request's session and agent key its foresight (the chat route's answers'
        # next requests are foreseen too): its fetch drops the job foreseen for it.
        session = chat_session(self.body, self.headers) if chat else None
        agent = agent_of(self.headers) if chat else None
        lookup = self.prompt_lookup_num_tokens
        if self.cache_namespace is None and image_bytes is None and session is None \
                and agent is None and lookup is None:
            return request
        return MarkedRequest(request.request_type, request.prompt, request.messages,
                             request.tools, request.role_mapping, session=session,
                             namespace=self.cache_namespace, image_bytes=image_bytes,
                             agent=agent, prompt_lookup_num_tokens=lookup)

    def handle_chat_completions(self):
        # Images: no URL fetched unless the server allows it, none decoded over the pixel
        # cap (`images`; mlx-lm fetches http(s) URLs in its own method, checked after).
        policy = ImagePolicy.of(self.response_generator.cli_args)
        messages = self.body.get("messages")
        for url in image_urls(messages):
            problem = url_problem(url, policy.allow_urls)
            if problem is not None:
                raise ValueError(problem)
        request = super().handle_chat_completions()
        problem, decoding = policy.check(request.messages)  # (each header read once)
        if problem is not None:
            raise ValueError(problem)
        return self._marked(request, decoding if decoding else None)

    def _vocab(self) -> Optional[int]:
        provider = self.response_generator.model_provider
        requested = resolve(provider.cli_args, self.requested_model)  # (mlx-lm set it)
        if requested != DEFAULT and provider.model_key is not None \
                and requested != provider.model_key[0]:
            return None  # another model: checked in the generation thread once loaded
        return vocab_size(provider.model)

    # -- model names (`model_names`: every route answers an unknown name with the served
    # model, and the listing never depends on a Hugging Face cache) ---------------------------
    def handle_models_request(self):
        args = self.response_generator.cli_args
        context = served_context(self.response_generator)
        name = self.path.split("?", 1)[0].rstrip("/")[len("/v1/models"):].lstrip("/")
        if not name:
            return self._send_json(200, models_listing(args, self.created, context))
        entry = model_entry(args, self.created, name, context)
        if entry is None:
            return self._send_json(404, {"error": f"no model {name!r} is served here; "
                                                  f"GET /v1/models lists the served model"})
        self._send_json(200, entry)

    def generate_response(self, text, finish_reason, *args, **kwargs):
        ticket = current_ticket()
        if finish_reason is not None and ticket is not None and ticket.cut:
            finish_reason = "length"  # the stop cut the answer short
        return with_predictions(super().generate_response(text, finish_reason, *args, **kwargs),
                                ticket.ctx if ticket is not None else None)

    def completion_usage_response(self, *args, **kwargs):
        ticket = current_ticket()
        return with_predictions(super().completion_usage_response(*args, **kwargs),
                                ticket.ctx if ticket is not None else None)

    def _set_completion_headers(self, status_code: int = 200):
        ticket = current_ticket()
        if self.opened_early:  # refused after its stream opened: an error event in it
            self.wfile = _ErrorBody(self, self.wfile, ticket.error if ticket is not None
                                    and ticket.refused else None, streamed=True)
            self.close_connection = True
            return
        if status_code == 400 and self.model_refusal is not None:
            status_code = 404  # OpenAI's status for a model it does not serve
            self.wfile = _ErrorBody(self, self.wfile, self.model_refusal.error())
        elif status_code == 404 and ticket is not None and ticket.refused:
            # mlx-lm answers 404 to any error before the answer starts
            status_code = ticket.status
            if ticket.error is not None:  # its body, next, in OpenAI's error shape
                self.wfile = _ErrorBody(self, self.wfile, ticket.error)
        super()._set_completion_headers(status_code)

    #: Whether this request's stream was opened while it waited to be taken (`keep_waiting`).
    opened_early = False
    #: The request's cache namespace (`validate_model_parameters` reads it), None: shared.
    cache_namespace: Optional[str] = None
    #: The request's own ``prompt_lookup_num_tokens`` (`validate_model_parameters` reads
    #: it), None: the server's.
    prompt_lookup_num_tokens: Optional[int] = None
    #: The request's body where it was read before its route ran (a path both mlx-lm and
    #: a route of ours serve); None: the route reads it.
    raw_body: Optional[bytes] = None

    def handle_completion(self, request, stop_words):
        # A streamed answer that waits before mlx-lm takes its request is kept alive too
        # (`keep_waiting`), from the moment it is accepted.
        self.opened_early = False
        self.accepted_at = time.monotonic()
        set_stream_waiting(self.keep_waiting if self.stream else None)
        try:
            return super().handle_completion(request, stop_words)
        finally:
            set_stream_waiting(None)
            self._after_answer()

    def _after_answer(self) -> None:
        """A chat answer whose end counted a foresight rendering (`Ticket.epoch`): its
        route foresees the next request, or the count ends here."""
        ticket = current_ticket()
        if ticket is None or ticket.epoch is None:
            return
        epoch, ticket.epoch = ticket.epoch, None
        route = self._post_route()
        if route is not None and route.followed is not None and not ticket.cut:
            return route.followed(self, ticket.heard or [], epoch)  # (ends the count)
        self.response_generator.prompt_cache.foresight.cancel()

    def keep_waiting(self) -> None:
        """Called while a streamed answer waits: before mlx-lm takes its request (the
        memory guard's line, a sequential request ahead of it), once it has waited a
        keep-alive interval its stream's headers go out with a ``: keepalive`` comment —
        as the agent routes do; a refusal after that is an ``error`` event in the stream,
        not a status (`_set_completion_headers`, `_ErrorBody`) — and then, as for every stream, a
        comment whenever an interval passes in silence (`keep_alive`)."""
        if self.opened_early:
            return self.keep_alive()
        ticket = current_ticket()
        if ticket is not None and ticket.started:
            return  # mlx-lm sends its headers now, and hands the stream to `keep_alive`
        if time.monotonic() - self.accepted_at < keepalive_interval():
            return
        super()._set_stream_headers(200)
        self.end_headers()
        self.opened_early = True
        self.wfile = _TimedWriter(self.wfile)
        self.wfile.write(b": keepalive\n\n")
        self.wfile.flush()

    def _set_stream_headers(self, status_code: int = 200):
        if not self.opened_early:  # (else they went out while the request waited)
            super()._set_stream_headers(status_code)
        ticket = current_ticket()
        if status_code == 200 and ticket is not None:
            if not isinstance(self.wfile, _TimedWriter):
                self.wfile = _TimedWriter(self.wfile)
            ticket.keepalive = self.keep_alive

    def end_headers(self):
        if not self.opened_early:  # (else they went out while the request waited)
            super().end_headers()

    def keep_alive(self) -> None:
        """A ``: keepalive`` comment on this stream when nothing was written to it for
        `keepalive_interval` (called while its answer waits for the next token)."""
        if time.monotonic() - self.wfile.written >= keepalive_interval():
            self.wfile.write(b": keepalive\n\n")
            self.wfile.flush()

    def _send_json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    # -- the admin route ----------------------------------------------------------------------
    def _is_cache_route(self) -> bool:
        return self.path.split("?", 1)[0].rstrip("/") == "/v1/cache"

    def _send_admin(self, status: int, body: Dict[str, Any], headers: Optional[dict] = None) -> None:
        """JSON without mlx-lm's CORS headers: a browser may not read or call this route."""
        send_json(self, status, body, {"Cache-Control": "no-store", **(headers or {})})

    def _admin_route(self, method: str) -> None:
        self._drain_body()
        refusal = self.admin.refusal(method, self.headers, self.client_address[0])
        if refusal is not None:
            status, message, headers = refusal
            return self._send_admin(status, {"error": message}, headers)
        cache = self.response_generator.prompt_cache
        if method == "GET":
            if getattr(self.response_generator, "_is_distributed", False):
                try:  # every rank's counters, gathered now (not at every request)
                    self.response_generator.command("stats", timeout=STATS_WAIT)
                except (RuntimeError, TimeoutError):
                    pass  # those of the last gather
            report = cache.report()
            # Requests not yet taken by the generation thread, and answers open: what an
            # operator waits on before a stop.
            report["queued_requests"] = self.response_generator.requests.qsize()
            report["open_requests"] = self.response_generator.lifecycle.inflight
            return self._send_admin(200, report)
        try:
            result = self.response_generator.command("clear")
        except RuntimeError as e:
            return self._send_admin(503, {"error": f"the cache was not cleared: {e}"})
        body = {**cache.report(), **result}
        if "ranks" in result:  # each rank's counters and what its clear did
            counters = {r.get("rank"): r for r in cache.report().get("ranks", [])}
            body["ranks"] = [{**counters.get(r["rank"], {}), **r} for r in result["ranks"]]
        self._send_admin(500 if result.get("error") else 200, body)

    def do_GET(self):
        self._admitted(lambda: self._admin_route("GET") if self._is_cache_route()
                       else self._metrics("GET") if self._is_metrics_route()
                       else super(CacheAPIHandler, self).do_GET(), counted=False)

    # -- GET /metrics ---------------------------------------------------------------------------
    def _is_metrics_route(self) -> bool:
        return self.path.split("?", 1)[0].rstrip("/") == "/metrics"

    def _metrics(self, method: str) -> None:
        """``GET /metrics``: the prompt cache's `counters_now` in Prometheus's format
        (`metrics`), under the admin route's rules (`admin`: loopback, or the admin
        token; no web page)."""
        self._drain_body()
        refusal = self.admin.refusal(method, self.headers, self.client_address[0],
                                     route="/metrics")
        if refusal is not None:
            status, message, headers = refusal
            return self._send_admin(status, {"error": message}, headers)
        data, content_type = metrics.exposition(
            self.response_generator.prompt_cache.counters_now(), self.headers.get("Accept"))
        self.send_response(200)
        for k, v in (("Content-Type", content_type), ("Content-Length", str(len(data))),
                     ("Cache-Control", "no-store")):
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_DELETE(self):
        self._admitted(self._delete)

    def _delete(self) -> None:
        if not self._is_cache_route():
            self._drain_body()
            return self._send_json(404, {"error": f"no DELETE route {self.path}"})
        self._admin_route("DELETE")
