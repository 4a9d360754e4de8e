"""Foresight: the next request's prompt, computed while the client is busy.

A thinking model's chat template rewrites history (reasoning is kept only for the turns
after the last user message; tool calls are re-serialised from the client's JSON), so
the prompt an agent sends next is not the last prompt plus the answer as generated: it
diverges inside the last answer, and everything after that point would be computed again
while the client waits. The agent routes know, when an answer ends, what the next prompt
starts with — the conversation, this answer as the client returns it, then the opening of
a tool result or of a user message — and hand those tokens here (`Foresight.offer`). In
the generation thread's idle time (`Foresight.run`, called where the loop has no request
in flight) the part the trie lacks is prefilled and stored as an ordinary cached prefix,
so the next request reads it from the cache. Answers cannot change: the foreseen tokens
are exactly what the template renders, computed by the same chunked prefill as a request.

Lowest priority, bounded, honest:

* chunks of the server's prefill step; before each one the run asks whether a request is
  waiting and, if so, stores what it computed so far (its end a node with every layer's
  state, so hybrid and sliding-window models restore there exactly) and gives the thread
  back; the rest runs at the next idle moment, if still wanted;
* one foreseen prefix per session: a newer one replaces an older one not yet run, and a
  request of the session drops its pending one (that request *is* the next one);
* the nodes it makes are marked least recently used, so the budget evicts them first, and
  they turn ordinary once a request reads them;
* counters for ``GET /v1/cache``: tokens computed ahead, read by a later request
  (``used``), and ``wasted`` — those the session's next request did not read, evicted or
  foreseen wrong (a client that changed what it sent back).

One process only: on the ranks of a sharded model every rank would have to agree on when
to run, a collective per chunk; there it is off (`TriePromptCache` never offers).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy as np

from ...prefix.tokens import as_tokens
from . import sequential

__all__ = ["Foresight"]

log = logging.getLogger("mlx_kvcache")

#: Sessions whose computed span is remembered until their next request (the oldest forgotten).
SPANS = 64
#: Jobs waiting for idle time at most (the oldest dropped: its session went quiet longest).
JOBS = 64


@dataclass
class _Job:
    """A foreseen prefix waiting for idle time."""

    session: str
    tokens: np.ndarray
    #: The model whose vocabulary ``tokens`` are in (None: whichever runs).
    key: Any = None


@dataclass
class _Span:
    """Tokens ``[start, end)`` of ``tokens`` computed ahead for ``session``, not yet read."""

    tokens: np.ndarray
    start: int
    end: int


class Foresight:
    """Foreseen prefixes (one per session), their idle-time prefill and their counters.

    Args:
        enabled: False: `offer` drops everything (``--no-foresight``).
        min_gain: run a job only when the trie lacks at least this many of its tokens.
    """

    def __init__(self, enabled: bool = True, min_gain: int = 1) -> None:
        self.enabled = bool(enabled)
        self.min_gain = max(1, int(min_gain))
        self._lock = threading.Lock()
        self._jobs: "OrderedDict[str, _Job]" = OrderedDict()
        self._spans: "OrderedDict[str, _Span]" = OrderedDict()
        #: Answers whose next prompt is being rendered (`expect` ... `offer` / `cancel`).
        self.rendering = 0
        #: The session whose job the generation thread is computing, if any.
        self.running: Optional[str] = None
        self.offered = 0      # prefixes offered
        self.skipped = 0      # ... that the trie already held (nothing to compute)
        self.finished = 0     # ... computed to their end
        self.interrupted = 0  # runs that gave the thread back to a waiting request
        self.replaced = 0     # ... dropped before they ran (a newer one, or its request came)
        self.failed = 0       # ... whose prefill raised (logged; nothing stored past the restore)
        self.computed = 0     # tokens computed ahead
        self.used = 0         # ... read by a later request
        self.wasted = 0       # ... not read by the session's next request (or evicted)

    # -- any thread --------------------------------------------------------------------------
    def expect(self) -> None:
        """An answer ended: its next prompt is being rendered (`offer` or `cancel` follows).
        Counted so that a reader of `report` can wait for the work to settle."""
        with self._lock:
            self.rendering += 1

    def cancel(self) -> None:
        """The `expect`-ed prefix will not come (rendering failed or was not wanted)."""
        with self._lock:
            self.rendering = max(0, self.rendering - 1)

    def offer(self, session: str, tokens, expected: bool = True, key: Any = None) -> None:
        """The next prompt of ``session`` starts with ``tokens``: compute what the trie
        lacks of it at the next idle moment (replacing the session's older offer).
        ``expected``: this ends an `expect`. ``key``: the ``model_key`` of the model whose
        vocabulary ``tokens`` are in — `run` drops the job on any other."""
        toks = as_tokens(tokens)
        with self._lock:
            if expected:
                self.rendering = max(0, self.rendering - 1)
            if not self.enabled or not len(toks):
                return
            self.offered += 1
            if self._jobs.pop(session, None) is not None:
                self.replaced += 1
            self._jobs[session] = _Job(session, toks, key)
            while len(self._jobs) > JOBS:
                self._jobs.popitem(last=False)
                self.replaced += 1

    def request_for(self, session: Optional[str]) -> None:
        """A request of ``session`` reached the generation thread: it is the next prompt, so
        the session's job not yet run is dropped."""
        if session is None:
            return
        with self._lock:
            if self._jobs.pop(session, None) is not None:
                self.replaced += 1

    def pending(self) -> bool:
        """Whether a job waits for idle time."""
        return bool(self._jobs)

    def report(self) -> Dict[str, Any]:
        """The counters (``GET /v1/cache`` ``foresight``)."""
        with self._lock:
            waiting = sum(s.end - s.start for s in self._spans.values())
            return {"enabled": self.enabled, "rendering": self.rendering,
                    "queued": len(self._jobs), "running": self.running is not None,
                    "offered": self.offered, "skipped": self.skipped,
                    "finished": self.finished, "interrupted": self.interrupted,
                    "replaced": self.replaced, "failed": self.failed,
                    "computed_tokens": self.computed,
                    "used_tokens": self.used, "wasted_tokens": self.wasted,
                    "unread_tokens": waiting,
                    "settled": self.rendering == 0 and not self._jobs and self.running is None}

    def clear(self) -> None:
        """The trie was emptied: nothing queued or computed ahead is left (what was not
        read counts as wasted)."""
        with self._lock:
            self.replaced += len(self._jobs)
            self._jobs.clear()
            self.wasted += sum(s.end - s.start for s in self._spans.values())
            self._spans.clear()

    # -- the generation thread ---------------------------------------------------------------
    def read(self, session: Optional[str], tokens: np.ndarray, restored: int) -> int:
        """A request for ``tokens`` restored ``restored`` of them: how many of those were
        computed ahead (counted ``used``; the rest of the span of ``session``, or of the
        span read, ``wasted``). Called at every fetch."""
        with self._lock:
            if not self._spans:
                return 0
            hit_key, hit = None, 0
            for key, span in self._spans.items():
                n = min(restored, span.end, len(tokens))
                if n <= span.start:
                    continue
                common = _common(tokens[:n], span.tokens[:n])
                if common > span.start:
                    hit_key, hit = key, common - span.start
                    break
            key = hit_key if hit_key is not None else session
            span = self._spans.pop(key, None) if key is not None else None
            if span is None:
                return 0
            self.used += hit
            self.wasted += span.end - span.start - hit
            return hit

    def run(self, manager, pair, step: int, waiting: Callable[[], bool],
            stream: Any = None, key: Any = None) -> None:
        """Compute the queued prefixes, oldest first, while nothing is ``waiting``; chunks of
        ``step`` tokens, ``waiting()`` asked before each. On the thread that runs the model
        (mlx-lm's generation thread), between requests; ``key``: that model's
        ``model_key`` (a job foreseen for another model — a request named another since —
        is dropped: its ids are another vocabulary)."""
        while not waiting():
            with self._lock:
                if not self._jobs:
                    return
                _, job = self._jobs.popitem(last=False)
                if job.key is not None and job.key != key:
                    self.replaced += 1
                    continue
                self.running = job.session
            whole = True  # (a job that raised is not tried again)
            try:
                whole = self._run(manager, pair, job, max(1, int(step)), waiting, stream)
            finally:
                with self._lock:
                    self.running = None
                    if not whole and job.session not in self._jobs:
                        # interrupted: the rest waits for the next idle moment, unless a
                        # newer offer (or the session's request) came meanwhile
                        self._jobs[job.session] = job
                        self._jobs.move_to_end(job.session, last=False)
            if not whole:
                return

    def _run(self, manager, pair, job: _Job, step: int, waiting: Callable[[], bool],
             stream: Any) -> bool:
        """One job; False when a waiting request interrupted it (what was computed is kept)."""
        tokens = job.tokens
        n = len(tokens)
        _, matched = manager.peek(manager.trie.find, tokens)
        if n - matched < self.min_gain:
            with self._lock:
                self.skipped += 1
            return True
        # Planned as a request would be (interval checkpoints, the branch point): the next
        # request goes on past this prefix, so no stop is guessed before its end.
        live, plan = manager.checkout(tokens, guess_end=False)
        start = plan.restored
        pos = start
        try:
            stops = [s for s in plan.stops if start < s < n]
            while pos < n:
                if pos > start and waiting():
                    break
                nxt = min(pos + step, n)
                pos = sequential.prefill(
                    live, pair, tokens, pos, [s for s in stops if pos < s <= nxt] + [nxt],
                    step=step, checkpoint=lambda at: at < n and at in stops
                    and manager.checkpoint(live, tokens[:at]), stream=stream)
        except Exception:  # never into the generation loop; the request path recomputes
            log.exception("mlx_kvcache: computing a foreseen prefix failed")
            manager.checkin(live, tokens[:start])
            with self._lock:
                self.failed += 1
            return True
        done = pos
        manager.checkin(live, tokens[:done])
        computed = done - start
        first = max(matched, start)
        manager.run(_mark_foreseen, manager.trie, tokens[:done], first)
        with self._lock:
            self.computed += computed
            if done > first:
                old = self._spans.pop(job.session, None)
                if old is not None and old.tokens is tokens:  # this job's earlier part
                    first = min(first, old.start)
                elif old is not None:  # the session's earlier prefix, never read
                    self.wasted += old.end - old.start
                self._spans[job.session] = _Span(tokens, first, done)
                while len(self._spans) > SPANS:
                    _, gone = self._spans.popitem(last=False)
                    self.wasted += gone.end - gone.start
            if done >= n:
                self.finished += 1
            else:
                self.interrupted += 1
        return done >= n


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _mark_foreseen(trie, tokens: np.ndarray, first: int) -> None:
    """Make the nodes holding only foreseen tokens (from ``first`` on) the least recently
    used, so the budget evicts them before anything a request touched; the first request
    that reads them touches them like any other."""
    path, matched = trie.find(tokens)
    for node in reversed(path):
        if node.end > matched or node.end <= first:
            break
        if node.start < first:
            # the record merged the foreseen tokens into a short node of the prompt they
            # extend: cut them apart again, so only they go first
            trie.split(node, first)
        node.last_used = 0
        if node.start <= first:
            break
