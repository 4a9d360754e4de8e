"""Writing a persistent cache in the background, off the request path.

At the end of each request the owner captures the trie (`PersistentStore.capture`: on the
MLX thread, inside the manager's critical section; quick, no file I/O) and submits the
capture here; one worker thread writes it. A capture submitted while another waits
replaces it (the newer one holds everything the older one did), so a slow disk never
queues work. A directory that cannot be written gives one warning, then silence until a
write succeeds again (then one line says so). The worker exits when idle: no thread
outlives the work, and nothing keeps an unused cache alive.

The writer yields to requests: its encoding, CRCs and SQLite are CPU work (and Python
under the GIL) that, on a machine with few cores, competes with the prefill of the request
that follows — on a queue that is always full (mlx-lm's sequential path), with every
request after the first. An owner that serves requests says when one is in flight
(`busy`) and when none is (`idle`); a capture waits to be written until the owner has
been idle for `settle` seconds, at most `max_delay` seconds after it was submitted, so a
server that never idles still persists. `flush` and `close` write at once, and so does
every capture while the owner says the writes are pressing (`pressing`: a memory tier
near its budget parks only what is written, and drops the rest). An owner that never
calls `busy` is never waited for.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, Optional, Tuple


_POLL = 0.05  # seconds between looks at `pressing` while a capture waits


class Autosaver:
    """One background writer.

    Args:
        write: writes a capture (file I/O only, no MLX); returns bytes on disk.
        settle: a capture is written once the owner has been idle this long ...
        max_delay: ... or this many seconds after it was submitted, busy or not.
        pressing: called (from the writer's thread, often) while a capture waits: True
            writes it now, busy or not.
    """

    def __init__(self, write: Callable[..., int], *, settle: float = 0.2,
                 max_delay: float = 30.0, pressing: Callable[[], bool] = lambda: False) -> None:
        self._write = write
        self._pressing = pressing
        self.settle = float(settle)
        self.max_delay = float(max_delay)
        self._cv = threading.Condition()
        self._pending: Optional[Tuple] = None
        self._since = 0.0  # when the oldest capture not yet written was submitted
        self._busy = False
        self._quiet_since = 0.0
        self._flushing = 0  # callers of `flush` waiting: write now
        self._submitted = 0  # captures submitted so far
        self._settled = 0  # submitted captures written or superseded
        self._closed = False
        self._failing = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, plan: Tuple) -> None:
        """Write ``plan`` soon (returns at once)."""
        with self._cv:
            if self._closed:
                return
            if self._pending is None:
                self._since = time.monotonic()
            self._pending = plan
            self._submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlx_kvcache-autosave",
                                                daemon=True)
                self._thread.start()

    def wrap_write(self, wrap: Callable[[Callable[..., int]], Callable[..., int]]) -> None:
        """Replace the write function by ``wrap(write)`` (a profile timing it)."""
        with self._cv:
            self._write = wrap(self._write)

    @property
    def pending(self) -> bool:
        """Whether a submitted capture is not yet written (or superseded)."""
        with self._cv:
            return self._settled < self._submitted

    def busy(self) -> None:
        """The owner is serving a request: captures not yet started wait (`max_delay`)."""
        with self._cv:
            self._busy = True

    def idle(self) -> None:
        """The owner has no request in flight: waiting captures are written after `settle`."""
        with self._cv:
            if self._busy:
                self._busy = False
                self._quiet_since = time.monotonic()
                self._cv.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything submitted so far is on disk (written now, busy or not);
        False on timeout."""
        with self._cv:
            goal = self._submitted
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: self._settled >= goal, timeout=timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: Optional[float] = None,
              recapture: Optional[Callable[[], Tuple]] = None) -> None:
        """Finish pending writes and stop; with ``recapture``, capture and write once more
        (in the calling thread): what changed since the last capture, what a failed write
        owed, and rows the writer asked to have captured again."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
        if recapture is not None:
            self._write_once(recapture())

    def _wait_turn(self) -> None:
        """Under the lock: return when the pending capture may be written."""
        while not (self._flushing or self._closed or self._pressed()):
            now = time.monotonic()
            late = self._since + self.max_delay - now
            if late <= 0:
                return
            left = late if self._busy else min(late, self._quiet_since + self.settle - now)
            if left <= 0:
                return
            self._cv.wait(min(left, _POLL))  # `pressing` changes unannounced

    def _pressed(self) -> bool:
        try:
            return bool(self._pressing())
        except Exception:  # the writer thread must not die of it: write now
            return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._pending is not None:
                    self._wait_turn()
                if self._pending is None:
                    self._thread = None
                    self._cv.notify_all()
                    return
                plan, self._pending = self._pending, None
                goal = self._submitted
            self._write_once(plan)
            with self._cv:
                self._settled = goal
                self._cv.notify_all()

    def failed(self, e: Exception) -> None:
        """Report a failed save (one warning until a save succeeds again)."""
        if not self._failing:
            self._failing = True
            warnings.warn(f"mlx_kvcache: could not save the prefix cache: {e} (further "
                          f"failures are not reported until a save succeeds)",
                          RuntimeWarning, stacklevel=3)

    def _write_once(self, plan: Tuple) -> None:
        try:
            self._write(*plan)
        except Exception as e:  # a full or read-only disk must never break generation
            self.failed(e)
            return
        if self._failing:
            self._failing = False
            warnings.warn("mlx_kvcache: saving the prefix cache works again", RuntimeWarning,
                          stacklevel=2)
