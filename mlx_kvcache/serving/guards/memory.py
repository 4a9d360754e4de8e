"""The memory guard: MLX's active memory (weights, the batch's live caches, the prompt
cache's snapshots) kept under one limit (``--memory-limit``).

mlx-lm's server admits every request into its batch as it arrives; a burst of long
prompts allocates their caches and prefill activations all at once, and on a Mac —
unified memory, shared with the weights — a burst that does not fit is killed by the OS,
not queued. The guard stands where mlx-lm's generation thread takes its next request (its
request queue, `AdmissionQueue`).

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
   scanned past it: a later request that fits is admitted first. Fairness is bounded: once
   `PASS_LIMIT` later requests have been admitted past a waiting one, nothing behind it is
   admitted before it (it goes as soon as running answers free its room).
4. *Waiting ends*: after ``--memory-wait`` seconds — or at once when nothing is running
   that could free memory — a waiting request is refused with a 503 that says why.
5. *Growth*: a running request's reservation follows what it really holds: its prefill
   activations go with its first answer token, and every `DECODE_HEADROOM` decoded
   tokens it grows by that much more (the hook is the answer queue, `_Released`: one
   count per token). The prompt cache gives way first; when the reservations themselves
   would pass the limit, the newest decoding request is ended there with
   ``finish_reason: "length"`` and a log line (older conversations keep going; what it
   generated so far is sent). A request whose ``max_tokens`` can never fit is so ended,
   not refused: it may well stop sooner.
6. *Images*: mlx-lm decodes a request's images when it tokenizes it, which here is at
   admission (rule 2 needs its prompt's length; what it made is kept for mlx-lm). The
   decoding is admitted first, by rules 1-4 with its own need — the bytes it takes at its
   peak, from the images' headers (``images.decode_bytes``) — so no image is decoded where
   the limit cannot take it, and each once. ``count_tokens`` with images is a `DecodeJob`
   in the same line: decoded on the generation thread, never in an HTTP thread, where any
   number of clients could decode at once. Then the request's need includes encoding its
   images (the model's vision tower, before its prefill), freed with its prefill.

Commands (``DELETE /v1/cache``, the stop) pass at once. While requests run, every insert
keeps the prompt cache within what the limit leaves beside them (`MemoryGuard.room`).

A request's need is measured, not guessed: at start one forward pass of the model gives
the bytes of its caches per token and of its prefill activations per prompt token, and
for a model with an image processor two image encodings give what encoding an image of
n tokens takes, which grows with n² (`Footprint`); a request needs the caches of its
reserved tokens (as long as the longest running one: a batch pads its rows to one
length) plus the activations of one prefill step and its images' encoding. What is in
use is the larger of MLX's active memory (less the prompt cache's snapshots, which can
give way) and the weights plus every reservation (an admitted request has not allocated
all of it yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from queue import Empty, Queue
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
from mlx_lm.server import GenerationContext, Response

from ...prefix.stats import human_bytes

__all__ = ["AdmissionQueue", "DecodeJob", "Footprint", "ImageProbe", "MemoryGuard",
           "MemoryNeverFits", "MemoryRefused", "Reservation", "default_limit", "measure",
           "measure_encoding"]

log = logging.getLogger("mlx_kvcache")

#: Seconds a request waits for memory before it is refused (``--memory-wait``).
DEFAULT_WAIT = 120.0
#: The default limit: this share of the machine's memory (`default_limit`).
SHARE = 0.85
#: Seconds the generation thread's blocking ``get`` sleeps between looks at the line.
_POLL = 0.05
#: mlx-lm's batch caches grow in steps of this many tokens.
_STEP = 256
#: Answer tokens reserved beyond what a request holds: at admission (or ``max_tokens``
#: if less), then again each time its answer reaches its reservation.
DECODE_HEADROOM = 256
#: A waiting request lets at most this many later requests be admitted past it; then
#: nothing behind it goes first (bounded unfairness, no starvation).
PASS_LIMIT = 8


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


@dataclass(frozen=True)
class Footprint:
    """What one request costs, measured on the model at start (`measure`).

    ``weights``: bytes of the parameters; ``kv_fixed`` + ``kv_per_token`` × tokens: its
    caches; ``act_per_token``: prefill activations per prompt token of one step (logits
    included); ``step``: the prefill step (``--prefill-step-size``); ``image_linear`` × n +
    ``image_square`` × n²: what the model's image encoder takes to encode one image of n
    tokens (0 without one; a vision tower's attention makes it grow with n², measured at
    two sizes: `measure`)."""

    weights: int
    kv_fixed: int
    kv_per_token: float
    act_per_token: float
    step: int
    image_linear: float = 0.0
    image_square: float = 0.0

    def encoding(self, images: Sequence[int]) -> int:
        """Bytes encoding images of ``images`` tokens each takes (all of them: mlx-lm
        encodes a request's images in one graph)."""
        return int(sum(self.image_linear * n + self.image_square * n * n for n in images))

    def need(self, prompt_tokens: int, max_tokens: int, longest: int = 0) -> int:
        """Bytes a request of ``prompt_tokens`` answering up to ``max_tokens`` needs, in a
        batch whose longest row holds ``longest`` tokens."""
        tokens = max(int(prompt_tokens) + max(int(max_tokens), 0), int(longest))
        tokens = -(-tokens // _STEP) * _STEP
        # Twice the caches: the live ones, and the copies its inserts make into the prompt
        # cache (and a batch makes when it merges rows) before the live ones go.
        return int(2 * (self.kv_fixed + self.kv_per_token * tokens)
                   + self.act_per_token * min(int(prompt_tokens), self.step))


#: The image sizes (in tokens, about) whose encoding `measure` times: small enough to cost
#: little at start, four times apart to tell a linear growth from a quadratic one.
_IMAGE_PROBES = (64, 256)

#: What `measure` is given to make an image: for about ``n`` tokens, the prompt ids of one
#: image, its pixel values as the model's processor makes them, and its tokens (None:
#: the processor cannot make one).
ImageProbe = Callable[[int], Optional[Tuple[List[int], Any, int]]]


def measure_encoding(model: Any, probe: ImageProbe) -> Tuple[float, float]:
    """``(linear, square)`` bytes of encoding one image of n tokens with ``model``'s
    ``embed_inputs`` (mlx-lm's image seam): the line b/n = linear + square × n through two
    measured sizes, neither below 0 (1 size where the processor gives every image the same
    tokens: linear only)."""
    points: List[Tuple[int, int]] = []
    for target in _IMAGE_PROBES:
        made = probe(target)
        if made is None:
            break
        ids, pixels, n = made
        if n <= 0 or (points and n <= points[-1][0]):
            break
        mx.eval(pixels)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = model.embed_inputs(mx.array(ids), pixel_values=pixels)
        mx.eval(out)
        points.append((n, max(mx.get_peak_memory() - base, 0)))
        del out
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return points[0][1] / points[0][0], 0.0
    (n1, b1), (n2, b2) = points
    square = max((b2 / n2 - b1 / n1) / (n2 - n1), 0.0)
    return max(b1 / n1 - square * n1, 0.0), square


def measure(models: List[Any], make_caches: Callable[[Any], List[Any]], step: int,
            image: Optional[ImageProbe] = None) -> Footprint:
    """The `Footprint` of ``models`` (a target and maybe its draft, used together), from a
    few forward passes, and — given an ``image`` probe, where the target embeds images —
    two image encodings; run on the models' MLX thread."""
    from ...generation.sizing import checkpoint_bytes, model_bytes

    models = [m for m in models if m is not None]
    step = max(int(step), 1)
    short, long_ = 1, 1 + 1024
    kv1 = sum(checkpoint_bytes(m, lambda m=m: make_caches(m), short) for m in models)
    kvn = sum(checkpoint_bytes(m, lambda m=m: make_caches(m), long_) for m in models)
    per_token = max(kvn - kv1, 0) / (long_ - short)
    fixed = max(kv1 - per_token, 0)
    n = min(step, 256)
    act = 0.0
    for m in models:
        caches = make_caches(m)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = m(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        mx.eval(out)
        act += max(mx.get_peak_memory() - base - per_token * n, 0) / n
        del out, caches
    linear = square = 0.0
    if image is not None and hasattr(models[0], "embed_inputs"):
        linear, square = measure_encoding(models[0], image)
    return Footprint(model_bytes(*models), int(fixed), per_token, act, step, linear, square)


class Held(Protocol):
    """What the guard asks of the prompt cache beside it (`hold`): the bytes its snapshots
    hold, and a trim to a byte count when a request needs the room."""

    @property
    def nbytes(self) -> int: ...

    def trim_to(self, *, n_sequences: Optional[int] = None,
                n_bytes: Optional[int] = None) -> None: ...


def _rounded(tokens: int) -> int:
    return -(-int(tokens) // _STEP) * _STEP


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
    """

    def __init__(self, limit: Optional[int] = None, wait: float = DEFAULT_WAIT,
                 active_memory: Callable[[], int] = mx.get_active_memory) -> None:
        self._active_memory = active_memory
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
        self.refused = 0  # 503: waited too long, or nothing running could free memory
        self.never_fit = 0  # 400: could never fit
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
            extra = int(2 * fp.kv_per_token * (_rounded(want) - _rounded(r.tokens))
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
    size: Optional[tuple] = None  # (prompt tokens, max tokens[, tokens of each image])
    sized: bool = False
    images: Optional[int] = None  # bytes its images' decoding takes (rule 6)
    told: bool = False
    passed: int = 0  # later requests admitted past this one


class AdmissionQueue(Queue):
    """mlx-lm's request queue, gated by a `MemoryGuard`: HTTP threads put as before; the
    generation thread's ``get`` hands out the first request in line that fits (see the
    module doc's rules). Items whose request is not a request (``is_command``) pass at
    once.

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
        self._commands: Deque[Any] = deque()
        self._seq = 0
        self._blocked = 0  # requests up to this arrival found the line blocked

    def qsize(self) -> int:
        return super().qsize() + len(self._line) + len(self._commands)

    def get(self, block: bool = True, timeout: Optional[float] = None):
        if block:
            self.guard.idle()  # mlx-lm waits with an empty batch: nothing runs
        end = None if timeout is None else time.monotonic() + max(timeout, 0)
        while True:
            self._arrivals()
            if self._commands:
                item = self._commands.popleft()
                if not isinstance(item[1], DecodeJob):
                    return item
                item[1].answer(item[0])  # no limit: it runs as it comes
                continue
            item = self._admit()
            if item is not None:
                return item
            if not block:
                raise Empty
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise Empty
            try:
                got = super().get(True, _POLL if left is None else min(left, _POLL))
            except Empty:
                continue
            self._arrive(got)

    # -- the line -------------------------------------------------------------------------
    def _arrivals(self) -> None:
        while True:
            try:
                got = super().get(False)
            except Empty:
                return
            self._arrive(got)

    def _arrive(self, got) -> None:
        if self._is_command(got) or not self.guard.active:
            self._commands.append(got)
        else:
            self._seq += 1
            self._line.append(_Waiting(got, time.monotonic(), self._seq))
        self.guard.waiting = len(self._line)

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
                            guard.never_fit += 1
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
                    return w.item
                prompt, max_tokens, *more = w.size
                images = more[0] if more else ()
                if guard.never_fits(prompt, max_tokens, images):
                    guard.never_fit += 1
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
            guard.refused += 1
            self._refuse(w, MemoryRefused(refusal(waited)))
            return held_back
        if not w.told:
            w.told = True
            log.info("mlx_kvcache: a request waits for memory: %s; %s in use of the %s "
                     "limit; %d running", what, human_bytes(guard.in_use()),
                     human_bytes(guard.limit), guard.running())
        ahead.append(w)
        return held_back or w.passed >= PASS_LIMIT
