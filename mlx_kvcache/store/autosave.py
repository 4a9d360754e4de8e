"""Writing a persistent cache in the background, off the request path.

At the end of each request the owner captures the trie (`PersistentStore.capture`: on the
MLX thread, inside the manager's critical section; quick, no file I/O) and submits the
capture here; one worker thread writes it. A capture submitted while another waits
replaces it (the newer one holds everything the older one did), so a slow disk never
queues work. A directory that cannot be written gives one warning, then silence until a
write succeeds again (then one line says so). The worker exits when idle: no thread
outlives the work, and nothing keeps an unused cache alive.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Optional, Tuple


class Autosaver:
    """One background writer.

    Args:
        write: writes a capture (file I/O only, no MLX); returns bytes on disk.
    """

    def __init__(self, write: Callable[..., int]) -> None:
        self._write = write
        self._cv = threading.Condition()
        self._pending: Optional[Tuple] = None
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
            self._pending = plan
            self._submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlx_kvcache-autosave",
                                                daemon=True)
                self._thread.start()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything submitted so far is on disk; False on timeout."""
        with self._cv:
            goal = self._submitted
            return self._cv.wait_for(lambda: self._settled >= goal, timeout=timeout)

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

    def _loop(self) -> None:
        while True:
            with self._cv:
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
