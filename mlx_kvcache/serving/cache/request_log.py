"""What the server says about each request's reuse: one log line per request and the last
few requests in ``GET /v1/cache`` (``recent``), each with where reuse stopped and why
(`mlx_kvcache.prefix.explain`) — so a user sees, for instance, that their client rewrites
a line at the top of its system prompt every turn. A session name and the prompt excerpts
are client text: escaped (`log_text.printable`), so a line is one line.

Bounded and O(1) per request: a fetch is remembered until its request's final insert
(at most `PENDING` at once, the oldest forgotten first), and `RECENT` finished requests
are listed.

``MLX_KVCACHE_REQUEST_LOG=PATH`` (read at start) also appends each finished request to
``PATH`` as one JSON line — its path, session, the prompt's and the answer's token ids, the
tokens read from cache — for benchmarks that replay a session to a cache-perfect reference
(``scripts/bench_agents.py``). Off by default: the ids are the user's prompt.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional

import numpy as np

from ...prefix.explain import Reuse
from ...prefix.stats import human_bytes
from ..guards.log_text import printable
from .inflight import Waited

__all__ = ["RequestLog", "RECENT"]

log = logging.getLogger("mlx_kvcache")

#: Finished requests listed by ``GET /v1/cache``.
RECENT = 16
#: Fetches remembered while their requests run.
PENDING = 256
#: The environment variable naming the JSON-lines file of finished requests' token ids.
TOKEN_LOG_ENV = "MLX_KVCACHE_REQUEST_LOG"


@dataclass
class _Fetch:
    prompt: np.ndarray
    matched: int
    cached: int
    path: str
    reuse: Optional[Reuse]
    started: float
    from_disk: Optional[int] = None  # of the cached tokens, read back from disk (a disk tier)
    session: Optional[str] = None  # the client's session name (an agent route's)
    foreseen: int = 0  # of the cached tokens, computed ahead for it (`foresight`)
    waited: Optional[Waited] = None  # it was held for a prefix in flight (`inflight`)


class RequestLog:
    """Fetches waiting for their request's end, and the last `RECENT` requests."""

    def __init__(self) -> None:
        self._pending: "OrderedDict[int, _Fetch]" = OrderedDict()
        self._seq = itertools.count(1)
        self.recent: Deque[Dict[str, Any]] = deque(maxlen=RECENT)
        self._token_log = os.environ.get(TOKEN_LOG_ENV) or None

    def fetched(self, prompt, matched: int, cached: int, path: str,
                reuse: Optional[Reuse], from_disk: Optional[int] = None,
                session: Optional[str] = None, foreseen: int = 0,
                waited: Optional[Waited] = None) -> None:
        """A request's fetch (``from_disk``: None without a disk tier; ``session``: the
        client's session name, if it gave one; ``foreseen``: cached tokens that were
        computed ahead for it, in idle time; ``waited``: it was held for a prefix another
        request was computing)."""
        self._pending[next(self._seq)] = _Fetch(np.asarray(prompt, dtype=np.int64), matched,
                                               cached, path, reuse, time.time(), from_disk,
                                               session, int(foreseen), waited)
        while len(self._pending) > PENDING:
            self._pending.popitem(last=False)

    def final_of(self, tokens) -> Optional[int]:
        """The pending fetch whose prompt ``tokens`` extend (then this insert is that
        request's final one: prompt + answer), or None. The newest match is taken (a
        request's own fetch is the newest one with its prompt). Each pending fetch is
        screened in O(1) (length, first and last token) and only a match compared whole,
        vectorised."""
        toks = np.asarray(tokens, dtype=np.int64)
        for key in reversed(self._pending):  # newest first; usually the last one
            p = self._pending[key].prompt
            n = len(p)
            if n and len(toks) >= n and toks[n - 1] == p[n - 1] and toks[0] == p[0] \
                    and np.array_equal(toks[:n], p):
                return key
        return None

    def finished(self, key: int, tokens, held: int, max_bytes: int,
                 rank: Optional[int] = None, extra: str = "",
                 disk_bytes: Optional[int] = None,
                 decoding: Optional[Dict[str, int]] = None) -> None:
        """The request of the pending fetch ``key`` (`final_of`) ended with ``tokens``
        (prompt + answer): log its line and list it (``decoding``: its proposals and
        forward passes, listed as they are)."""
        f = self._pending.pop(key, None)
        if f is None:  # forgotten: more than `PENDING` requests were in flight
            return
        n = len(f.prompt)
        answer = len(tokens) - n
        where = f"rank {rank} | " if rank is not None else ""
        line = (f"[cache] {where}prompt {n} tok | cached {f.cached} | prefilled "
                f"{n - f.cached} | answer {answer} tok | held {human_bytes(held)} of "
                f"{human_bytes(max_bytes)}")
        if f.from_disk is not None:
            line += f" | from disk {f.from_disk}"
        if f.foreseen:
            line += f" | computed ahead {f.foreseen}"
        if f.waited is not None:
            line += f.waited.note(f.cached)
        if disk_bytes is not None:
            line += f" | disk {human_bytes(disk_bytes)}"
        line += extra
        if f.session is not None:  # client text: one line, no terminal escapes
            line += f" | session {printable(f.session[:64])}"
        if f.reuse is not None and f.reuse.kind != "hit":
            line += f" | {printable(f.reuse.line())}"
        log.info(line)
        entry: Dict[str, Any] = {"time": round(f.started, 3), "path": f.path,
                                 "prompt_tokens": n, "cached_tokens": f.cached,
                                 "matched_tokens": f.matched, "answer_tokens": answer}
        if f.from_disk is not None:
            entry["disk_tokens"] = f.from_disk
        if f.foreseen:
            entry["foreseen_tokens"] = f.foreseen
        if f.waited is not None:
            entry["in_flight"] = {"waited_seconds": round(f.waited.seconds, 3),
                                  "shared_tokens": max(0, f.cached - f.waited.restored),
                                  "released": f.waited.how}
        if f.session is not None:
            entry["session"] = f.session
        if f.reuse is not None:
            entry["reuse"] = f.reuse.as_dict()
        if decoding is not None:
            entry["decoding"] = dict(decoding)
        self.recent.append(entry)
        if self._token_log is not None:
            ids = np.asarray(tokens, dtype=np.int64)
            with open(self._token_log, "a") as out:  # one line per request, appended whole
                out.write(json.dumps({**{k: entry[k] for k in ("time", "path", "cached_tokens")},
                                     "session": f.session, "prompt": ids[:n].tolist(),
                                     "answer": ids[n:].tolist()}) + "\n")

    def listing(self) -> List[Dict[str, Any]]:
        """The last requests, oldest first (a copy)."""
        return [dict(e) for e in self.recent]
