"""The memory guard: MLX's active memory (weights, the batch's live caches, the prompt
cache's snapshots) kept under one limit (``--memory-limit``).

mlx-lm's server admits every request into its batch as it arrives; a burst of long
prompts allocates their caches and prefill activations all at once, and on a Mac —
unified memory, shared with the weights — a burst that does not fit is killed by the OS,
not queued. The guard stands where mlx-lm's generation thread takes its next request (its
request queue, `AdmissionQueue`): a request enters the batch only when its estimated
need fits under the limit next to what is in use; otherwise it waits in line (the batch
goes on and frees memory as answers finish), and after ``--memory-wait`` seconds — or at
once when nothing is running that could free memory — it is refused with a 503 that says
why. Requests keep their order; commands (``DELETE /v1/cache``, the stop) pass at once.

The prompt cache gives way first: a request that fits only without some of the cached
snapshots trims them (parked to disk with a disk tier), and while requests run the cache
holds at most what the limit leaves beside them (`MemoryGuard.room`).

A request's need is measured, not guessed: at start one forward pass of the model gives
the bytes of its caches per token and of its prefill activations per prompt token
(`Footprint`); a request needs the caches of its prompt plus ``max_tokens`` (as long as
the longest running one: a batch pads its rows to one length) plus the activations of one
prefill step. What is in use is the larger of MLX's active memory (less the prompt
cache's snapshots, which can give way) and the weights plus every admitted request's need
(an admitted request has not allocated all of it yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

import mlx.core as mx
from mlx_lm.server import GenerationContext

from ...prefix.stats import human_bytes

__all__ = ["AdmissionQueue", "Footprint", "MemoryGuard", "MemoryRefused", "default_limit",
           "measure"]

log = logging.getLogger("mlx_kvcache")

#: Seconds a request waits for memory before it is refused (``--memory-wait``).
DEFAULT_WAIT = 120.0
#: The default limit: this share of the machine's memory (`default_limit`).
SHARE = 0.85
#: Seconds the generation thread's blocking ``get`` sleeps between looks at the line.
_POLL = 0.05
#: mlx-lm's batch caches grow in steps of this many tokens.
_STEP = 256


class MemoryRefused(RuntimeError):
    """A request the memory limit could not take in time (answered with 503)."""


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
    included); ``step``: the prefill step (``--prefill-step-size``)."""

    weights: int
    kv_fixed: int
    kv_per_token: float
    act_per_token: float
    step: int

    def need(self, prompt_tokens: int, max_tokens: int, longest: int = 0) -> int:
        """Bytes a request of ``prompt_tokens`` answering up to ``max_tokens`` needs, in a
        batch whose longest row holds ``longest`` tokens."""
        tokens = max(int(prompt_tokens) + max(int(max_tokens), 0), int(longest))
        tokens = -(-tokens // _STEP) * _STEP
        # Twice the caches: the live ones, and the copies its inserts make into the prompt
        # cache (and a batch makes when it merges rows) before the live ones go.
        return int(2 * (self.kv_fixed + self.kv_per_token * tokens)
                   + self.act_per_token * min(int(prompt_tokens), self.step))


def measure(models: List[Any], make_caches: Callable[[Any], List[Any]], step: int) -> Footprint:
    """The `Footprint` of ``models`` (a target and maybe its draft, used together), from a
    few forward passes; run on the models' MLX thread."""
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
    return Footprint(model_bytes(*models), int(fixed), per_token, act, step)


class Held(Protocol):
    """What the guard asks of the prompt cache beside it (`hold`): the bytes its snapshots
    hold, and a trim to a byte count when a request needs the room."""

    @property
    def nbytes(self) -> int: ...

    def trim_to(self, *, n_sequences: Optional[int] = None,
                n_bytes: Optional[int] = None) -> None: ...


class MemoryGuard:
    """The limit, what admitted requests reserved, and the counters of
    ``GET /v1/cache``'s ``memory``. Admission runs on the generation thread; `report` may
    be read from any thread.

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
        self._reserved: Dict[int, Tuple[int, int]] = {}  # id -> (bytes, tokens)
        self._ids = 0
        self.admitted = 0
        self.waited = 0  # admitted after waiting for memory
        self.refused = 0
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
            why += "; NOT ENOUGH for the model and one short request: every request gets 503"
        return (f"memory limit {human_bytes(self.limit)} ({why}): weights "
                f"{human_bytes(footprint.weights)}, a request's caches "
                f"{human_bytes(int(footprint.kv_per_token * 1024))} per 1k tokens; requests "
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

    # -- accounting -----------------------------------------------------------------------
    def in_use(self) -> int:
        """Bytes in use that the prompt cache cannot free: the larger of MLX's active
        memory less the cache's snapshots, and the weights plus every reservation."""
        fp = self.footprint
        with self._mu:
            reserved = sum(b for b, _ in self._reserved.values())
        accounted = (fp.weights if fp is not None else 0) + reserved
        return max(self._active_memory() - self._cache_bytes(), accounted)

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """What admitting a request adds: its caches, padded to the batch's longest row
        (and the running rows padded to its length when it is the longest: a batch's
        cache is one tensor, every row as long as the longest), and its prefill."""
        fp = self.footprint
        with self._mu:
            lengths = [t for _, t in self._reserved.values()]
        tokens = int(prompt_tokens) + max(int(max_tokens), 0)
        longest = max(lengths, default=0)
        grown = sum(max(tokens - t, 0) for t in lengths) if tokens > longest else 0
        return fp.need(prompt_tokens, max_tokens, longest) + int(fp.kv_per_token * grown)

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
        cached = self._cache_bytes()
        if other + need + cached > self.limit and self._held is not None:
            keep = max(self.limit - other - need, 0)
            self._held.trim_to(n_bytes=keep)
            self.trimmed_bytes += max(cached - self._cache_bytes(), 0)
        return True

    def reserve(self, need: int, tokens: int) -> Callable[[], None]:
        """Hold ``need`` bytes for an admitted request; returns its release (idempotent)."""
        with self._mu:
            self._ids += 1
            key = self._ids
            self._reserved[key] = (int(need), int(tokens))
            self.admitted += 1

        def release() -> None:
            with self._mu:
                self._reserved.pop(key, None)
        return release

    def idle(self) -> None:
        """Nothing runs (mlx-lm's loop waits for a request with an empty batch): what
        is still reserved belongs to requests that ended unseen."""
        with self._mu:
            self._reserved.clear()

    def refusal(self, need: int, prompt_tokens: int, max_tokens: int, waited: float) -> str:
        fp = self.footprint
        return (f"the server's memory limit ({human_bytes(self.limit)}, --memory-limit) "
                f"cannot take this request{' after waiting %.0f s' % waited if waited >= 1 else ''}"
                f": its {prompt_tokens} prompt and up to {max_tokens} answer tokens need about "
                f"{human_bytes(need)} and {human_bytes(self.in_use())} is in use (the model "
                f"{human_bytes(fp.weights if fp else 0)}); retry later, or with fewer tokens")

    def report(self) -> Dict[str, Any]:
        """``GET /v1/cache``'s ``memory``: the limit, MLX's active and peak memory, what
        admitted requests reserved, and the admission counters."""
        with self._mu:
            reserved = sum(b for b, _ in self._reserved.values())
            running = len(self._reserved)
        fp = self.footprint
        return {"limit_bytes": self.limit, "active_bytes": int(mx.get_active_memory()),
                "peak_bytes": int(mx.get_peak_memory()),
                "weights_bytes": fp.weights if fp else None, "reserved_bytes": reserved,
                "running_requests": running, "waiting_requests": self.waiting,
                "admitted": self.admitted, "admitted_after_waiting": self.waited,
                "refused": self.refused, "cache_given_way_bytes": self.trimmed_bytes,
                "wait_seconds": self.wait}


class _Released:
    """A request's answer queue that releases its reservation when the answer ends
    (its end or an error is put), or when its client leaves (its context's ``stop``)."""

    def __init__(self, queue: Queue, release: Callable[[], None]) -> None:
        self._queue, self._release = queue, release

    def put(self, item, *args, **kwargs) -> None:
        if item is None or isinstance(item, BaseException):
            self._release()
        elif isinstance(item, GenerationContext):
            stop = item.stop  # its client left: the request leaves the batch

            def stopped():
                self._release()
                stop()
            item.stop = stopped
        self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


@dataclass
class _Waiting:
    item: Tuple[Any, Any, Any]
    since: float
    seq: int
    size: Optional[Tuple[int, int]] = None  # (prompt tokens, max tokens)
    sized: bool = False
    told: bool = False


class AdmissionQueue(Queue):
    """mlx-lm's request queue, gated by a `MemoryGuard`: HTTP threads put as before; the
    generation thread's ``get`` hands out the first request in line once it fits (see the
    module doc). Items whose request is not a request (``is_command``) pass at once.

    Args:
        guard: the limit and its accounting.
        size: a request's ``(prompt tokens, max tokens)``, or None when it cannot tell
            (the request is then admitted unmeasured; mlx-lm reports its error).
        is_command: items that are not requests.
        forget: called for a request refused (what `size` kept of it can go).
    """

    def __init__(self, guard: MemoryGuard,
                 size: Callable[[Tuple[Any, Any, Any]], Optional[Tuple[int, int]]],
                 is_command: Callable[[Any], bool],
                 forget: Callable[[Tuple[Any, Any, Any]], None] = lambda item: None) -> None:
        super().__init__()
        self.guard = guard
        self._size = size
        self._is_command = is_command
        self._forget = forget
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
                return self._commands.popleft()
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

    def _admit(self):
        guard = self.guard
        try:
            while self._line:
                first = self._line[0]
                if not first.sized:
                    first.size, first.sized = self._size(first.item), True
                if first.size is None:  # cannot tell: mlx-lm reports the request's problem
                    self._line.popleft()
                    return first.item
                prompt, max_tokens = first.size
                tokens = prompt + max(max_tokens, 0)
                need = guard.need(prompt, max_tokens)
                if guard.try_admit(need):
                    self._line.popleft()
                    if first.seq <= self._blocked:
                        guard.waited += 1
                    rqueue, request, args = first.item
                    return (_Released(rqueue, guard.reserve(need, tokens)), request, args)
                waited = time.monotonic() - first.since
                if guard.running() and waited < guard.wait:
                    self._blocked = self._line[-1].seq
                    if not first.told:
                        first.told = True
                        log.info("mlx_kvcache: a request of %d prompt tokens waits for memory "
                                 "(needs about %s; %s in use of the %s limit; %d running)",
                                 prompt, human_bytes(need), human_bytes(guard.in_use()),
                                 human_bytes(guard.limit), guard.running())
                    return None
                self._line.popleft()  # nothing running can free memory, or waited enough
                guard.refused += 1
                self._forget(first.item)
                message = guard.refusal(need, prompt, max_tokens, waited)
                log.warning("mlx_kvcache: refused a request: %s", message)
                first.item[0].put(MemoryRefused(message))
            return None
        finally:
            guard.waiting = len(self._line)
