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

Idle work that never costs a request:

* small chunks: each is sized to take about `YIELD_S` seconds (measured as it runs, at most
  the server's prefill step), and before each one the run asks whether a request is
  waiting and, if so, stores what it computed so far (its end a node with every layer's
  state, so hybrid and sliding-window models restore there exactly) and gives the thread
  back — a request arriving meanwhile waits one such chunk, not a whole prefill step; the
  rest runs at the next idle moment, if still wanted;
* within the budget's room: its working copy of the prefix it restores is the trie's own
  bytes (`LiveSet.shared`: not counted twice), and a job runs only as far as what it
  computes fits the room the budget has now — it never evicts what requests read, and is
  skipped where nothing it would compute could be kept;
* one foreseen prefix per agent (a session's main loop, each of its subagents, each
  thread): a newer one replaces an older one not yet run, and a request of that agent
  drops its pending one (that request *is* the next one); a one-shot request (a title, a
  suggestion) neither offers nor takes one;
* a clear wins: work rendered, queued or running before ``DELETE /v1/cache`` records
  nothing after it (each offer carries the epoch its answer ended in);
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
import time
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
#: Seconds one chunk of idle work should take at most: the longest a request that arrives
#: while foresight computes waits for the thread.
YIELD_S = 0.25
#: The first chunk (before a rate is measured) and the smallest one.
FIRST_CHUNK, MIN_CHUNK = 64, 16


@dataclass
class _Job:
    """A foreseen prefix waiting for idle time: ``tokens`` for the model, ``key`` what
    the trie keys them by (the same but in a cache namespace)."""

    session: str
    tokens: np.ndarray
    #: What the trie keys ``tokens`` by (the same ids but in a cache namespace).
    trie_key: np.ndarray
    #: The model whose vocabulary ``tokens`` are in (None: whichever runs).
    key: Any = None


@dataclass
class _Span:
    """Tokens ``[start, end)`` of ``tokens`` (a trie key) computed ahead for ``session``,
    not yet read."""

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
        #: Bumped by every clear: an offer from an earlier epoch is dropped.
        self.epoch = 0
        self._seconds_per_token: Optional[float] = None  # idle prefill's measured rate
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
        self.no_room = 0      # ... skipped or cut short: what they compute could not be kept
        self.cleared = 0      # ... dropped: a DELETE came after their answer
        self.computed = 0     # tokens computed ahead
        self.used = 0         # ... read by a later request
        self.wasted = 0       # ... not read by the session's next request (or evicted)

    # -- any thread --------------------------------------------------------------------------
    def expect(self) -> int:
        """An answer ended: its next prompt is being rendered (`offer` or `cancel` follows).
        Counted so that a reader of `report` can wait for the work to settle. Returns the
        epoch to offer it in (a clear in between drops the offer)."""
        with self._lock:
            self.rendering += 1
            return self.epoch

    def cancel(self) -> None:
        """The `expect`-ed prefix will not come (rendering failed or was not wanted)."""
        with self._lock:
            self.rendering = max(0, self.rendering - 1)

    def offer(self, session: str, tokens, expected: bool = True, key: Any = None,
              trie_key=None, epoch: Optional[int] = None) -> None:
        """The next prompt of ``session`` starts with ``tokens``: compute what the trie
        lacks of it at the next idle moment (replacing the session's older offer).
        ``expected``: this ends an `expect`. ``key``: the ``model_key`` of the model whose
        vocabulary ``tokens`` are in — `run` drops the job on any other. ``trie_key``: what
        the trie keys ``tokens`` by, when not the tokens themselves (a cache namespace's
        salted ids). ``epoch``: `expect`'s — an offer rendered before a clear is dropped."""
        toks = as_tokens(tokens)
        with self._lock:
            if expected:
                self.rendering = max(0, self.rendering - 1)
            if epoch is not None and epoch != self.epoch:
                self.cleared += 1
                return
            if not self.enabled or not len(toks):
                return
            self.offered += 1
            if self._jobs.pop(session, None) is not None:
                self.replaced += 1
            self._jobs[session] = _Job(session, toks, trie_key=toks if trie_key is None
                                       else as_tokens(trie_key), key=key)
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
                    "no_room": self.no_room, "cleared": self.cleared,
                    "computed_tokens": self.computed,
                    "used_tokens": self.used, "wasted_tokens": self.wasted,
                    "unread_tokens": waiting,
                    "settled": self.rendering == 0 and not self._jobs and self.running is None}

    def clear(self) -> None:
        """The trie was emptied: nothing queued or computed ahead is left (what was not
        read counts as wasted), and what is being rendered now is dropped when offered (a
        new epoch). Generation thread (between two runs: never during one)."""
        with self._lock:
            self.epoch += 1
            self.cleared += len(self._jobs)
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
            stream: Any = None, key: Any = None, per_token: Optional[float] = None) -> None:
        """Compute the queued prefixes, oldest first, while nothing is ``waiting``; chunks of
        at most ``step`` tokens (about `YIELD_S` seconds each), ``waiting()`` asked before
        each. On the thread that runs the model (mlx-lm's generation thread), between
        requests; ``key``: that model's ``model_key`` (a job foreseen for another model — a
        request named another since — is dropped: its ids are another vocabulary);
        ``per_token``: the bytes the caches take per token (the memory guard's measure),
        None: read off the restored caches."""
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
                whole = self._run(manager, pair, job, max(1, int(step)), waiting, stream,
                                  per_token)
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

    def chunk(self, step: int) -> int:
        """Tokens of the next chunk of idle prefill: about `YIELD_S` seconds' worth at the
        rate measured so far, between `MIN_CHUNK` and ``step``."""
        rate = self._seconds_per_token
        n = FIRST_CHUNK if rate is None else int(YIELD_S / max(rate, 1e-9))
        return max(1, min(step, max(MIN_CHUNK, n)))

    def measured(self, tokens: int, seconds: float) -> None:
        """``tokens`` of idle prefill took ``seconds``: the rate the next chunks are sized
        by (a running average)."""
        if tokens <= 0:
            return
        rate = seconds / tokens
        old = self._seconds_per_token
        self._seconds_per_token = rate if old is None else 0.5 * old + 0.5 * rate

    def _run(self, manager, pair, job: _Job, step: int, waiting: Callable[[], bool],
             stream: Any, per_token: Optional[float]) -> bool:
        """One job; False when a waiting request interrupted it (what was computed is kept)."""
        tokens, ids = job.tokens, job.trie_key  # the model's input; the trie's key
        n = len(tokens)
        _, matched = manager.peek(manager.trie.find, ids)
        if n - matched < self.min_gain:
            with self._lock:
                self.skipped += 1
            return True
        # Planned as a request would be (interval checkpoints, the branch point): the next
        # request goes on past this prefix, so no stop is guessed before its end.
        live, plan = manager.checkout(ids, guess_end=False)
        live.shared = live.nbytes  # the restored prefix is the trie's: not counted twice
        start = plan.restored
        # What it computes must fit the budget's room as it stands: it never evicts what
        # requests read (it may evict earlier foreseen nodes: they go first anyway).
        rate = per_token if per_token else (live.nbytes / live.offset if live.offset else None)
        end = n
        if rate:
            end = min(n, start + int(manager.free_bytes / rate))
            if end - max(matched, start) < self.min_gain:
                manager.checkin(live, ids[:start])
                with self._lock:
                    self.no_room += 1
                return True
        pos = start
        try:
            stops = [s for s in plan.stops if start < s < end]
            while pos < end:
                if pos > start and waiting():
                    break
                nxt = min(pos + self.chunk(step), end)
                t0 = time.perf_counter()
                done = sequential.prefill(
                    live, pair, tokens, pos, [s for s in stops if pos < s <= nxt] + [nxt],
                    step=step, checkpoint=lambda at: at < end and at in stops
                    and manager.checkpoint(live, ids[:at]), stream=stream)
                self.measured(done - pos, time.perf_counter() - t0)
                pos = done
        except Exception:  # never into the generation loop; the request path recomputes
            log.exception("mlx_kvcache: computing a foreseen prefix failed")
            manager.checkin(live, ids[:start])
            with self._lock:
                self.failed += 1
            return True
        done = pos
        manager.checkin(live, ids[:done])
        computed = done - start
        first = max(matched, start)
        manager.age(ids[:done], first)
        with self._lock:
            self.computed += computed
            if done > first:
                old = self._spans.pop(job.session, None)
                if old is not None and old.tokens is ids:  # this job's earlier part
                    first = min(first, old.start)
                elif old is not None:  # the session's earlier prefix, never read
                    self.wasted += old.end - old.start
                self._spans[job.session] = _Span(ids, first, done)  # (read against keys)
                while len(self._spans) > SPANS:
                    _, gone = self._spans.popitem(last=False)
                    self.wasted += gone.end - gone.start
            if done >= n:
                self.finished += 1
            elif done >= end:
                self.no_room += 1  # (cut short by the room: not tried again)
            else:
                self.interrupted += 1
        return done >= end


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
