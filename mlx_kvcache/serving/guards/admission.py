"""The admission line: mlx-lm's request queue, gated by the memory guard.

mlx-lm's generation thread takes its next request from its request queue; here that queue
is an `AdmissionQueue`, whose ``get`` hands out the first request in line that the
`MemoryGuard` admits (rules 1-4 and 6 of `memory`: never fits, admission, no
head-of-line blocking with bounded unfairness, waiting ends, images decoded only where
their decoding is admitted). An admitted request's answer queue becomes `_Released`, where
its reservation follows what it decodes (rule 5). ``count_tokens`` with images is a
`DecodeJob` in the same line.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from queue import Empty, Queue
from typing import Any, Callable, Deque, List, Optional, Tuple

from mlx_lm.server import GenerationContext, Response

from ...prefix.stats import human_bytes
from .counters import Refusal
from .memory import MemoryGuard, MemoryNeverFits, MemoryRefused, Reservation

__all__ = ["AdmissionQueue", "DecodeJob", "PASS_LIMIT"]

log = logging.getLogger("mlx_kvcache")

#: Seconds the generation thread's blocking ``get`` sleeps between looks at the line.
_POLL = 0.05
#: A waiting request lets at most this many later requests be admitted past it; then
#: nothing behind it goes first (bounded unfairness, no starvation).
PASS_LIMIT = 8


class _Released:
    """A request's answer queue, where its reservation lives: each answer token put
    grows it (`Reservation.decoded`), and a request the guard cuts ends here with
    ``finish_reason: "length"`` (its end put, its context stopped, anything mlx-lm puts
    after that dropped). The reservation is released when the answer ends (its end or
    an error is put) or its client leaves (its context's ``stop``)."""

    def __init__(self, queue: Queue, reservation: Reservation) -> None:
        self._queue, self._res = queue, reservation
        self._stop: Optional[Callable[[], None]] = None
        self._ended = False

    def put(self, item, *args, **kwargs) -> None:
        if self._ended:
            return  # cut: the client has its end already
        if item is None or isinstance(item, BaseException):
            self._res.release()
        elif isinstance(item, GenerationContext):
            stop = self._stop = item.stop  # its client left: the request leaves the batch

            def stopped():
                self._res.release()
                stop()
            item.stop = stopped
        elif isinstance(item, Response) and self._res.decoded() and item.finish_reason is None:
            self._queue.put(replace(item, finish_reason="length"), *args, **kwargs)
            self._ended = True
            self._res.release()
            if self._stop is not None:
                self._stop()  # mlx-lm takes it out of the batch at the end of this step
            self._queue.put(None, *args, **kwargs)
            return
        self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


class DecodeJob:
    """Work on a request's images that is not a request (``count_tokens``): put in the line
    as ``(answer queue, job, None)``, admitted by the rules of its decoding (rule 6), run
    on the generation thread, its result (or the exception it raised, or the guard's
    refusal) put on the answer queue. ``run``: the work; ``nbytes``: what its decoding
    takes at its peak."""

    __slots__ = ("run", "nbytes")

    def __init__(self, run: Callable[[], Any], nbytes: int) -> None:
        self.run, self.nbytes = run, int(nbytes)

    def answer(self, rqueue: Queue) -> None:
        """Run it and put what came of it on ``rqueue``."""
        try:
            out = self.run()
        except Exception as e:  # noqa: BLE001 - the asker's error, never the loop's
            out = e
        rqueue.put(out)


@dataclass
class _Waiting:
    item: Tuple[Any, Any, Any]
    since: float
    seq: int
    queued: float  # when it was put (its queue wait: `GuardCounters.waited`)
    size: Optional[tuple] = None  # (prompt tokens, max tokens[, tokens of each image])
    sized: bool = False
    images: Optional[int] = None  # bytes its images' decoding takes (rule 6)
    told: bool = False
    passed: int = 0  # later requests admitted past this one


class AdmissionQueue(Queue):
    """mlx-lm's request queue, gated by a `MemoryGuard`: HTTP threads put as before; the
    generation thread's ``get`` hands out the first request in line that fits (see the
    module doc's rules). Items whose request is not a request (``is_command``) pass at
    once. Each request handed out counts the seconds since it was put in the guard's
    counters (`GuardCounters.waited`).

    Args:
        guard: the limit and its accounting.
        size: a request's ``(prompt tokens, max tokens)`` or ``(prompt tokens, max tokens,
            tokens of each of its images)``, or None when it cannot tell (the request is
            then admitted unmeasured; mlx-lm reports its error).
        is_command: items that are not requests.
        forget: called for a request refused (what `size` kept of it can go).
        images: the bytes decoding a request's images takes (0: none; rule 6), read before
            `size` (which decodes them).
    """

    def __init__(self, guard: MemoryGuard,
                 size: Callable[[Tuple[Any, Any, Any]], Optional[tuple]],
                 is_command: Callable[[Any], bool],
                 forget: Callable[[Tuple[Any, Any, Any]], None] = lambda item: None,
                 images: Callable[[Tuple[Any, Any, Any]], int] = lambda item: 0) -> None:
        super().__init__()
        self.guard = guard
        self._size = size
        self._is_command = is_command
        self._forget = forget
        self._images = images
        self._line: Deque[_Waiting] = deque()
        self._commands: Deque[Tuple[float, Any]] = deque()  # (when put, item)
        self._seq = 0
        self._blocked = 0  # requests up to this arrival found the line blocked

    def qsize(self) -> int:
        return super().qsize() + len(self._line) + len(self._commands)

    def put(self, item, block: bool = True, timeout: Optional[float] = None) -> None:
        super().put((time.monotonic(), item), block, timeout)

    def get(self, block: bool = True, timeout: Optional[float] = None):
        if block:
            self.guard.idle()  # mlx-lm waits with an empty batch: nothing runs
        end = None if timeout is None else time.monotonic() + max(timeout, 0)
        while True:
            self._arrivals()
            if self._commands:
                queued, item = self._commands.popleft()
                if isinstance(item[1], DecodeJob):
                    item[1].answer(item[0])  # no limit: it runs as it comes
                    continue
                if not self._is_command(item):  # a request, with no limit to wait for
                    self._taken(queued)
                return item
            item = self._admit()
            if item is not None:
                return item
            if not block:
                raise Empty
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise Empty
            try:
                queued, got = super().get(True, _POLL if left is None else min(left, _POLL))
            except Empty:
                continue
            self._arrive(queued, got)

    def waiting(self) -> List[Tuple[Any, Any, Any]]:
        """The requests waiting to be handed out, oldest first within the line; nothing is
        taken (the generation thread's look at what is queued behind the request it runs:
        work in flight, `engine.followers`)."""
        self._arrivals()
        return [w.item for w in self._line] + [
            item for _, item in self._commands
            if not self._is_command(item) and not isinstance(item[1], DecodeJob)]

    # -- the line -------------------------------------------------------------------------
    def _arrivals(self) -> None:
        while True:
            try:
                queued, got = super().get(False)
            except Empty:
                return
            self._arrive(queued, got)

    def _arrive(self, queued: float, got) -> None:
        if self._is_command(got) or not self.guard.active:
            self._commands.append((queued, got))
        else:
            self._seq += 1
            self._line.append(_Waiting(got, time.monotonic(), self._seq, queued))
        self.guard.waiting = len(self._line)

    def _taken(self, queued: float) -> None:
        """A request put at ``queued`` is handed to the generation thread now."""
        self.guard.counters.waited(time.monotonic() - queued)

    def _refuse(self, w: _Waiting, error: MemoryRefused) -> None:
        self._line.remove(w)
        self._forget(w.item)
        log.warning("mlx_kvcache: refused a request (%d): %s", error.status, error)
        w.item[0].put(error)

    def _admit(self):
        """The first request in line that may go now (rules 1-4, 6), or None; each
        `DecodeJob` met on the way runs where its decoding is admitted."""
        guard = self.guard
        try:
            ahead: List[_Waiting] = []  # waiting requests a later one would pass
            held_back = False  # one ahead was passed enough: the rest only wait (rule 3)
            for w in list(self._line):
                if not w.sized:
                    job = w.item[1] if isinstance(w.item[1], DecodeJob) else None
                    if w.images is None:
                        w.images = job.nbytes if job is not None else self._images(w.item)
                    if w.images:  # its decoding is admitted first (rule 6)
                        nbytes = w.images
                        if guard.decoding_never_fits(nbytes):
                            guard.counters.refused(Refusal.MEMORY_NEVER_FITS)
                            self._refuse(w, MemoryNeverFits(guard.images_too_large(nbytes)))
                            continue
                        if held_back or not guard.try_admit(nbytes):
                            held_back = self._wait(
                                w, ahead, held_back,
                                lambda waited: guard.images_refusal(nbytes, waited),
                                f"images that take about {human_bytes(nbytes)} to decode")
                            continue
                    if job is not None:
                        self._line.remove(w)
                        job.answer(w.item[0])
                        continue
                    w.size, w.sized = self._size(w.item), True  # (decodes its images)
                if w.size is None:  # cannot tell: mlx-lm reports the request's problem
                    self._line.remove(w)
                    self._taken(w.queued)
                    return w.item
                prompt, max_tokens, *more = w.size
                images = more[0] if more else ()
                if guard.never_fits(prompt, max_tokens, images):
                    guard.counters.refused(Refusal.MEMORY_NEVER_FITS)
                    self._refuse(w, MemoryNeverFits(guard.too_large(prompt, max_tokens,
                                                                    images)))
                    continue
                answer = guard.first_answer(max_tokens)
                need = guard.need(prompt, answer, images)
                if not held_back and guard.try_admit(need):
                    self._line.remove(w)
                    if w.seq <= self._blocked:
                        guard.waited += 1
                    for a in ahead:
                        a.passed += 1
                    guard.passed += bool(ahead)
                    rqueue, request, args = w.item
                    res = guard.reserve(need, prompt, answer, max_tokens, images)
                    self._taken(w.queued)
                    return (_Released(rqueue, res), request, args)
                held_back = self._wait(
                    w, ahead, held_back,
                    lambda waited: guard.refusal(need, prompt, max_tokens, waited),
                    f"{prompt} prompt tokens (needs about {human_bytes(need)})")
            if self._line:
                self._blocked = self._line[-1].seq
            return None
        finally:
            guard.waiting = len(self._line)

    def _wait(self, w: _Waiting, ahead: List[_Waiting], held_back: bool,
              refusal: Callable[[float], str], what: str) -> bool:
        """``w`` does not fit now: refused with `MemoryRefused` (``refusal``'s message) when
        nothing running could free memory or it waited enough (rule 4), else it waits, said
        once; returns whether what follows it only waits (rule 3)."""
        guard = self.guard
        waited = time.monotonic() - w.since
        if not guard.running() or waited >= guard.wait:
            guard.counters.refused(Refusal.MEMORY)
            self._refuse(w, MemoryRefused(refusal(waited)))
            return held_back
        if not w.told:
            w.told = True
            log.info("mlx_kvcache: a request waits for memory: %s; %s in use of the %s "
                     "limit; %d running", what, human_bytes(guard.in_use()),
                     human_bytes(guard.limit), guard.running())
        ahead.append(w)
        return held_back or w.passed >= PASS_LIMIT
