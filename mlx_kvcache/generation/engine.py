"""The one thread that runs every MLX operation of `PrefixCache`.

MLX (0.32) gives each thread its own default stream, and an array built on one thread
cannot be evaluated on another ("There is no Stream(cpu, N) in current thread"). A
request's state — cache buffers, the next token computed one step ahead — is built
lazily, so a generator resumed on another thread (a thread-pool server) would fail, or
leave half-built state behind. So every model step and every trie critical section runs
on this single engine thread; the threads that drive generators only hand it work and
wait. That also serialises MLX work, which one device runs one graph at a time anyway.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn


class Engine:
    """A daemon thread that runs submitted callables one at a time, in order."""

    def __init__(self, name: str = "mlx_kvcache-engine") -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._ready = threading.Event()
        self._ident: Optional[int] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        self._ready.set()
        while True:
            fn, args, fut = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)

    @property
    def here(self) -> bool:
        """Whether the calling thread is the engine thread."""
        return threading.get_ident() == self._ident

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread; its result, or its exception re-raised.

        Called on the engine thread itself (a nested call), it runs inline.
        """
        if self.here:
            return fn(*args)
        fut: Future = Future()
        self._q.put((fn, args, fut))
        return fut.result()


_lock = threading.Lock()
_engine: Optional[Engine] = None


def default_engine() -> Engine:
    """The process-wide engine (created on first use)."""
    global _engine
    with _lock:
        if _engine is None:
            _engine = Engine()
        return _engine


def materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds, private ones (RoPE tables...) included.

    An array left lazy by the thread that built the model could not be evaluated on the
    engine thread; evaluated arrays can be read from any thread.
    """
    arrays = []
    for m in model.modules():
        for v in list(m.values()) + list(vars(m).values()):
            if isinstance(v, mx.array):
                arrays.append(v)
            elif isinstance(v, (list, tuple)):
                arrays.extend(x for x in v if isinstance(x, mx.array))
    mx.eval(arrays)
