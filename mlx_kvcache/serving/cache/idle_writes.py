"""When the disk tier's captures run: while mlx-lm's batch is idle, not on a request's path.

A capture (`PersistentStore.capture`) runs on the generation thread inside the trie's
critical section and hands the background writer new snapshot files to serialize, CRC,
fsync and index; on a 2-core machine that writer competes with the prefill of the very
requests that follow, and its Python parts with their GIL. Nothing waits for the write
(the trie already holds what it writes), so the server notes that an insert changed
the trie and captures once the generation loop has no request in flight — a turn of an
agent session is followed by its tool's run. Under load that never idles, a capture is
still taken once `limit` inserts or `max_age` seconds have gone by, so the disk never
falls far behind. A capture hands everything pending to the model's writer at once
(`capture`); one an eviction forces runs inside the trie's critical section
(`capture_inside`).
"""

from __future__ import annotations

import time
from typing import Optional

from .model_state import ModelState


class IdleWrites:
    """Counts the inserts not yet captured and says when to capture.

    Args:
        limit: capture at the insert that makes this many pending, idle or not.
        max_age: ... or at the first insert this many seconds after the oldest pending one.
    """

    def __init__(self, limit: int = 32, max_age: float = 120.0) -> None:
        self.limit = int(limit)
        self.max_age = float(max_age)
        self.pending = 0
        self._since: Optional[float] = None

    def changed(self) -> bool:
        """An insert changed the trie; True when its capture is due now (busy or not)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self.pending += 1
        return self.pending >= self.limit or now - self._since >= self.max_age

    def taken(self) -> None:
        """A capture took everything pending."""
        self.pending = 0
        self._since = None

    def capture(self, st: ModelState) -> None:
        """Hand what changed in ``st``'s trie to its background writer (everything
        pending is taken)."""
        self.taken()
        if st.writer is not None:
            st.manager.run(st.core.autosave)

    def capture_inside(self, st: ModelState) -> None:
        """Capture the pending inserts now, from inside ``st``'s trie's critical section
        (an eviction is about to drop what they made); nothing pending: nothing."""
        if self.pending and st.writer is not None:
            self.taken()
            st.core.autosave()
