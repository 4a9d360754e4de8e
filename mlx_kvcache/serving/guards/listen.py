"""Where `mlx-kvcache serve` listens: the address is bound before the model loads, and
listened on once the model is ready.

mlx-lm binds its HTTP server only after the model has loaded, so a port already in use
(8080 is also ``mlx_lm.server``'s default) was found minutes into a start, as a traceback
from a process that then never ended. Binding first finds it before anything loads; the
socket listens (accepts connections) only when the server can answer them, so a client
that connects during the load is refused, as before, rather than left waiting. Any failure
to bind or listen is one `ListenError` naming ``host:port``.
"""

from __future__ import annotations

import errno
import socket
from typing import Any, Callable

__all__ = ["ListenError", "bind", "check", "listen"]


class ListenError(RuntimeError):
    """The server cannot listen on its address (the message names ``host:port`` and why)."""


def where(host: str, port: int) -> str:
    """``host:port`` as a user writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _why(e: OSError) -> str:
    text = (e.strerror or str(e)).rstrip(".")
    text = text[:1].lower() + text[1:]
    if e.errno == errno.EADDRINUSE:
        return f"{text} (another server is listening there: stop it, or choose another --port)"
    if e.errno == errno.EACCES:
        return f"{text} (ports below 1024 need privileges: choose another --port)"
    return text


def _address(host: str, port: int):
    """(family, address) the server binds: the first of ``getaddrinfo``'s answers."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it into range
        raise OSError(errno.EINVAL, "a port is a number from 0 to 65535")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    return family, address


def check(host: str, port: int) -> None:
    """Raise `ListenError` when ``host:port`` cannot be bound now, as `bind` binds it
    (``SO_REUSEADDR``); nothing is kept. For a start that has work to do before `bind`
    (exporting a ``.gguf`` file), so a port in use is said before that work."""
    try:
        family, address = _address(host, port)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise ListenError(f"cannot listen on {where(host, port)}: {_why(e)}") from None


def bind(host: str, port: int, server_class: Any, backlog: int) -> Any:
    """A ``server_class`` instance bound to ``host:port`` but not yet listening.

    Raises `ListenError` when the address does not resolve or cannot be bound (a port in
    use, a privileged port, an address this machine does not have)."""
    try:
        family, address = _address(host, port)
        cls = type("HTTPServer", (server_class,),
                   {"address_family": family, "request_queue_size": backlog})
        # The handler is set by `listen`, when there is something to answer with.
        server = cls(address, None, bind_and_activate=False)
        try:
            server.server_bind()
        except BaseException:
            server.server_close()
            raise
    except OSError as e:
        raise ListenError(f"cannot listen on {where(host, port)}: {_why(e)}") from None
    return server


def listen(server: Any, handler: Callable[..., Any], host: str, port: int) -> None:
    """Start ``server`` (from `bind`) listening, its requests answered by ``handler``.

    Raises `ListenError` (and closes the socket) when it cannot: another process that
    bound the same port with ``SO_REUSEADDR`` may have started listening on it first."""
    server.RequestHandlerClass = handler
    try:
        server.server_activate()
    except OSError as e:
        server.server_close()
        raise ListenError(f"cannot listen on {where(host, port)}: {_why(e)}") from None
