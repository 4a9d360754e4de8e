"""Slow and idle clients, bounded: deadlines for a request's head and body, a cap on open
connections below the descriptor limit, and loopback clients served while others hold
connections open.

The standard library's HTTP server (mlx-lm's) gives every connection a thread and reads
the request line and headers with no timeout; mlx-lm caps the process at 2,048 file
descriptors. So ~2,100 connections that each send half a request line made ``accept()``
fail for every client, the accept loop spinning. Here (`limited`: the server class; the
handler's side in `Connection`):

* at start the descriptor limit's soft value is raised to its hard one where the system
  allows (`raise_descriptor_limit`), and at most ``--max-connections`` connections are
  open at once, by default well below it (`default_max_connections`);
* a new connection past the cap takes the place of the connection that has waited longest
  for its request line and headers (it gets a 503 and is closed) — a client that sends
  its request at once is past its headers within milliseconds, so a crowd of idle
  connections only ever evicts itself; with none to evict the new one gets the 503;
* connections from other machines hold at most the cap less a share kept for loopback
  clients (`LOOPBACK_SHARE`), so local agents are served whatever a LAN client holds;
* the request line and headers must arrive within ``--header-timeout`` seconds of the
  connection (a 408, then closed), the body within ``--body-timeout`` seconds of its
  headers — a deadline for the whole of each, not a timeout per read (`Connection.reader`);
* should ``accept()`` still run out of descriptors, the longest-waiting connection is
  evicted and the loop pauses (`BACKOFF_S`) instead of spinning.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .admin import is_loopback
from .body_budget import BodyBudget, BodyHold

__all__ = ["ConnectionLimits", "Connection", "DeadlinePassed", "Evicted", "limited", "refuse",
           "raise_descriptor_limit", "default_max_connections", "HEADER_TIMEOUT",
           "BODY_TIMEOUT", "LOOPBACK_SHARE", "BACKOFF_S"]

log = logging.getLogger("mlx_kvcache")

#: Seconds a connection has for its request line and headers (``--header-timeout``).
HEADER_TIMEOUT = 30.0
#: Seconds a request has for its whole body once its headers are in (``--body-timeout``).
BODY_TIMEOUT = 60.0
#: The part of the connection cap kept for loopback clients.
LOOPBACK_SHARE = 1 / 8
#: Descriptors left beside the connections (model files, the disk tier, logs, pipes).
_SPARE_DESCRIPTORS = 512
#: The most connections by default (each holds a thread).
_MOST = 1024
#: Seconds the accept loop pauses when ``accept()`` finds no descriptor left.
BACKOFF_S = 0.05
#: Seconds a refusal (503, 408) may take to write before the connection is closed anyway.
_REFUSAL_WRITE_S = 1.0


class DeadlinePassed(ConnectionError):
    """The connection's deadline for what it was reading (its head, its body) passed."""


class Evicted(ConnectionError):
    """The server closed this connection for a newer one (it was waiting for its head)."""


def raise_descriptor_limit() -> Tuple[int, int]:
    """Raise the soft limit on open files to the hard one, where the system allows (mlx-lm
    sets it to 2,048, the hard one to 4,096); returns (soft, hard) as they now are."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # the system said no: the soft limit stays
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def default_max_connections(soft_limit: int) -> int:
    """The connection cap for a process allowed ``soft_limit`` open files: that less the
    descriptors the rest of the server uses, at most 1,024, at least 16."""
    if soft_limit == resource.RLIM_INFINITY:
        return _MOST
    return max(16, min(_MOST, int(soft_limit) - _SPARE_DESCRIPTORS))


@dataclass(frozen=True)
class ConnectionLimits:
    """What `limited` enforces: ``max_connections`` open at once (``loopback_share`` of
    them kept for loopback clients) and ``header_timeout`` seconds for a request's line
    and headers (None: no deadline). (The body's deadline is the request's to start:
    `Connection.body_started`.)"""

    max_connections: int
    header_timeout: Optional[float] = HEADER_TIMEOUT
    loopback_share: float = LOOPBACK_SHARE

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @property
    def others_max(self) -> int:
        """The most connections clients off loopback may hold together."""
        return max(1, self.max_connections - max(1, int(self.max_connections
                                                        * self.loopback_share)))


class Connection:
    """One open connection as the server tracks it: whether its peer is loopback, whether
    it is still reading its head (evictable), its deadline, and the reader its handler
    reads through (`reader`)."""

    def __init__(self, sock: socket.socket, loopback: bool, header_timeout: Optional[float],
                 hold: Optional[BodyHold] = None) -> None:
        self.sock = sock
        self.loopback = loopback
        self.opened = time.monotonic()
        #: Reading the request line and headers (a new connection past the cap may evict it).
        self.in_head = True
        self.evicted = False
        self.expired = False
        self.header_timeout = header_timeout
        self._deadline: Optional[float] = (None if header_timeout is None
                                           else self.opened + header_timeout)
        #: This request's share of the body budget (given back when the connection ends).
        self.hold = hold
        #: When the body must be in, and reserved (`body_started`).
        self.body_by: Optional[float] = None

    # -- the handler's side --------------------------------------------------------------
    def reader(self, buffer_size: int = io.DEFAULT_BUFFER_SIZE) -> io.BufferedReader:
        """A buffered reader of the connection that keeps its deadline: each read waits at
        most until it, then raises `DeadlinePassed` (`Evicted` once the server closed it)."""
        return io.BufferedReader(_DeadlineReader(self), buffer_size
                                 if buffer_size > 0 else io.DEFAULT_BUFFER_SIZE)

    def head_late(self) -> None:
        """The request line and headers missed their deadline: a 408, and closed."""
        self.refuse(408, f"the request line and headers did not arrive within "
                         f"{self.header_timeout:g} s of the connection (--header-timeout)")

    def head_read(self) -> None:
        """The request line and headers are in: no longer evictable, no deadline until
        the body's (`body_started`)."""
        self.in_head = False
        self._deadline = None

    def body_started(self, seconds: Optional[float]) -> None:
        """The body is read from now: it must be in, and its reservations made
        (`reserve`), within ``seconds`` (None: no deadline)."""
        self.body_by = None if seconds is None else time.monotonic() + seconds
        self._deadline = self.body_by

    def body_read(self) -> None:
        """The body is in: reads have no deadline (a client may send its next request
        early, or close: the answer's watch sees it)."""
        self._deadline = None

    def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more of the body budget for this request, waiting until the
        body's deadline (`BudgetExceeded`, `BudgetBusy`: see `body_budget`); nothing
        without a budget."""
        if self.hold is not None:
            self.hold.grow(nbytes, self.body_by)

    def ended(self) -> None:
        """The connection is closed: its reservation goes back to the budget."""
        if self.hold is not None:
            self.hold.release()

    def refuse(self, status: int, message: str) -> None:
        """`refuse` this connection; the handler's thread, if it waits on a read, wakes."""
        refuse(self.sock, status, message)

    # -- the reader's --------------------------------------------------------------------
    def recv_into(self, buf) -> int:
        """Receive into ``buf`` (bytes received; 0: the peer closed), waiting at most until
        the deadline in force (`DeadlinePassed`, and ``expired`` set); `Evicted` once the
        server closed the connection for another."""
        if self.evicted:
            raise Evicted("the server closed this connection for a newer one")
        deadline = self._deadline
        if deadline is None:
            self.sock.settimeout(None)
            n = self.sock.recv_into(buf)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                raise DeadlinePassed("the deadline passed")
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(buf)
            except (socket.timeout, TimeoutError):
                self.expired = True
                raise DeadlinePassed("the deadline passed") from None
            finally:
                try:
                    self.sock.settimeout(None)  # writes block as before
                except OSError:
                    pass
        if n == 0 and self.evicted:
            raise Evicted("the server closed this connection for a newer one")
        return n


def refuse(sock: socket.socket, status: int, message: str) -> None:
    """Write a JSON refusal (``{"error": message}``) on ``sock`` in at most
    `_REFUSAL_WRITE_S`, best effort (the client may be gone or not reading), and shut it
    down for reading and writing."""
    reason = {408: "Request Timeout", 503: "Service Unavailable"}.get(status, "Error")
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    try:
        sock.settimeout(_REFUSAL_WRITE_S)
        sock.sendall(head + body)
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _DeadlineReader(io.RawIOBase):
    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        return self._conn.recv_into(buf)


class _Registry:
    """The open connections (`Connection`), under a lock: admission at the cap, eviction
    of the one longest in its head."""

    def __init__(self, limits: ConnectionLimits, budget: Optional[BodyBudget]) -> None:
        self.limits = limits
        self.budget = budget
        self._lock = threading.Lock()
        self._open: Dict[int, Connection] = {}  # by the socket's id
        self.evicted = 0
        self.refused = 0

    def of(self, sock: Any) -> Optional[Connection]:
        with self._lock:
            return self._open.get(id(sock))

    def admit(self, sock: socket.socket, address: Any) -> Optional[Connection]:
        """The new connection's `Connection`, or None when it must be refused (the cap
        reached and nothing to evict); evicts where that makes room."""
        loopback = is_loopback(address[0] if isinstance(address, tuple) else None)
        with self._lock:
            live = [c for c in self._open.values() if not c.evicted]
            others = sum(1 for c in live if not c.loopback)
            full = len(live) >= self.limits.max_connections
            if not loopback and others >= self.limits.others_max:
                victim = self._longest_in_head(live, loopback_too=False)
            elif full:
                victim = self._longest_in_head(live, loopback_too=True)
            else:
                victim = None
            if (full or (not loopback and others >= self.limits.others_max)) and victim is None:
                self.refused += 1
                return None
            if victim is not None:
                victim.evicted = True
                self.evicted += 1
            conn = Connection(sock, loopback, self.limits.header_timeout,
                              self.budget.hold(loopback) if self.budget is not None else None)
            self._open[id(sock)] = conn
        if victim is not None:
            victim.refuse(503, "too many connections: this one waited longest for its request "
                               "and was closed for a newer one")
        return conn

    @staticmethod
    def _longest_in_head(live, loopback_too: bool) -> Optional[Connection]:
        heads = [c for c in live if c.in_head and (loopback_too or not c.loopback)]
        return min(heads, key=lambda c: c.opened) if heads else None

    def evict_one(self) -> bool:
        """Evict the connection longest in its head (descriptors ran out); whether one was."""
        with self._lock:
            victim = self._longest_in_head([c for c in self._open.values() if not c.evicted],
                                           loopback_too=True)
            if victim is None:
                return False
            victim.evicted = True
            self.evicted += 1
        victim.refuse(503, "the server ran out of connections: this one waited longest for "
                           "its request")
        return True

    def forget(self, sock: Any) -> None:
        with self._lock:
            conn = self._open.pop(id(sock), None)
        if conn is not None:
            conn.ended()

    def counts(self) -> Dict[str, int]:
        with self._lock:
            live = [c for c in self._open.values() if not c.evicted]
            return {"open": len(live), "in_head": sum(1 for c in live if c.in_head),
                    "loopback": sum(1 for c in live if c.loopback),
                    "evicted": self.evicted, "refused": self.refused}


def limited(server_class: type, limits: ConnectionLimits,
            budget: Optional[BodyBudget] = None) -> type:
    """``server_class`` (a threading HTTP server class, mlx-lm's) with ``limits``
    enforced: its instances track every connection (``connections.of(sock)``: the
    handler's `Connection`, with its share of ``budget``) and admit, evict and refuse as
    the module doc says."""

    class LimitedServer(server_class):
        block_on_close = False  # (daemon threads: nothing to join at close)

        def __init__(self, *args, **kwargs) -> None:
            self.connections = _Registry(limits, budget)
            super().__init__(*args, **kwargs)

        def get_request(self):
            try:
                return super().get_request()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # No descriptor for it: make one free and pause, rather than spin on
                    # a listening socket that stays readable.
                    self.connections.evict_one()
                    time.sleep(BACKOFF_S)
                raise

        def verify_request(self, request, client_address) -> bool:
            if self.connections.admit(request, client_address) is not None:
                return super().verify_request(request, client_address)
            refuse(request, 503, f"too many connections (at most {limits.max_connections} at "
                                 "once, --max-connections); try again")
            return False

        def shutdown_request(self, request) -> None:
            self.connections.forget(request)
            super().shutdown_request(request)

        def handle_error(self, request, client_address) -> None:
            if isinstance(sys.exc_info()[1], OSError):
                return  # the client went away, or was closed under its thread: no traceback
            super().handle_error(request, client_address)

    LimitedServer.__name__ = LimitedServer.__qualname__ = f"Limited{server_class.__name__}"
    return LimitedServer
