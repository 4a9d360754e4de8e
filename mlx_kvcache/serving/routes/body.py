"""A request body as every route reads it: bounded in size, in time and in what parsing
it may build, JSON that cannot blow the parser's stack, an object, and (for the agent
routes) text a tokenizer can encode.

What the standard library raises on hostile bodies is caught here and said as one
`BodyError` (an HTTP status and a message naming the problem), so each route answers it
in its own error shape and the connection never closes on a traceback:

* a ``Content-Length`` over the server's cap (``--max-body-bytes``): 413, unread;
* a body that has not arrived ``--body-timeout`` seconds after its headers — a deadline
  for the whole body, not a timeout per read (`connections.Connection`): 408; one cut
  short by the client: 400;
* a body whose parse could build more than the body budget lets one request hold
  (``--body-budget``, `body_budget`; `parse_cost` bounds what ``json.loads`` builds from
  the body's size, its characters' width and how many JSON values it can hold): 413,
  unparsed; one that does not fit beside the bodies of the requests running before its
  deadline: 503. The body's bytes are reserved as they arrive, its parse before it runs,
  and both are held until the request ends (its parsed body lives as long);
* bytes that are not UTF-8, or not JSON: 400;
* JSON nested deeper than the parser can recurse (``json.loads`` raises `RecursionError`,
  not `ValueError`, on ``[[[[…`` 100,000 levels deep): 400;
* a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no tokenizer encodes it):
  `lone_surrogate` names the field holding it, on every route (mlx-lm's tokenizer would
  raise in its generation thread, answered with a 404 and the tokenizer's words).

The agent routes read a body with `read_raw` then `parse` (given the handler: its
reservation); mlx-lm's routes with `read_raw`, then `parse` for the checks, then mlx-lm's
own parse of the same bytes, under the same reservation.
"""

from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple, Union

from ...prefix.stats import human_bytes
from ..guards.body_budget import BudgetBusy, BudgetExceeded
from ..guards.connections import BODY_TIMEOUT, Connection, DeadlinePassed

__all__ = ["BodyError", "MAX_BODY_BYTES", "BODY_TIMEOUT", "read_raw", "parse", "parse_cost",
           "body_timeout", "escapes_surrogate", "lone_surrogate", "surrogate_message"]

#: The largest body read by default (``--max-body-bytes``): an agent's whole conversation
#: with a few images fits many times over.
MAX_BODY_BYTES = 64 << 20
#: An escaped UTF-16 surrogate in JSON text (a lone one decodes to an unencodable str;
#: raw UTF-8 bytes cannot hold one: the strict decoder refuses them).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
#: Bytes read (and reserved) at a time.
_CHUNK = 1 << 20
#: What one JSON value can cost parsed, beyond its characters: the object (an empty dict
#: is 64 bytes, a str 49 plus its characters, a float 24), its slot in its container and
#: the container's growth (measured: 37 bytes per value for ``{},`` repeated, 67 for
#: ``{"a":0},``, 53 for ``[[]],``, 65 for ``"ab",``).
_PER_VALUE = 80
#: What any parse costs beside its body (the decoder's frames, one level per nesting).
_BASE = 256 << 10
#: UTF-8 lead bytes of characters past U+00FF (two bytes a character in a str) and past
#: U+FFFF (four bytes).
_WIDE2 = re.compile(rb"[\xc4-\xef]")
_WIDE4 = re.compile(rb"[\xf0-\xf4]")

Raw = Union[bytes, bytearray]


class BodyError(Exception):
    """A body the server will not read on: ``status`` (400, 408, 411, 413, 503) and
    ``message``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _limits(handler) -> Tuple[int, float]:
    args = getattr(getattr(handler, "response_generator", None), "cli_args", None)
    cap = getattr(args, "max_body_bytes", None)
    timeout = getattr(args, "body_timeout", None)
    return (MAX_BODY_BYTES if cap is None else int(cap),
            BODY_TIMEOUT if timeout is None else float(timeout))


def body_timeout(handler) -> Optional[float]:
    """Seconds ``handler``'s request has for its body (``--body-timeout``; None: 0 given,
    no deadline)."""
    timeout = _limits(handler)[1]
    return timeout if timeout > 0 else None


def _tracked(handler) -> Optional[Connection]:
    """The connection ``handler`` (a live request handler) reads through, when the server
    tracks it (`connections.limited`): its deadlines and its share of the body budget."""
    conn = getattr(handler, "tracked", None)
    return conn if isinstance(conn, Connection) else None


def _budget_error(e: Exception, what: str) -> BodyError:
    if isinstance(e, BudgetExceeded):
        return BodyError(f"{what} could take up to {human_bytes(e.nbytes)} in memory; this "
                         f"server lets one request's body take at most {human_bytes(e.limit)} "
                         "(--body-budget)", 413)
    return BodyError(f"the memory for request bodies (--body-budget) is taken by the "
                     f"requests running ({human_bytes(getattr(e, 'held', 0))}); try again", 503)


def read_raw(handler) -> Raw:
    """The request body's bytes, read from ``handler.rfile`` (a live request handler) under
    the server's size cap and its body deadline, each chunk reserved in the body budget
    before it is read; `BodyError` otherwise. After a refusal the connection is closed (its
    stream is no longer at a request boundary)."""
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
    conn = _tracked(handler)
    if conn is not None:
        conn.body_started(body_timeout(handler))
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            want = min(n - got, _CHUNK)
            if conn is not None:
                conn.reserve(want)
            k = handler.rfile.readinto1(view[got:got + want])
            if not k:
                break  # the client closed
            got += k
    except DeadlinePassed:
        handler.close_connection = True
        raise BodyError(f"the request body did not arrive within {timeout:g} s of its headers "
                        f"(--body-timeout): {got} of the {n} bytes its Content-Length "
                        "announced came", 408) from None
    except (BudgetExceeded, BudgetBusy) as e:
        handler.close_connection = True
        raise _budget_error(e, f"the request body ({n} bytes)") from None
    except OSError:
        pass  # the connection failed: what arrived is counted below
    finally:
        view.release()
        if conn is not None:
            conn.body_read()
    if got < n:
        handler.close_connection = True
        raise BodyError(f"the request body ended after {got} of the {n} bytes its "
                        "Content-Length announced (the client closed)")
    return buf


def parse_cost(raw: Raw) -> int:
    """An upper bound of the bytes parsing ``raw`` (UTF-8 JSON) builds, from C-speed scans
    of it, nothing parsed: a copy of the bytes, the decoded text, every string's characters
    (at the widest a character of it can take: escapes such as ``\\ud83d`` can widen
    ASCII; a string with escapes twice, its pieces and their join), `_PER_VALUE` for each
    value the text can hold (one per ``,``, ``:``, ``[`` and ``{``, strings' included)
    and `_BASE`. Checked against tracemalloc on the worst bodies found (tests)."""
    n = len(raw)
    values = raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{") + 1
    if raw.isascii():
        text = 1
    else:
        text = 4 if _WIDE4.search(raw) else 2 if _WIDE2.search(raw) else 1
    # A string with escapes is written into a growing buffer (a quarter over), first as
    # wide as the text, then as wide as its widest character: 4 with \\u escapes, which
    # may name any.
    if b"\\" not in raw:
        strings = n * text
    else:
        strings = n * (text + (4 if b"\\u" in raw else text)) * 5 // 4
    return _BASE + n + n * text + strings + _PER_VALUE * values


def parse(raw: Raw, handler=None) -> Any:
    """``raw`` as JSON, which must be an object; `BodyError` says why not (400, or 413 /
    503 when what parsing it could build is more than the body budget lets ``handler``'s
    request hold / has room for before its deadline: reserved before it runs, held until
    the request ends)."""
    conn = _tracked(handler)
    if conn is not None:
        try:
            conn.reserve(parse_cost(raw))
        except (BudgetExceeded, BudgetBusy) as e:
            raise _budget_error(e, f"parsing this {len(raw)}-byte body") from None
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


def escapes_surrogate(raw: Raw) -> bool:
    """Whether the JSON text ``raw`` escapes a UTF-16 surrogate anywhere (a pair or a lone
    one: only then can `lone_surrogate` find one)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def surrogate_message(where: str) -> str:
    """The 400's message for a lone surrogate at ``where`` (`lone_surrogate`)."""
    return (f"{where} holds a lone UTF-16 surrogate (such as \\ud800): it is not text a "
            "tokenizer can encode")


def lone_surrogate(raw: Raw, body: Any) -> Optional[str]:
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
