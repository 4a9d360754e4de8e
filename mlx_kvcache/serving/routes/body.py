"""A request body as every route reads it: bounded in size and in time, JSON that cannot
blow the parser's stack, an object, and (for the agent routes) text a tokenizer can encode.

What the standard library raises on hostile bodies is caught here and said as one
`BodyError` (an HTTP status and a message naming the problem), so each route answers it
in its own error shape and the connection never closes on a traceback:

* a ``Content-Length`` over the server's cap (``--max-body-bytes``): 413, unread;
* a body shorter than its ``Content-Length`` (the client closed, or sent nothing more for
  ``--body-timeout`` seconds): 400 — the socket is read with that timeout, never forever;
* bytes that are not UTF-8, or not JSON: 400;
* JSON nested deeper than the parser can recurse (``json.loads`` raises `RecursionError`,
  not `ValueError`, on ``[[[[…`` 100,000 levels deep): 400;
* a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no tokenizer encodes it):
  `lone_surrogate` names the field holding it, on every route (mlx-lm's tokenizer would
  raise in its generation thread, answered with a 404 and the tokenizer's words).
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any, List, Optional, Tuple

__all__ = ["BodyError", "MAX_BODY_BYTES", "BODY_TIMEOUT", "read_raw", "parse", "may_nest_deep",
           "escapes_surrogate", "lone_surrogate", "surrogate_message"]

#: The largest body read by default (``--max-body-bytes``): an agent's whole conversation
#: with a few images fits many times over.
MAX_BODY_BYTES = 64 << 20
#: Seconds a client may pause while sending its body (``--body-timeout``).
BODY_TIMEOUT = 60.0
#: Below this many ``[`` and ``{`` bytes a body cannot nest deep enough to reach the JSON
#: decoder's recursion limit (it recurses once per level; Python's limit is 1,000).
_SHALLOW = 200
#: An escaped UTF-16 surrogate in JSON text (a lone one decodes to an unencodable str;
#: raw UTF-8 bytes cannot hold one: the strict decoder refuses them).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class BodyError(Exception):
    """A body the server will not read on: ``status`` (400, 411, 413) and ``message``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _limits(handler) -> Tuple[int, float]:
    args = getattr(getattr(handler, "response_generator", None), "cli_args", None)
    cap = getattr(args, "max_body_bytes", None)
    timeout = getattr(args, "body_timeout", None)
    return (MAX_BODY_BYTES if cap is None else int(cap),
            BODY_TIMEOUT if timeout is None else float(timeout))


def read_raw(handler) -> bytes:
    """The request body's bytes, read from ``handler.rfile`` (a live request handler) under
    the server's size cap and timeout; `BodyError` otherwise. After a refusal the
    connection is closed (its stream is no longer at a request boundary)."""
    n = handler.headers.get("Content-Length")
    if n is None:
        raise BodyError("a Content-Length header is required", 411)
    try:
        n = int(n)
    except ValueError:
        raise BodyError("the Content-Length header is not an integer") from None
    if n < 0:
        raise BodyError("the Content-Length header is negative")
    cap, timeout = _limits(handler)
    if n > cap:
        handler.close_connection = True
        raise BodyError(f"the request body is {n} bytes; this server takes at most {cap} "
                        "(--max-body-bytes)", 413)
    if n == 0:
        return b""
    conn = getattr(handler, "connection", None)
    before = conn.gettimeout() if isinstance(conn, socket.socket) else None
    if isinstance(conn, socket.socket):
        conn.settimeout(timeout)
    chunks, got = [], 0
    read = getattr(handler.rfile, "read1", handler.rfile.read)
    try:
        while got < n:
            chunk = read(min(n - got, 1 << 20))
            if not chunk:
                break  # the client closed
            chunks.append(chunk)
            got += len(chunk)
    except (TimeoutError, socket.timeout, OSError):
        pass  # it stopped sending: what arrived is counted below
    finally:
        if isinstance(conn, socket.socket):
            try:
                conn.settimeout(before)
            except OSError:
                pass
    if got < n:
        handler.close_connection = True
        raise BodyError(f"the request body ended after {got} of the {n} bytes its "
                        f"Content-Length announced (the client closed, or sent nothing for "
                        f"{timeout:g} s)")
    return b"".join(chunks)


def may_nest_deep(raw: bytes) -> bool:
    """Whether JSON text ``raw`` could nest deep enough to make ``json.loads`` raise
    `RecursionError` (an upper bound: brackets inside strings count too)."""
    return raw.count(b"[") + raw.count(b"{") >= _SHALLOW


def parse(raw: bytes) -> Any:
    """``raw`` as JSON, which must be an object; `BodyError` (400) says why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid JSON: it is not UTF-8 ({e})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BodyError("the request body is not valid JSON here: it nests arrays or objects "
                        "too deeply to parse") from None
    except ValueError as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    return body


def escapes_surrogate(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` escapes a UTF-16 surrogate anywhere (a pair or a lone
    one: only then can `lone_surrogate` find one)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def surrogate_message(where: str) -> str:
    """The 400's message for a lone surrogate at ``where`` (`lone_surrogate`)."""
    return (f"{where} holds a lone UTF-16 surrogate (such as \\ud800): it is not text a "
            "tokenizer can encode")


def lone_surrogate(raw: bytes, body: Any) -> Optional[str]:
    """The path (``messages[2].content[0].text``, ``tools[1].input_schema``) of the first
    string of ``body`` (parsed from ``raw``) holding a lone UTF-16 surrogate, or None.
    Walks the body only when ``raw`` escapes a surrogate at all (pairs are fine)."""
    if not escapes_surrogate(raw):
        return None
    stack: List[Tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return path or "the request body"
        elif isinstance(v, dict):
            for k in reversed(list(v)):
                if not _encodes(k):
                    return f"{path}.{k!r}" if path else repr(k)
                stack.append((f"{path}.{k}" if path else k, v[k]))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", v[i]) for i in reversed(range(len(v))))
    return None


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
