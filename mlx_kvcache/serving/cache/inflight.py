"""Work in flight: the prompts being computed right now, so that a request sharing one's
prefix reads it from the cache once it is stored instead of computing it again.

Parallel subagents, forks and retries reach the server together: each prompt starts with
the same long prefix (a system prompt, tool schemas, a parent's history) that the trie does
not hold yet, and each request's fetch finds nothing — so each computes all of it. Here the
generation thread keeps a registry of the prompts it is computing (`Flight`: its trie key,
where it started, how far it has computed, where it was asked to store its caches). A new
request whose prompt shares more with a flight than with the trie (`InFlight.best`) asks
that flight to store its caches at the point where the two prompts diverge (`Flight.cut`:
a checkpoint added to a prefill already under way — the only place a hybrid or
sliding-window model can restore the shared part) and is kept aside (`Hold`) until the
flight has passed that point; its fetch then reads the shared part from the trie like any
other cached prefix, and it computes only its own tail.

Exact, bounded, safe:

* nothing is read but what the trie holds: a follower's fetch is an ordinary fetch, of
  states the flight stored whole (the trie changes only in its short critical sections);
  no follower ever touches a flight's live caches;
* a request is held only when it shares at least `MIN_SHARED` tokens beyond what the trie
  gives it now and the flight is not behind what the trie gives it, and never longer than
  the prefill steps computing that part itself would take (`Share.budget`: the flight's
  steps to the shared point through its segment ends — the same prefix has the same ends
  — plus those it is ahead, plus one; one more for each cut added for another request
  below that point later): counted in the batch's steps, not seconds, so a slow machine
  changes nothing (`Hold.state`); a request sharing nothing in flight goes straight in;
* a flight that ends first — its client left, it failed, it was cut, its prompt is done —
  releases its followers, which then compute what the trie lacks for themselves.

Who computes: mlx-lm's batch (`engine.flight_batch`: a flight per inserted request, a cut
splits its remaining prompt segments; the followers are held by the generation thread,
`engine.followers`), the sequential path (`sequential.prefill`: the prompt being fetched is a
flight; the requests queued behind it ask it for stops between chunks), and anything else
that computes a prefix on the generation thread (foresight could: `InFlight.begin` with no
``cut`` records the stops asked for in `Flight.requested`). One process only: on the ranks of
a sharded model holding a request would have to be agreed per turn; there it is off.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import numpy as np

from ...prefix.tokens import as_tokens, common_prefix

__all__ = ["Flight", "Hold", "InFlight", "MIN_SHARED", "Share", "Waited", "steps_for"]

#: A request is held for a prefix in flight only when it would read at least this many more
#: tokens than the trie gives it now (less is cheaper to compute than to wait for).
MIN_SHARED = 32


def steps_for(tokens: int, step: int) -> int:
    """Prefill steps that compute ``tokens`` at ``step`` tokens a step, plus one (a chunk
    that a segment end shortens)."""
    return -(-max(tokens, 0) // max(step, 1)) + 1


class Flight:
    """One prompt being computed on the generation thread (see the module doc).

    Args:
        owner: the registry.
        key: the prompt's trie key (its ids, salted with its namespace).
        start: the tokens it restored (its computing starts there).
        model: what names the model it runs on (mlx-lm's ``args.model``: a follower must
            run on the same one); None: any.
        cut: the computing side's verb — make the caches be stored at this offset (True),
            or say it cannot (False: it has passed it, it has no prompt left...). None: the
            flight records the offsets asked for (`requested`) for its computing side to
            read between chunks (the sequential path, foresight).
        steps: the computing side's count of the prefill steps to an offset (its chunks
            through the segment ends before it); None: whole steps of ``step`` tokens.
        holds: whether a follower may be held for it (it advances while the generation loop
            turns: mlx-lm's batch); False for one computed inside one call of the loop (the
            sequential path), whose followers simply wait in the queue.
    """

    def __init__(self, owner: "InFlight", key: np.ndarray, start: int, model: Any = None,
                 cut: Optional[Callable[[int], bool]] = None, holds: bool = False,
                 steps: Optional[Callable[[int, int], int]] = None) -> None:
        self._owner = owner
        self.key = key
        self.start = self.at = int(start)
        self.model = model
        self.holds = bool(holds)
        self.ended = False
        #: Offsets it was asked to store its caches at, and accepted.
        self.requested: Set[int] = set()
        self._cut = cut
        self._steps = steps

    @property
    def prompt_tokens(self) -> int:
        return len(self.key)

    def advanced(self, at: int) -> None:
        """Its caches now hold the prompt's first ``at`` tokens."""
        self.at = max(self.at, int(at))

    def cut(self, offset: int) -> bool:
        """Ask that its caches be stored at ``offset``; whether they will be (or are)."""
        if self.ended or not self.start < offset < self.prompt_tokens:
            return False
        if offset in self.requested:
            return True
        if self._cut is not None:
            ok = bool(self._cut(offset))
        else:
            ok = offset > self.at
        if ok:
            self.requested.add(offset)
            self._owner.count("cuts")
        return ok

    def steps_to(self, offset: int, step: int) -> int:
        """Prefill steps of ``step`` tokens it needs to reach ``offset`` (0: there)."""
        if offset <= self.at:
            return 0
        if self._steps is not None:
            return self._steps(offset, step)
        return -(-(offset - self.at) // max(step, 1))

    def cuts_below(self, offset: int) -> int:
        """Cuts it accepted below ``offset`` (each may cost it a chunk more to get there)."""
        return sum(1 for s in self.requested if s < offset)

    def stops_in(self, after: int, upto: int) -> List[int]:
        """The offsets asked for in ``(after, upto]``, ascending (`requested`)."""
        return sorted(s for s in self.requested if after < s <= upto)

    def end(self) -> None:
        """It computes no more of its prompt (done, removed, failed): its followers go."""
        if not self.ended:
            self.ended = True
            self._owner.ended(self)


@dataclass(frozen=True)
class Share:
    """What a request would read from a flight: its first ``offset`` tokens are the
    flight's, the trie restores it ``restored`` now; ``budget``: the most prefill steps it
    may wait (what computing ``offset - restored`` itself would take, see the module doc)."""

    flight: Flight
    offset: int
    restored: int
    budget: int

    @property
    def tokens(self) -> int:
        return self.offset - self.restored


@dataclass
class Hold:
    """A request (``item``, the generation thread's) kept aside for ``share``."""

    item: Any
    share: Share
    steps: int  # the registry's prefill steps when it was held
    cuts: int = 0  # the flight's cuts below the shared point when it was held
    since: float = field(default_factory=time.monotonic)

    def state(self, steps_now: int) -> Optional[str]:
        """Why it may go now — ``"stored"`` (the flight passed the shared point: the trie
        holds it), ``"ended"`` (the flight ended first), ``"bound"`` (it waited as many
        prefill steps as computing the part itself takes) — or None: it waits on."""
        f, offset = self.share.flight, self.share.offset
        if f.at >= offset:
            return "stored"
        if f.ended:
            return "ended"
        if steps_now - self.steps >= self.share.budget + f.cuts_below(offset) - self.cuts:
            return "bound"
        return None


@dataclass(frozen=True)
class Waited:
    """What a request released from a hold brings to its fetch: how long it waited, the
    tokens it waited for (the shared point) and what the trie restored it when it was held,
    and why it went (`Hold.state`)."""

    seconds: float
    offset: int
    restored: int
    how: str

    def note(self, restored_now: int) -> str:
        """Its part of the request's ``[cache]`` line, given what its fetch restored."""
        shared = max(0, restored_now - self.restored)
        why = {"stored": "", "ended": "; its request ended first",
               "bound": "; as long as computing it takes"}[self.how]
        read = (f": read {shared} tok computed for another request" if shared
                else ": computed here")
        return f" | waited {self.seconds:.2f} s for a prefix in flight{why}{read}"


class InFlight:
    """The registry of flights, the holds' counters and ``GET /v1/cache`` ``in_flight``.
    Changed on the generation thread only; `report` may be read from any thread.

    Args:
        enabled: False: `begin` hands out flights nobody is held for (``--no-share-in-flight``,
            the ranks of a sharded model).
        min_shared: hold a request only for at least this many tokens (`MIN_SHARED`).
    """

    def __init__(self, enabled: bool = True, min_shared: int = MIN_SHARED) -> None:
        self.enabled = bool(enabled)
        self.min_shared = max(1, int(min_shared))
        self._flights: List[Flight] = []
        self._lock = threading.Lock()
        #: Prefill steps taken by the batch (the holds' bound counts these).
        self.steps = 0
        self.holding = 0  # requests held now
        self._counts: Dict[str, float] = dict.fromkeys(
            ("held", "stored", "ended", "bound", "left", "cuts", "shared_tokens",
             "wait_seconds"), 0)

    # -- flights --------------------------------------------------------------------------
    def begin(self, key, start: int, model: Any = None,
              cut: Optional[Callable[[int], bool]] = None, holds: bool = False,
              steps: Optional[Callable[[int, int], int]] = None) -> Flight:
        """A prompt with the trie key ``key`` starts computing from ``start`` (see `Flight`);
        `Flight.end` when it computes no more of it."""
        f = Flight(self, as_tokens(key), start, model, cut, holds, steps)
        if self.enabled:
            self._flights.append(f)
        return f

    def ended(self, flight: Flight) -> None:
        if flight in self._flights:
            self._flights.remove(flight)

    def running(self) -> int:
        """Flights computing now."""
        return len(self._flights)

    def best(self, key, restored: int, step: int, model: Any = None,
             holds: Optional[bool] = None) -> Optional[Share]:
        """The flight a prompt with the trie key ``key`` (on the model ``model``) should
        read from, given that the trie restores it ``restored`` tokens now and that the
        batch prefills ``step`` tokens a step: the one it shares the most with, when that
        is at least `min_shared` tokens beyond ``restored`` and the flight is not behind
        ``restored`` (None otherwise). The shared point stops a token short of either
        prompt's end (a fetch leaves a token to compute; a flight's prompt ends in its
        answer, stored only once it ends). ``holds``: only flights whose `Flight.holds` is
        that."""
        if not self._flights:
            return None
        key = as_tokens(key)
        best: Optional[Share] = None
        for f in self._flights:
            if f.ended or (model is not None and f.model is not None and f.model != model):
                continue
            if holds is not None and f.holds != holds:
                continue
            offset = min(common_prefix(key, f.key), len(key) - 1, f.prompt_tokens - 1)
            if offset - restored < self.min_shared or f.at < restored:
                continue  # too little to wait for, or it would compute what the trie has
            budget = f.steps_to(offset, step) + steps_for(f.at - restored, step)
            if best is None or (offset, f.at) > (best.offset, best.flight.at):
                best = Share(f, offset, restored, budget)
        return best

    # -- holds ----------------------------------------------------------------------------
    def prefill_step(self) -> None:
        """The batch took a prefill step (the holds' bound)."""
        self.steps += 1

    def hold(self, item: Any, share: Share) -> Hold:
        """``item`` waits for ``share`` (counted)."""
        self.holding += 1
        self.count("held")
        return Hold(item, share, self.steps, share.flight.cuts_below(share.offset))

    def release(self, hold: Hold, how: str) -> Waited:
        """``hold`` ends (``how``: its `Hold.state`, or ``"left"``: its client left);
        returns what its fetch logs."""
        self.holding = max(0, self.holding - 1)
        seconds = time.monotonic() - hold.since
        self.count(how)
        self.count("wait_seconds", seconds)
        return Waited(seconds, hold.share.offset, hold.share.restored, how)

    def fetched(self, waited: Waited, restored: int) -> int:
        """A released request's fetch restored ``restored`` tokens: the tokens it read that
        were computed for another request while it waited (counted)."""
        shared = max(0, restored - waited.restored)
        self.count("shared_tokens", shared)
        return shared

    def count(self, what: str, n: float = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def report(self) -> Dict[str, Any]:
        """``GET /v1/cache`` ``in_flight``: flights running and requests held now; requests
        held so far and why each went (``stored``: it read the shared part; ``ended``: the
        flight ended first; ``bound``: it waited as long as computing takes; ``left``: its
        client left), checkpoints added to flights (``cuts``), tokens read that another
        request computed while they waited (``shared_tokens``) and the seconds waited."""
        with self._lock:
            c = dict(self._counts)
        flights = [{"prompt_tokens": f.prompt_tokens, "start": f.start, "computed": f.at}
                   for f in list(self._flights)]
        return {"enabled": self.enabled, "running": len(flights), "flights": flights,
                "holding": self.holding, "held": int(c["held"]),
                "released": {k: int(c[k]) for k in ("stored", "ended", "bound", "left")},
                "cuts": int(c["cuts"]), "shared_tokens": int(c["shared_tokens"]),
                "wait_seconds": round(c["wait_seconds"], 3)}
