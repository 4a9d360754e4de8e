"""Memory for request bodies: one byte budget for the bodies being received, parsed and
held by the requests running (``--body-budget``).

A JSON body's parse can build many times its size — 60 MiB of empty objects in an ignored
field became 1.6 GB of Python objects, and nothing bounded how many parsed at once. Each
request reserves what its body costs: its bytes as they arrive, then (`routes.body`) an
upper bound of what parsing it builds, before it is parsed; the reservation is held until
the request ends (its parsed body lives as long). A reservation that does not fit waits
for others to end, until the request's deadline (`BudgetBusy`: a 503); one larger than the
budget can ever give is refused at once (`BudgetExceeded`: a 413). Requests from other
machines hold at most the budget less a share kept for loopback clients, so a client on
the network cannot take every byte from local agents.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

__all__ = ["BodyBudget", "BodyHold", "BudgetBusy", "BudgetExceeded", "DEFAULT_BODY_BUDGET",
           "default_body_budget", "LOOPBACK_SHARE"]

#: The budget by default: 1 GiB, at most an eighth of the machine's memory.
DEFAULT_BODY_BUDGET = 1 << 30
#: The part of the budget kept for loopback clients.
LOOPBACK_SHARE = 1 / 8


def default_body_budget(machine_bytes: Optional[int]) -> int:
    """`DEFAULT_BODY_BUDGET`, at most an eighth of ``machine_bytes`` (unknown: the default)."""
    if not machine_bytes:
        return DEFAULT_BODY_BUDGET
    return max(64 << 20, min(DEFAULT_BODY_BUDGET, int(machine_bytes) // 8))


class BudgetExceeded(Exception):
    """A reservation the budget can never give: ``nbytes`` asked, ``limit`` at most."""

    def __init__(self, nbytes: int, limit: int) -> None:
        super().__init__(f"{nbytes} bytes asked, {limit} at most")
        self.nbytes, self.limit = int(nbytes), int(limit)


class BudgetBusy(Exception):
    """A reservation that did not fit before its deadline (others hold ``held`` bytes)."""

    def __init__(self, nbytes: int, held: int) -> None:
        super().__init__(f"{nbytes} bytes asked while others hold {held}")
        self.nbytes, self.held = int(nbytes), int(held)


class BodyBudget:
    """``total`` bytes for request bodies; loopback clients may use all of it, others
    together all but ``loopback_share``. Any thread."""

    def __init__(self, total: int, loopback_share: float = LOOPBACK_SHARE) -> None:
        if total < 1:
            raise ValueError(f"a body budget is at least 1 byte, got {total}")
        self.total = int(total)
        self.others_total = max(1, self.total - int(self.total * loopback_share))
        self._cond = threading.Condition()
        self._held = 0
        self._others_held = 0
        self.busy_refusals = 0
        self.exceeded_refusals = 0

    def limit(self, loopback: bool) -> int:
        """The most one request from such a client may hold."""
        return self.total if loopback else self.others_total

    def hold(self, loopback: bool) -> "BodyHold":
        """An empty reservation for one request (its `BodyHold.grow` reserves)."""
        return BodyHold(self, loopback)

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def _grow(self, nbytes: int, loopback: bool, already: int,
              deadline: Optional[float]) -> None:
        if already + nbytes > self.limit(loopback):
            with self._cond:
                self.exceeded_refusals += 1
            raise BudgetExceeded(already + nbytes, self.limit(loopback))
        with self._cond:
            while not self._fits(nbytes, loopback):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.busy_refusals += 1
                    raise BudgetBusy(nbytes, self._held)
                self._cond.wait(left)
            self._held += nbytes
            if not loopback:
                self._others_held += nbytes

    def _fits(self, nbytes: int, loopback: bool) -> bool:
        if self._held + nbytes > self.total:
            return False
        return loopback or self._others_held + nbytes <= self.others_total

    def _release(self, nbytes: int, loopback: bool) -> None:
        with self._cond:
            self._held -= nbytes
            if not loopback:
                self._others_held -= nbytes
            self._cond.notify_all()


class BodyHold:
    """One request's reservation in a `BodyBudget` (``held`` bytes), given back by
    `release` (idempotent)."""

    def __init__(self, budget: BodyBudget, loopback: bool) -> None:
        self.budget, self.loopback = budget, loopback
        self.held = 0
        self._lock = threading.Lock()

    def grow(self, nbytes: int, deadline: Optional[float]) -> None:
        """Reserve ``nbytes`` more, waiting for room until ``deadline``
        (``time.monotonic()``; None: for good): `BudgetExceeded` when this request would
        hold more than its client may at all, `BudgetBusy` when the deadline passed."""
        if nbytes <= 0:
            return
        self.budget._grow(nbytes, self.loopback, self.held, deadline)
        with self._lock:
            self.held += nbytes

    def release(self) -> None:
        """Give back everything held."""
        with self._lock:
            n, self.held = self.held, 0
        if n:
            self.budget._release(n, self.loopback)
