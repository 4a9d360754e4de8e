"""Where a rank's time goes: collectives, prefill passes, snapshots (issue 19's breakdown).

Always counted (a few integer additions): every collective the prompt cache and the
generation loop issue, by the phase that issued it (``coll.<phase>``: ``plan``, ``fetch``,
``checkpoint``, ``final``, ``trim``, ``settle``, ``stats``, and ``turn`` / ``idle`` for the
loop's own, with a request in flight or not), mlx-lm's own sharing (``mlxlm.turn``,
``mlxlm.idle``, ``mlxlm.batch``), and the checkpoints recorded (``stored.checkpoint``).
``GET /v1/cache`` shows them under ``profile``; they are the same on every rank.

With ``MLX_KVCACHE_PROFILE=1`` also timed, per rank: each phase of the prompt cache
(its collectives separately), and, through wrappers around three methods of mlx-lm's batch
generator (the wrappers only time and count; mlx-lm's code runs unchanged), every prefill
pass (one per prompt piece: on a pipeline-sharded model a pass through every rank), every
decode step and every ``extract_cache``. Each rank then logs one ``[profile] rank N | {...}``
line (cumulative JSON) at each request's end; ``scripts/bench_server.py --only 2`` reads
them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

from ...prefix.explain import Explainer
from .model_state import ModelState

ENV = "MLX_KVCACHE_PROFILE"


class Profile:
    """Counters and (when ``timing``) seconds, keyed ``"<what>.<phase>"``."""

    def __init__(self, timing: bool = False) -> None:
        self.timing = bool(timing)
        self.counts: Dict[str, int] = defaultdict(int)
        self.seconds: Dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> List[list]:
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s

    @property
    def current(self) -> str:
        s = self._stack()
        return s[-1][0] if s else "other"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Collectives issued inside are counted under ``name`` (the innermost phase);
        ``time.<name>`` is the time inside it less its nested phases'."""
        s = self._stack()
        s.append([name, 0.0, 0.0])
        t0 = time.perf_counter() if self.timing else 0.0
        c0 = time.thread_time() if self.timing else 0.0
        try:
            yield
        finally:
            _, nested, nested_cpu = s.pop()
            if self.timing:
                dt = time.perf_counter() - t0
                dc = time.thread_time() - c0
                if s:
                    s[-1][1] += dt
                    s[-1][2] += dc
                self.add(f"time.{name}", 1, dt - nested)
                # this thread's CPU time in it: the rest of its wall time it waited (for
                # the GIL, a lock, the CPU, or MLX work it forced)
                self.add(f"cpu.{name}", 0, max(dc - nested_cpu, 0.0) or 1e-9)

    def add(self, key: str, n: int = 1, seconds: float = 0.0) -> None:
        with self._lock:
            self.counts[key] += n
            if seconds:
                self.seconds[key] += seconds

    def begin(self, name: str):
        """`phase` entered now and left by calling what this returns (on this thread)."""
        cm = self.phase(name)
        cm.__enter__()
        return lambda: cm.__exit__(None, None, None)

    @contextmanager
    def collective(self, kind: str) -> Iterator[None]:
        """One collective of ``kind`` (``reduce`` / ``gather``) in the current phase."""
        t0 = time.perf_counter() if self.timing else 0.0
        try:
            yield
        finally:
            dt = time.perf_counter() - t0 if self.timing else 0.0
            self.add(f"coll.{self.current}", 1, dt)

    def snapshot(self) -> Dict[str, Any]:
        """``{"counts": {...}, "seconds": {...}}`` (seconds only when timing)."""
        with self._lock:
            out: Dict[str, Any] = {"counts": dict(sorted(self.counts.items()))}
            if self.timing:
                out["seconds"] = {k: round(v, 6) for k, v in sorted(self.seconds.items())}
        return out

    def line(self, rank: int) -> str:
        return f"[profile] rank {rank} | {json.dumps(self.snapshot(), separators=(',', ':'))}"


def loop_phase(timeout) -> str:
    """The phase of a turn of mlx-lm's generation loop: it waits for a request (a timeout)
    only while its batch is idle (``idle``); otherwise a request is in flight (``turn``)."""
    return "idle" if timeout is not None else "turn"


def count_share(prof: Profile, out: Any, t0: float) -> None:
    """Count one ``_share_object`` of mlx-lm's server (rank 0 sends the size, then the
    data when there is any: one or two ``all_sum``): in a turn, sharing its request;
    otherwise the batch's removals."""
    where = prof.current if prof.current in ("turn", "idle") else "batch"
    prof.add(f"mlxlm.{where}", 1 if out is None else 2,
             time.perf_counter() - t0 if prof.timing else 0.0)


def probe_server_loop(prof: Profile) -> None:
    """The same counts for stock ``mlx_lm.server`` (the benchmark's stock contender;
    class wrappers that call the original)."""
    from mlx_lm import server as S

    R = S.ResponseGenerator
    next_request, share_object = R._next_request, R._share_object

    def _next_request(self, timeout=None):
        if not self._is_distributed:
            return next_request(self, timeout)
        with prof.phase(loop_phase(timeout)):
            return next_request(self, timeout)

    def _share_object(self, obj):
        t0 = time.perf_counter()
        out = share_object(self, obj)
        if self._is_distributed:
            count_share(prof, out, t0)
        return out
    R._next_request, R._share_object = _next_request, _share_object


def from_env() -> Profile:
    """A `Profile`; timing (and mlx-lm's probes) when ``MLX_KVCACHE_PROFILE`` is set."""
    on = os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")
    prof = Profile(timing=on)
    if on:
        probe_mlx_lm(prof)
    return prof


def probe_mlx_lm(prof: Profile) -> None:
    """Time mlx-lm's prefill passes, decode steps and cache extraction (class wrappers
    that call the original; installed once per process, profiling only)."""
    import importlib

    G = importlib.import_module("mlx_lm.generate")  # ``mlx_lm.generate`` is also a function

    def wrap(cls, name, key, size=None):
        orig = getattr(cls, name)
        if getattr(orig, "_mlx_kvcache_probe", False):
            return

        def probe(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                n = size(a) if size is not None else 1
                if n:  # mlx-lm calls ``prompt([])`` on every step without prompts
                    prof.add(key, 1, time.perf_counter() - t0)
                    if size is not None:
                        prof.add(f"{key}_tokens", n)
        probe._mlx_kvcache_probe = True
        setattr(cls, name, probe)

    wrap(G.PromptProcessingBatch, "prompt", "pass.prefill",
         size=lambda a: sum(len(t) for t in a[0]) if a and a[0] else 0)
    wrap(G.GenerationBatch, "next", "pass.decode")
    wrap(G.BatchGenerator, "extract_cache", "extract")


def probe_request_path(prof: Profile, state: ModelState, explainer: Explainer) -> None:
    """Time the parts of a request on one machine (profiling only): wrappers around this
    model's objects that time, then run the same code. On the generation thread:
    ``restore`` (the checkout: plan and copy), ``disk.verify`` (parked nodes read back),
    ``record`` (snapshots into the trie, the budget), ``lock`` (waiting for the trie's
    critical section, deferred work included), ``explain``, ``prefetch``,
    ``native`` (our caches to mlx-lm's and back) and ``persist.capture`` (what the disk
    writer will write). On the writer's thread: ``bg.write`` (SQLite and the rest),
    ``bg.encode`` (safetensors serialization), ``bg.file`` (write, CRC, fsync) and
    ``bg.fsync_dir``; ``bg.overlap`` is the writer's time that began with a request in
    flight. Every phase also has ``cpu.<phase>``: the thread's own CPU time in it."""
    mgr = state.manager  # (a NullManager when caching is off: its verbs are timed too)
    inflight = [0]

    def phased(obj: Any, name: str, phase: str, before=None) -> None:
        orig = getattr(obj, name)

        def probe(*a, **k):
            if before is not None:
                before()
            with prof.phase(phase):
                return orig(*a, **k)
        setattr(obj, name, probe)

    run = mgr.run

    def locked(fn, *a):
        end = prof.begin("lock")
        entered = []

        def section(*b):
            entered.append(True)
            end()
            return fn(*b)
        try:
            return run(section, *a)
        finally:
            if not entered:
                end()
    mgr.run = locked

    def started() -> None:
        inflight[0] += 1

    def recorded() -> None:
        if prof.current == "final":
            inflight[0] = max(0, inflight[0] - 1)
    phased(mgr, "checkout", "restore", before=started)
    phased(mgr, "record", "record", before=recorded)
    phased(mgr, "adopt", "record", before=recorded)  # the sequential path's final insert
    phased(mgr, "checkpoint", "record")
    if mgr.verify is not None:
        phased(mgr, "verify", "disk.verify")
    phased(explainer, "explain", "explain")
    store = state.store
    if store is not None:
        phased(store, "capture", "persist.capture")
        phased(store, "prefetch", "prefetch")
    if state.writer is not None and store is not None:
        def timed(write):
            def timed_write(*a):
                t0 = time.perf_counter()
                busy = inflight[0] > 0
                with prof.phase("bg.write"):
                    try:
                        return write(*a)
                    finally:
                        if busy:
                            prof.add("bg.overlap", 1, time.perf_counter() - t0)
            return timed_write
        state.writer.wrap_write(timed)
    _probe_modules(prof)


def _probe_modules(prof: Profile) -> None:
    """Module-level functions of the request path and the writer, wrapped once per process."""
    from ...store import save
    from . import native

    def wrap(mod: Any, name: str, phase: str) -> None:
        orig = getattr(mod, name)
        if getattr(orig, "_mlx_kvcache_probe", False):
            return

        def probe(*a, **k):
            with prof.phase(phase):
                return orig(*a, **k)
        probe._mlx_kvcache_probe = True
        setattr(mod, name, probe)
    wrap(native, "to_native", "native")  # (the prompt cache calls them through the module)
    wrap(native, "from_native", "native")
    wrap(save, "encode_file", "bg.encode")
    wrap(save, "write_atomic", "bg.file")
    wrap(save, "fsync_dir", "bg.fsync_dir")
