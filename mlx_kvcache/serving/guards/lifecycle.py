"""The life of a running server: which requests are admitted, and a stop that ends every
answer properly.

A stop (SIGTERM / SIGINT) goes through three moments, all driven by rank 0:

1. ``stopping``: new requests are answered 503; the ones already admitted go on.
2. ``cut``: the grace period is over (or a second signal came): every answer still open
   ends at once with ``finish_reason: "length"`` and ``[DONE]`` (streaming) or a complete
   JSON body; a request that never started gets a 503 JSON error.
3. a ``stop`` command reaches the generation thread of every rank through mlx-lm's own
   request channel, so all ranks leave their loop at the same turn.

`Control` is such a command (also ``clear``: ``DELETE /v1/cache`` on every rank). A
`Ticket` is one HTTP request's view of the stop, kept per handler thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .counters import GuardCounters, Refusal

#: Seconds admitted requests get to finish after a stop signal (``--shutdown-grace``).
DEFAULT_GRACE = 30.0


class ServerStopping(RuntimeError):
    """The server stopped before this request started."""


@dataclass
class Control:
    """A command for the generation thread of every rank, shared like a request."""

    kind: str  # "clear" | "stop"


class Ticket:
    """One HTTP request's standing: whether its answer started streaming, was cut short by
    the stop, or was refused before it started (``status``: the HTTP status it is
    answered with, ``error``: its body in OpenAI's error shape, when mlx-lm's own would
    not do); mlx-lm's ``GenerationContext`` of it (its prompt, what the cache restored);
    the last tokens its answer produced (which stop sequence ended it, if one did) and how
    many it produced; ``left``, set when its client closed the connection
    (`set_client_watch`), None where nothing watches."""

    __slots__ = ("started", "cut", "refused", "status", "error", "ctx", "last_tokens",
                 "answered", "left", "keepalive", "heard", "epoch")

    def __init__(self) -> None:
        self.started = False
        self.cut = False
        self.refused = False
        self.status = 503
        self.error: Optional[dict] = None
        self.ctx = None
        self.last_tokens: tuple = ()
        self.answered = 0
        self.left: Optional[threading.Event] = client_watch()
        #: Called while the request waits — to be taken, then for each next token — where
        #: its answer is streamed (its stream's keep-alive: `set_stream_waiting`).
        self.keepalive: Optional[Callable[[], None]] = stream_waiting()
        #: What the answer said, parsed as it was generated (the model's output parser:
        #: text, reasoning, calls), where a chat answer's next request is foreseen.
        self.heard: Optional[list] = None
        #: The foresight epoch a chat answer's end counted a rendering in (None: none).
        self.epoch: Optional[int] = None

    def refuse(self, status: int, error: Optional[dict] = None) -> None:
        """Mark the request refused before its answer started: the handler answers
        ``status`` (not mlx-lm's 404) with ``error`` as OpenAI's error object, if given."""
        self.refused, self.status, self.error = True, status, error


_local = threading.local()


def current_ticket() -> Optional[Ticket]:
    """The ticket of the request this (handler) thread is serving, if any."""
    return getattr(_local, "ticket", None)


def set_ticket(ticket: Optional[Ticket]) -> None:
    _local.ticket = ticket


def set_client_watch(left: Optional[threading.Event]) -> None:
    """The event set when the client of the request this (handler) thread serves leaves
    (or None): the next `Ticket` made on this thread carries it, and the generator ends
    a started answer whose client left (mlx-lm's non-streamed route writes nothing until
    its end, so no failed write tells it)."""
    _local.client_left = left


def client_watch() -> Optional[threading.Event]:
    """This thread's `set_client_watch` event, if any."""
    return getattr(_local, "client_left", None)


def set_stream_waiting(keepalive: Optional[Callable[[], None]]) -> None:
    """What keeps the stream of the answer this (handler) thread serves alive while it
    waits (or None): the next `Ticket` made on this thread calls it, from before mlx-lm
    takes the request (the memory guard's line, a sequential request ahead of it)."""
    _local.stream_waiting = keepalive


def stream_waiting() -> Optional[Callable[[], None]]:
    """This thread's `set_stream_waiting` keep-alive, if any."""
    return getattr(_local, "stream_waiting", None)


class Lifecycle:
    """What the HTTP side and the generation thread share about stopping.

    Args:
        grace: seconds admitted requests get after a stop signal before they are cut.
        counters: where a request refused while the server stops is counted (the
            server's one `GuardCounters`; None: its own).
    """

    def __init__(self, grace: float = DEFAULT_GRACE,
                 counters: Optional[GuardCounters] = None) -> None:
        self.grace = float(grace)
        self.counters = counters or GuardCounters()
        self.stop_asked = threading.Event()  # by another rank (through rank 0's loop)
        self.stopping = threading.Event()  # new requests are refused
        self.cut = threading.Event()  # open answers end now
        self.stopped = threading.Event()  # the generation loop left on a stop command
        self.signals = 0  # stop signals this process got (other ranks forward theirs)
        self.signalled_at: Optional[float] = None
        self._cv = threading.Condition()
        self._inflight = 0

    # -- signals --------------------------------------------------------------------------
    def on_signal(self) -> None:
        """A stop signal. Only plain assignments: a signal handler must not take a lock
        the interrupted thread may hold; the main thread polls `signals`."""
        self.signals += 1
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    @property
    def asked(self) -> bool:
        """A stop was asked for: a signal here, or on another rank."""
        return self.signals > 0 or self.stop_asked.is_set()

    # -- admitting requests -----------------------------------------------------------------
    def admit(self, counted: bool = True) -> bool:
        """A request starts: True unless the server is stopping. A ``counted`` one (an
        answer, or a DELETE) is open until `done`, and a stop waits for it; reads of the
        server's state are not."""
        with self._cv:
            if self.stopping.is_set():
                if counted:  # (a read of the state, a scrape, is no request refused)
                    self.counters.refused(Refusal.STOPPING)
                return False
            self._inflight += counted
            return True

    def done(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    @property
    def inflight(self) -> int:
        with self._cv:
            return self._inflight

    def wait_idle(self, until: float, interrupt: Callable[[], bool] = lambda: False) -> bool:
        """Wait until no admitted request is open (True), or the monotonic time ``until``
        passes or ``interrupt()`` turns true (False)."""
        with self._cv:
            while self._inflight > 0:
                if time.monotonic() >= until or interrupt():
                    return False
                self._cv.wait(min(max(until - time.monotonic(), 0.0), 0.1))
            return True


def exit_now(code: int) -> None:
    """End this process with ``code`` at once, its log and output written: no interpreter
    exit (MLX's per-thread state can abort one, and a rank out of step with the others
    must not wait on them)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
