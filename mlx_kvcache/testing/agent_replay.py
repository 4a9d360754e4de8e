"""What an agent session sent, and what a cache-perfect server would have computed for it:
the agents benchmark's reference (``scripts/bench_agents.py --clients``).

* `Recorder`: a pass-through HTTP proxy on loopback between a real client (a CLI) and a
  server. Each request is forwarded as sent and its answer streamed back as it comes (a
  parallel subagent's request goes on while its sibling's does), and recorded as an
  `Exchange`: the arrival time, the path, the headers, the body, and the usage the answer
  reported (whichever API: Anthropic Messages, Responses, chat completions).
* `classify`: which part of the session sent a request — ``main`` (the agent loop),
  ``subagent`` (Claude Code's ``x-claude-code-agent-id``), ``side`` (a one-shot with no tools:
  a title, a suggestion, a next-speaker check).
* `replay_ids`: the recorded generation requests sent again, one at a time in the order
  they arrived, to a server that writes each request's token ids (``MLX_KVCACHE_REQUEST_LOG``,
  `mlx_kvcache.serving.cache.request_log`): each request's prompt and answer as that
  server renders and answers it (the scripted model answers from the ids, so a replay to
  ``mlx-kvcache serve`` gives the live session's ids).
* `perfect`: per request, the tokens a cache-perfect server computes — one request at a
  time, no foresight, every earlier prompt and answer kept: the prompt less its longest
  prefix shared with any earlier request's prompt + answer.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Exchange", "Recorder", "classify", "usage_of", "replay_ids", "perfect",
           "GENERATION_PATHS"]

#: The paths whose requests compute a prompt (count_tokens, models, hello: not).
GENERATION_PATHS = ("/v1/messages", "/v1/chat/completions", "/chat/completions",
                    "/v1/responses")
#: Request headers not forwarded (the proxy speaks its own connection).
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length",
        "accept-encoding", "proxy-connection", "upgrade"}


@dataclass
class Exchange:
    """One request through the `Recorder`: ``started`` / ``ended`` (``time.time()``),
    ``method``, ``path`` (without the query), ``headers`` (lower-case names), ``body``
    (parsed JSON, or None), ``status``, and ``usage`` (`usage_of` the answer: prompt and
    cached tokens, or None where it reported none)."""

    started: float
    method: str
    path: str
    headers: Dict[str, str]
    body: Any
    status: int = 0
    ended: float = 0.0
    usage: Optional[Tuple[int, int]] = None
    answer: str = field(default="", repr=False)

    def as_dict(self) -> Dict[str, Any]:
        """The record as JSON (for the benchmark's logs)."""
        return {"started": self.started, "ended": self.ended, "method": self.method,
                "path": self.path, "headers": self.headers, "body": self.body,
                "status": self.status, "usage": self.usage}

    @property
    def generation(self) -> bool:
        """Whether the request computes a prompt (a generation route, answered 200)."""
        return self.method == "POST" and self.path in GENERATION_PATHS and self.status == 200


def _objects(text: str):
    """Every JSON object in an answer: the whole body, or each SSE ``data:`` line."""
    try:
        yield json.loads(text)
        return
    except ValueError:
        pass
    for line in text.splitlines():
        if line.startswith("data:"):
            try:
                yield json.loads(line[5:].strip())
            except ValueError:
                continue


def usage_of(path: str, answer: str) -> Optional[Tuple[int, int]]:
    """``(prompt tokens, tokens read from cache)`` as the answer on ``path`` reported them
    (the last usage wins; Anthropic's ``input_tokens`` leave out the cache's), or None."""
    merged: Dict[str, Any] = {}

    def visit(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "usage" and isinstance(v, dict):
                    merged.update({a: b for a, b in v.items() if b is not None})
                else:
                    visit(v)
        elif isinstance(o, list):
            for v in o:
                visit(v)

    for o in _objects(answer):
        visit(o)
    if not merged:
        return None
    if path == "/v1/messages":
        read = merged.get("cache_read_input_tokens") or 0
        return (merged.get("input_tokens", 0) + read
                + (merged.get("cache_creation_input_tokens") or 0), read)
    if path == "/v1/responses":
        return (merged.get("input_tokens", 0),
                (merged.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    return (merged.get("prompt_tokens", 0),
            (merged.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Recorder:
    """A recording pass-through proxy to ``upstream`` (``host:port``) on a free loopback
    port (`port`); `exchanges` in arrival order. Use as a context manager or `close`."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.exchanges: List[Exchange] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection; the end closes it

            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                path = self.path.split("?", 1)[0]
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                ex = Exchange(time.time(), self.command, path,
                              {k.lower(): v for k, v in self.headers.items()}, body)
                with recorder._lock:
                    recorder.exchanges.append(ex)
                up = http.client.HTTPConnection(upstream_host, upstream_port, timeout=7200)
                heads = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                heads["Accept-Encoding"] = "identity"
                up.request(self.command, self.path, body=raw or None, headers=heads)
                r = up.getresponse()
                ex.status = r.status
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.end_headers()
                got = bytearray()
                try:
                    while True:
                        chunk = r.read1(65536) if self.command != "HEAD" else b""
                        if not chunk:
                            break
                        got += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client left; the record keeps what came
                finally:
                    up.close()
                    ex.ended = time.time()
                    ex.answer = got.decode(errors="replace")
                    ex.usage = usage_of(path, ex.answer)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def since(self, t: float) -> List[Exchange]:
        """The exchanges that arrived at or after ``t``."""
        with self._lock:
            return [e for e in self.exchanges if e.started >= t]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def classify(ex: Exchange) -> str:
    """``subagent`` (a request carrying Claude Code's ``x-claude-code-agent-id``),
    ``side`` (a one-shot: no tools offered — a title, a suggestion, a next-speaker check)
    or ``main`` (the agent loop)."""
    if "x-claude-code-agent-id" in ex.headers:
        return "subagent"
    body = ex.body if isinstance(ex.body, dict) else {}
    if not body.get("tools"):
        return "side"
    return "main"


def _rows(path: Path) -> List[Dict[str, Any]]:
    """The file's JSON lines, up to the first that does not parse: a line still being
    written is not one yet (a read racing the server's append of a long line has been
    seen to return a newline past a gap in it)."""
    if not path.exists():
        return []
    text = path.read_text()
    out = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def replay_ids(exchanges: Sequence[Exchange], port: int, token_log: Path,
               logged: Optional[Callable[[Callable[[], bool]], None]] = None,
               timeout: float = 7200) -> List[Tuple[List[int], List[int]]]:
    """Each generation exchange sent again to the server on ``port`` (which appends each
    finished request to ``token_log``: ``MLX_KVCACHE_REQUEST_LOG``), one at a time, in
    order; each one's ``(prompt ids, answer ids)`` as that server logged them. The line
    is written at the request's final insert, which may come just after its answer:
    ``logged(ready)`` waits until ``ready()`` (the server's `Watch`, bounded by its
    progress; default: polls for up to a minute)."""
    def wait(ready: Callable[[], bool]) -> None:
        end = time.time() + 60
        while not ready():
            if time.time() > end:
                raise RuntimeError("the replay server logged no line for a request")
            time.sleep(0.02)

    logged = logged or wait
    out = []
    seen = len(_rows(token_log))
    for ex in exchanges:
        heads = {k: v for k, v in ex.headers.items() if k not in _HOP}
        heads["content-type"] = "application/json"
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", ex.path, body=json.dumps(ex.body), headers=heads)
        r = c.getresponse()
        r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"the replay of a {ex.path} request got {r.status}")
        logged(lambda: len(_rows(token_log)) > seen)
        rows = _rows(token_log)
        if len(rows) != seen + 1:
            raise RuntimeError(f"the replay server logged {len(rows) - seen} requests for one")
        seen = len(rows)
        out.append((rows[-1]["prompt"], rows[-1]["answer"]))
    return out


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def perfect(ids: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> List[int]:
    """Per request (``(prompt, answer)`` ids, in order), the prompt tokens a cache-perfect
    server computes: those past the longest prefix the prompt shares with any earlier
    request's prompt + answer (the first request's whole prompt). At least one: a server
    computes the last prompt token to answer."""
    kept: List[np.ndarray] = []
    out = []
    for prompt, answer in ids:
        p = np.asarray(prompt, dtype=np.int64)
        best = max((_common(p, k) for k in kept), default=0)
        out.append(max(1, len(p) - best))
        kept.append(np.concatenate([p, np.asarray(answer, dtype=np.int64)]))
    return out
