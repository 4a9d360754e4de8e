"""The memory guard: MLX's active memory (weights, the batch's live caches, the prompt
cache's snapshots) kept under one limit (``--memory-limit``).

mlx-lm's server admits every request into its batch as it arrives; a burst of long
prompts allocates their caches and prefill activations all at once, and on a Mac —
unified memory, shared with the weights — a burst that does not fit is killed by the OS,
not queued. The guard stands where mlx-lm's generation thread takes its next request (its
request queue, `admission.AdmissionQueue`); what a request needs is measured on the model
at start (`footprint`).

The rules, in the order a request meets them:

1. *Never fits*: a request whose admission need exceeds what the limit leaves beside the
   weights — with an empty prompt cache and nothing running — is refused at once with a
   400 that names the numbers (`MemoryNeverFits`), never queued.
2. *Admission*: a request enters the batch when its need fits next to what is in use; the
   prompt cache gives way first (trimmed, parked to disk with a disk tier). Its need is
   the caches of its prompt plus a small decode headroom (`DECODE_HEADROOM` tokens, or
   ``max_tokens`` if less) — not ``max_tokens`` up front: Claude Code asks for 32,000 on
   every request, and reserving that would refuse prompts that fit.
3. *No head-of-line blocking*: a request that does not fit yet waits, and the line is
   scanned past it: a later request that fits is admitted first. Fairness is bounded:
   once `admission.PASS_LIMIT` later requests have been admitted past a waiting one,
   nothing behind it is admitted before it (it goes as soon as running answers free its
   room).
4. *Waiting ends*: after ``--memory-wait`` seconds — or at once when nothing is running
   that could free memory — a waiting request is refused with a 503 that says why.
5. *Growth*: a running request's reservation follows what it really holds: its prefill
   activations go with its first answer token, and every `DECODE_HEADROOM` decoded
   tokens it grows by that much more (the hook is the answer queue, `admission`'s: one
   count per token). The prompt cache gives way first; when the reservations themselves
   would pass the limit, the newest decoding request is ended there with
   ``finish_reason: "length"`` and a log line (older conversations keep going; what it
   generated so far is sent). A request whose ``max_tokens`` can never fit is so ended,
   not refused: it may well stop sooner.
6. *Images*: mlx-lm decodes a request's images when it tokenizes it, which here is at
   admission (rule 2 needs its prompt's length; what it made is kept for mlx-lm). The
   decoding is admitted first, by rules 1-4 with its own need — the bytes it takes at its
   peak, from the images' headers (``images.decode_bytes``) — so no image is decoded where
   the limit cannot take it, and each once. ``count_tokens`` with images is an
   `admission.DecodeJob` in the same line: decoded on the generation thread, never in an
   HTTP thread, where any number of clients could decode at once. Then the request's
   need includes encoding its images (the model's vision tower, before its prefill),
   freed with its prefill.

Commands (``DELETE /v1/cache``, the stop) pass at once. While requests run, every insert
keeps the prompt cache within what the limit leaves beside them (`MemoryGuard.room`).

A request's need is measured, not guessed (`footprint.measure`, at start): the caches of
its reserved tokens (as long as the longest running one: a batch pads its rows to one
length) plus the activations of one prefill step and its images' encoding. What is in
use is the larger of MLX's active memory (less the prompt cache's snapshots, which can
give way) and the weights plus every reservation (an admitted request has not allocated
all of it yet).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple

import mlx.core as mx

from ...prefix.stats import human_bytes
from .counters import GuardCounters, Refusal
from .footprint import Footprint, cache_tokens

__all__ = ["DECODE_HEADROOM", "DEFAULT_WAIT", "Held", "MemoryGuard", "MemoryNeverFits",
           "MemoryRefused", "Reservation", "SHARE", "default_limit"]

log = logging.getLogger("mlx_kvcache")

#: Seconds a request waits for memory before it is refused (``--memory-wait``).
DEFAULT_WAIT = 120.0
#: The default limit: this share of the machine's memory (`default_limit`).
SHARE = 0.85
#: Answer tokens reserved beyond what a request holds: at admission (or ``max_tokens``
#: if less), then again each time its answer reaches its reservation.
DECODE_HEADROOM = 256


class MemoryRefused(RuntimeError):
    """A request the memory limit could not take in time (answered with 503)."""

    #: The HTTP status the request is answered with.
    status = 503


class MemoryNeverFits(MemoryRefused):
    """A request the memory limit can never take, whatever runs or is cached (400: the
    same request would be refused again; the message names the numbers)."""

    status = 400


def default_limit(weights: int, total: int) -> Tuple[int, str]:
    """``(bytes, why)``: `SHARE` of the machine's ``total`` memory, or, when the weights
    take more than that, the weights and half of what they leave."""
    share = int(total * SHARE)
    rest = int(weights) + max(int(total) - int(weights), 0) // 2
    if share >= rest:
        return share, f"{SHARE:.0%} of the machine's {human_bytes(total)}"
    return rest, (f"the model's {human_bytes(weights)} and half of what they leave of the "
                  f"machine's {human_bytes(total)}")


class Held(Protocol):
    """What the guard asks of the prompt cache beside it (`hold`): the bytes its snapshots
    hold, and a trim to a byte count when a request needs the room."""

    @property
    def nbytes(self) -> int: ...

    def trim_to(self, *, n_sequences: Optional[int] = None,
                n_bytes: Optional[int] = None) -> None: ...


class Reservation:
    """What one admitted request holds of the limit: ``nbytes`` for ``tokens`` tokens (its
    prompt and the answer tokens reserved so far), grown as its answer decodes
    (`decoded`); ``cut`` once the guard decided this request ends here (rule 5)."""

    __slots__ = ("guard", "key", "prompt", "max_tokens", "tokens", "nbytes", "encoding",
                 "answered", "cut", "released")

    def __init__(self, guard: "MemoryGuard", key: int, prompt: int, max_tokens: int,
                 tokens: int, nbytes: int, encoding: int = 0) -> None:
        self.guard, self.key = guard, key
        self.prompt, self.max_tokens = int(prompt), max(int(max_tokens), 0)
        self.tokens, self.nbytes = int(tokens), int(nbytes)
        self.encoding = int(encoding)  # (its images' encoding: gone once it is prefilled)
        self.answered = 0
        self.cut = False
        self.released = False

    def decoded(self) -> bool:
        """One more answer token; grows the reservation when the answer reached it.
        Returns whether this request must end now (`cut`). O(1) but at a growth."""
        self.answered += 1
        if self.answered == 1:
            self.guard.prefilled(self)
        if not self.cut and self.prompt + self.answered >= self.tokens:
            self.guard.grow(self)
        return self.cut

    def release(self) -> None:
        """Give the reservation back (idempotent)."""
        self.released = True
        self.guard.unreserve(self.key)


class MemoryGuard:
    """The limit, what admitted requests reserved, and the counters of
    ``GET /v1/cache``'s ``memory``. Admission and growth run on the generation thread;
    `report` may be read from any thread.

    Args:
        limit: ``--memory-limit`` in bytes (None: the default, set by `configure`).
        wait: seconds a request may wait for memory before it is refused.
        active_memory: MLX's active memory now (``mx.get_active_memory``).
        counters: where its line counts refusals and waits (the server's one
            `GuardCounters`; None: its own).
    """

    def __init__(self, limit: Optional[int] = None, wait: float = DEFAULT_WAIT,
                 active_memory: Callable[[], int] = mx.get_active_memory,
                 counters: Optional[GuardCounters] = None) -> None:
        self._active_memory = active_memory
        #: Refusals and queue waits (`admission` counts them here).
        self.counters = counters or GuardCounters()
        self.asked = None if limit is None else int(limit)
        self.limit: Optional[int] = self.asked
        self.wait = float(wait)
        self.footprint: Optional[Footprint] = None
        self._held: Optional[Held] = None  # the prompt cache that gives way (`hold`)
        self._mu = threading.Lock()
        self._reserved: Dict[int, Reservation] = {}  # admission order (ids ascending)
        self._ids = 0
        self.admitted = 0
        self.waited = 0  # admitted after waiting for memory
        self.passed = 0  # admitted past a request waiting for memory
        self.cut = 0  # ended with finish_reason length: the reservations reached the limit
        self.waiting = 0
        self.trimmed_bytes = 0  # prompt cache bytes given way to requests

    def configure(self, footprint: Footprint, total: int) -> str:
        """Set the footprint (and the default limit); returns the line said at start."""
        self.footprint = footprint
        if self.asked is None:
            self.limit, why = default_limit(footprint.weights, total)
        else:
            why = "--memory-limit"
        mx.reset_peak_memory()
        if self.limit <= footprint.weights + footprint.need(1, 1):
            why += "; NOT ENOUGH for the model and one short request: every request gets 400"
        images = (f", encoding an image of 1k tokens "
                  f"{human_bytes(footprint.encoding([1024]))}" if footprint.image_linear
                  or footprint.image_square else "")
        return (f"memory limit {human_bytes(self.limit)} ({why}): weights "
                f"{human_bytes(footprint.weights)}, a request's caches "
                f"{human_bytes(int(footprint.kv_per_token * 1024))} per 1k tokens{images}; a "
                f"prompt of more than {self.largest_prompt()} tokens can never fit (400); requests "
                f"that would cross it wait up to {self.wait:g} s (--memory-wait), the prompt "
                f"cache gives way first")

    @property
    def refused(self) -> int:
        """Requests refused with 503: waited too long, or nothing running could free
        memory (rule 4)."""
        return self.counters.refusals(Refusal.MEMORY)

    @property
    def never_fit(self) -> int:
        """Requests refused with 400: they could never fit (rules 1 and 6)."""
        return self.counters.refusals(Refusal.MEMORY_NEVER_FITS)

    @property
    def active(self) -> bool:
        return self.limit is not None and self.footprint is not None

    def hold(self, held: Held) -> None:
        """Count ``held`` (the prompt cache, which calls this once as it is made) as
        memory that gives way to requests: not in use, trimmed when a request needs it."""
        self._held = held

    def _cache_bytes(self) -> int:
        return self._held.nbytes if self._held is not None else 0

    def _give_way(self, keep: int) -> None:
        """Trim the prompt cache to ``keep`` bytes, when it holds more."""
        cached = self._cache_bytes()
        if cached > keep and self._held is not None:
            self._held.trim_to(n_bytes=max(keep, 0))
            self.trimmed_bytes += max(cached - self._cache_bytes(), 0)

    # -- accounting -----------------------------------------------------------------------
    def reserved(self) -> int:
        """Bytes every admitted request reserved."""
        with self._mu:
            return sum(r.nbytes for r in self._reserved.values())

    def in_use(self) -> int:
        """Bytes in use that the prompt cache cannot free: the larger of MLX's active
        memory less the cache's snapshots, and the weights plus every reservation."""
        fp = self.footprint
        accounted = (fp.weights if fp is not None else 0) + self.reserved()
        return max(self._active_memory() - self._cache_bytes(), accounted)

    @staticmethod
    def first_answer(max_tokens: int) -> int:
        """Answer tokens reserved at admission (rule 2)."""
        return min(max(int(max_tokens), 0), DECODE_HEADROOM)

    def need(self, prompt_tokens: int, answer_tokens: int, images: Sequence[int] = ()) -> int:
        """What admitting a request of ``prompt_tokens`` with ``answer_tokens`` reserved
        adds: its caches, padded to the batch's longest row (and the running rows padded
        to its length when it is the longest: a batch's cache is one tensor, every row as
        long as the longest), and its prefill — the encoding of its images of ``images``
        tokens each included."""
        fp = self.footprint
        with self._mu:
            lengths = [r.tokens for r in self._reserved.values()]
        tokens = int(prompt_tokens) + max(int(answer_tokens), 0)
        longest = max(lengths, default=0)
        grown = sum(max(tokens - t, 0) for t in lengths) if tokens > longest else 0
        return (fp.need(prompt_tokens, answer_tokens, longest) + int(fp.kv_per_token * grown)
                + fp.encoding(images))

    def never_fits(self, prompt_tokens: int, max_tokens: int, images: Sequence[int] = ()) -> bool:
        """Whether a request's admission need passes what the limit leaves beside the
        weights with an empty prompt cache and nothing running (rule 1)."""
        fp = self.footprint
        return fp.weights + fp.need(prompt_tokens, self.first_answer(max_tokens)) \
            + fp.encoding(images) > self.limit

    def decoding_never_fits(self, nbytes: int) -> bool:
        """Whether decoding that takes ``nbytes`` passes what the limit leaves beside the
        weights with an empty prompt cache and nothing running (rule 6)."""
        return self.footprint.weights + int(nbytes) > self.limit

    def largest_prompt(self) -> int:
        """The longest prompt (tokens) that can ever be admitted, with a full headroom."""
        lo, hi = 0, 1
        while not self.never_fits(hi, DECODE_HEADROOM) and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while lo + 1 < hi:  # lo fits (or is 0), hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not self.never_fits(mid, DECODE_HEADROOM) else (lo, mid)
        return lo

    def running(self) -> int:
        with self._mu:
            return len(self._reserved)

    def room(self) -> Optional[int]:
        """What the prompt cache may hold now beside what is in use (None: no guard)."""
        if not self.active:
            return None
        return max(self.limit - self.in_use(), 0)

    def try_admit(self, need: int) -> bool:
        """Whether a request needing ``need`` bytes fits now; the prompt cache gives way
        (is trimmed) when that is what makes it fit."""
        other = self.in_use()
        if other + need > self.limit:
            return False
        self._give_way(self.limit - other - need)
        return True

    def reserve(self, need: int, prompt_tokens: int, answer_tokens: int,
                max_tokens: Optional[int] = None, images: Sequence[int] = ()) -> Reservation:
        """Hold ``need`` bytes for an admitted request of ``prompt_tokens`` with
        ``answer_tokens`` reserved (of at most ``max_tokens``; its images of ``images``
        tokens each); `Reservation.release` gives them back."""
        encoding = self.footprint.encoding(images) if self.footprint is not None else 0
        with self._mu:
            self._ids += 1
            r = Reservation(self, self._ids, prompt_tokens,
                            answer_tokens if max_tokens is None else max_tokens,
                            int(prompt_tokens) + int(answer_tokens), need, encoding)
            self._reserved[r.key] = r
            self.admitted += 1
        return r

    def prefilled(self, r: Reservation) -> None:
        """``r``'s prompt is prefilled (its first answer token came): the activations of
        its prefill step and its images' encoding are freed, and no longer reserved."""
        fp = self.footprint
        if fp is None:
            return
        with self._mu:
            if r.key in self._reserved:
                freed = int(fp.act_per_token * min(r.prompt, fp.step)) + r.encoding
                r.nbytes = max(r.nbytes - freed, 0)

    def unreserve(self, key: int) -> None:
        """Drop the reservation ``key`` (`Reservation.release`; gone already: nothing)."""
        with self._mu:
            self._reserved.pop(key, None)

    def grow(self, r: Reservation) -> None:
        """``r``'s answer reached its reservation: reserve `DECODE_HEADROOM` more tokens
        (up to its ``max_tokens``). The prompt cache gives way first; if the reservations
        would still pass the limit, the newest decoding request is `cut` (rule 5)."""
        fp = self.footprint
        if fp is None or self.limit is None:
            return
        with self._mu:
            if r.key not in self._reserved:
                return  # released, or forgotten by `idle`
            want = min(r.prompt + r.answered + DECODE_HEADROOM, r.prompt + r.max_tokens)
            if want <= r.tokens:
                return  # its max_tokens ends it first
            others = [o.tokens for o in self._reserved.values() if o is not r]
            longest = max(others, default=0)
            pad = (sum(max(want - max(t, r.tokens), 0) for t in others)
                   if want > longest else 0)
            extra = int(2 * fp.kv_per_token * (cache_tokens(want) - cache_tokens(r.tokens))
                        + fp.kv_per_token * pad)
            # (one already cut gives its reservation back at its next token)
            kept = [o for o in self._reserved.values() if not o.cut]
            reserved = sum(o.nbytes for o in kept)
            victim = None
            if fp.weights + reserved + extra > self.limit:
                # the newest that decodes (``r`` decodes: there is one)
                victim = max((o for o in kept if o.answered), key=lambda o: o.key)
            if victim is None or victim is not r:
                r.tokens, r.nbytes = want, r.nbytes + extra
        if victim is not None:
            victim.cut = True
            self.cut += 1
            log.warning("mlx_kvcache: ending a request at %d answer tokens (finish_reason "
                        "length): the running requests' caches would pass the memory limit "
                        "%s (--memory-limit; %s reserved beside the model's %s)",
                        victim.answered, human_bytes(self.limit), human_bytes(reserved),
                        human_bytes(fp.weights))
        self._give_way(self.limit - self.in_use())

    def idle(self) -> None:
        """Nothing runs (mlx-lm's loop waits for a request with an empty batch): what
        is still reserved belongs to requests that ended unseen."""
        with self._mu:
            self._reserved.clear()

    def _left_beside_weights(self) -> str:
        fp = self.footprint
        return (f"the limit {human_bytes(self.limit)} (--memory-limit) leaves "
                f"{human_bytes(max(self.limit - fp.weights, 0))} beside the model's "
                f"{human_bytes(fp.weights)}")

    def _not_now(self, what: str, need: int, waited: float) -> str:
        fp = self.footprint
        return (f"the server's memory limit ({human_bytes(self.limit)}, --memory-limit) "
                f"cannot {what}{' after waiting %.0f s' % waited if waited >= 1 else ''}: "
                f"about {human_bytes(need)} is needed and {human_bytes(self.in_use())} is in "
                f"use (the model {human_bytes(fp.weights if fp else 0)}); retry later")

    def refusal(self, need: int, prompt_tokens: int, max_tokens: int, waited: float) -> str:
        """The 503's message for a request that did not fit in time (rule 4)."""
        return self._not_now(f"take this request of {prompt_tokens} prompt tokens with the "
                             f"first {self.first_answer(max_tokens)} answer tokens", need, waited)

    def too_large(self, prompt_tokens: int, max_tokens: int, images: Sequence[int] = ()) -> str:
        """The 400's message for a request that can never fit (rule 1)."""
        fp = self.footprint
        need = fp.need(prompt_tokens, self.first_answer(max_tokens)) + fp.encoding(images)
        encoding = (f", and encoding its {len(images)} image{'s' if len(images) > 1 else ''} "
                    f"of {'+'.join(str(n) for n in images)} tokens "
                    f"{human_bytes(fp.encoding(images))}" if fp.encoding(images) else "")
        longest = (f"the longest prompt it can take is about {self.largest_prompt()} tokens"
                   + (" without images; send fewer or smaller images" if encoding else ""))
        return (f"this request can never fit in the server's memory limit: its "
                f"{prompt_tokens} prompt tokens need about {human_bytes(need)} "
                f"({human_bytes(int(fp.kv_per_token * 1024))} of caches per 1k tokens, "
                f"twice, and its prefill{encoding}), and {self._left_beside_weights()}; "
                f"{longest}")

    def images_too_large(self, nbytes: int) -> str:
        """The 400's message for images whose decoding can never fit (rule 6)."""
        return (f"the images of this request can never be decoded within the server's memory "
                f"limit: decoding them takes about {human_bytes(nbytes)} (their pixels, from "
                f"their headers), and {self._left_beside_weights()}; send fewer or smaller "
                f"images")

    def images_refusal(self, nbytes: int, waited: float) -> str:
        """The 503's message for images whose decoding did not fit in time (rule 6)."""
        return self._not_now("decode this request's images", nbytes, waited)

    def report(self) -> Dict[str, Any]:
        """``GET /v1/cache``'s ``memory``: the limit, MLX's active and peak memory, what
        admitted requests reserved, and the admission counters."""
        with self._mu:
            reserved = sum(r.nbytes for r in self._reserved.values())
            running = len(self._reserved)
        fp = self.footprint
        return {"limit_bytes": self.limit, "active_bytes": int(mx.get_active_memory()),
                "peak_bytes": int(mx.get_peak_memory()),
                "weights_bytes": fp.weights if fp else None, "reserved_bytes": reserved,
                "running_requests": running, "waiting_requests": self.waiting,
                "admitted": self.admitted, "admitted_after_waiting": self.waited,
                "admitted_past_waiting": self.passed, "refused": self.refused,
                "never_fit": self.never_fit, "ended_at_limit": self.cut,
                "cache_given_way_bytes": self.trimmed_bytes, "wait_seconds": self.wait}
