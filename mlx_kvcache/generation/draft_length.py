"""How many tokens the draft model proposes in the next round of speculative decoding.

mlx-lm drafts ``num_draft_tokens`` every round, whatever they earn. A round of ``k``
drafts costs ``k`` draft steps and one target pass over ``k + 1`` tokens (about one
target step where decoding is bound by reading the weights, as it is on Apple Silicon),
and emits ``1 + a + a^2 + ... + a^k`` tokens on average when the target accepts each
proposal with probability ``a`` (a round stops at the first rejection). With ``c`` the
cost of a draft step relative to a target step, the round's speed relative to plain
decoding is ``(1 - a^(k+1)) / (1 - a) / (1 + k c)``. `DraftLength` drafts the ``k`` (at
most the request's ``num_draft_tokens``) that maximises it, with ``a`` estimated from the
rounds so far and ``c`` the ratio of the two models' weight bytes. A draft that no
acceptance could make pay (``c >= 1``: one as large as the target) is set aside by every
front end: not run and not cached at all (`draft_set_aside`). When no ``k > 0`` pays (a
poor draft stops paying), the round is a plain target step and the draft is left
behind: it catches up in one pass when drafting resumes, or at the end of the request
(what the trie stores is unchanged). While not drafting, a one-token probe every 8, 16,
... 128 rounds re-measures the acceptance (one that comes true is followed by another at
once).

Which tokens are emitted never depends on ``k`` (every emitted token is the target's own
sample: see `speculative`), only how fast they come. The choice depends only on the
tokens and the models' sizes, so a request replays identically.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Literal, Optional

from .pass_cost import PassCost
from .sizing import model_bytes

__all__ = ["DraftLength", "DraftLengths", "DraftPolicy", "LookupLength", "LookupTally",
           "POLICIES", "check_policy", "draft_cost", "draft_length_for", "draft_set_aside"]

DraftPolicy = Literal["adaptive", "fixed"]
#: ``adaptive``: `DraftLength`; ``fixed``: ``num_draft_tokens`` every round (mlx-lm's).
POLICIES = ("adaptive", "fixed")


def draft_cost(target: Any, draft: Any) -> float:
    """A draft step's cost relative to a target step: the ratio of their weight bytes
    (decoding reads every weight once a step)."""
    t = model_bytes(target)
    return model_bytes(draft) / t if t else 1.0


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of `POLICIES`, else a ValueError naming the choices."""
    if policy not in POLICIES:
        raise ValueError(f"draft_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


class DraftLength:
    """The draft length of each round, learned from the acceptance of the rounds before.

    One instance serves every request of a model pair (the acceptance carries over to the
    next request); `next` and `observe` may be called from any thread.

    Args:
        cost: a draft step's cost relative to a target step (`draft_cost`).
        prior: the acceptance assumed before any round, worth ``weight`` proposals.
        memory: each observation's weight decays by this factor per round, so the
            estimate follows a conversation whose text becomes easier or harder to draft.
    """

    PROBE_FIRST, PROBE_MOST = 8, 128

    def __init__(self, cost: float, *, prior: float = 0.6, weight: float = 4.0,
                 memory: float = 0.95) -> None:
        if not cost >= 0:
            raise ValueError(f"cost must be >= 0, got {cost!r}")
        self.cost = float(cost)
        self._prior, self._weight, self._memory = float(prior), float(weight), float(memory)
        self._accepted = self._trials = 0.0
        self._idle, self._wait = 0, self.PROBE_FIRST
        self._lock = threading.Lock()

    @property
    def acceptance(self) -> float:
        """The estimated probability that the target accepts a proposal."""
        with self._lock:
            return self._estimate()

    def _estimate(self) -> float:
        return (self._accepted + self._prior * self._weight) / (self._trials + self._weight)

    def speed(self, k: int, acceptance: Optional[float] = None) -> float:
        """Tokens per target-step cost of a round of ``k`` drafts (1.0: plain decoding)."""
        a = self.acceptance if acceptance is None else acceptance
        return sum(a ** i for i in range(k + 1)) / (1 + k * self.cost)

    def best(self, most: int, acceptance: Optional[float] = None) -> int:
        """The ``k`` in ``0..most`` with the highest `speed` (the smallest on a tie)."""
        a = self.acceptance if acceptance is None else acceptance
        speeds = [self.speed(k, a) for k in range(max(0, int(most)) + 1)]
        return max(range(len(speeds)), key=lambda k: (speeds[k], -k))

    @property
    def ever_pays(self) -> bool:
        """Whether drafting could pay at all: a draft the target always accepted would
        (false from a draft step costing a target step on)."""
        return self.best(1, 1.0) > 0

    def next(self, most: int) -> int:
        """Drafts for the next round, at most ``most``."""
        if most <= 0:
            return 0
        with self._lock:
            k = self.best(most, self._estimate())
            if k:
                self._idle, self._wait = 0, self.PROBE_FIRST
                return k
            if not self.ever_pays:
                return 0
            self._idle += 1
            if self._idle < self._wait:
                return 0
            self._idle, self._wait = 0, min(2 * self._wait, self.PROBE_MOST)
            return 1

    def observe(self, proposed: int, accepted: int) -> None:
        """A round's outcome: ``accepted`` of ``proposed`` drafts (a round stops at its
        first rejection, so each accepted draft and that rejection are the trials)."""
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        with self._lock:
            m = self._memory
            self._accepted = m * self._accepted + accepted
            self._trials = m * self._trials + trials
            if accepted == proposed:  # a probe that came true: the next round probes again
                self._wait = 1


def draft_length_for(policy: str, target: Any, draft: Any) -> Optional[DraftLength]:
    """A `DraftLength` for the pair under ``policy`` (None: ``fixed``, or no draft)."""
    if draft is None or check_policy(policy) == "fixed":
        return None
    return DraftLength(draft_cost(target, draft))


def draft_set_aside(policy: str, target: Any, draft: Any) -> Optional[str]:
    """Why ``draft`` is not used beside ``target`` under ``policy`` (None: it is).

    Under ``adaptive`` a draft whose step costs at least a target step can never pay
    (`DraftLength.ever_pays`), whatever the target accepts: kept, it would draft nothing
    and still prefill every prompt and hold its layers in every cached prefix. The front
    ends then serve the target alone; answers are the target's either way."""
    if draft is None or check_policy(policy) == "fixed":
        return None
    cost = draft_cost(target, draft)
    if DraftLength(cost).ever_pays:
        return None
    return (f"a step of the draft model costs {cost:.2f} of a step of the model (their weight "
            f"bytes), so drafting can never pay for itself")


def _ref(model: Any) -> Any:
    """A weak reference to ``model`` (None: a callable answering None)."""
    return (lambda: None) if model is None else weakref.ref(model)


class DraftLengths:
    """The `DraftLength` of whichever model pair is in use under one policy (a server that
    switches models starts learning again; the last pair's is kept). The pair is held
    weakly: a model switch frees the old models' weights."""

    def __init__(self, policy: str) -> None:
        self.policy = check_policy(policy)
        self._lock = threading.Lock()
        self._pair: Any = None
        self._length: Optional[DraftLength] = None

    @property
    def current(self) -> Optional[DraftLength]:
        """The `DraftLength` of the pair used last (None: none yet, or ``fixed``)."""
        with self._lock:
            return self._length

    def for_pair(self, target: Any, draft: Any) -> Optional[DraftLength]:
        """The pair's `DraftLength` (None: ``fixed``, or no draft)."""
        with self._lock:
            held = None if self._pair is None else (self._pair[0](), self._pair[1]())
            if held is None or held[0] is not target or held[1] is not draft:
                self._pair = (_ref(target), _ref(draft))
                self._length = draft_length_for(self.policy, target, draft)
            return self._length


def _bucket(match: int) -> int:
    """The acceptance bucket of a lookup match of ``match`` tokens."""
    for i, lo in enumerate(LookupLength.BUCKETS):
        if match < lo:
            return i - 1
    return len(LookupLength.BUCKETS) - 1


class LookupTally:
    """One request's own lookup rounds, per match-length bucket (`LookupLength`): how
    much this request's text copies, which may be far from what the model's other
    requests did (an edit before, an explanation now). Owned by one request."""

    def __init__(self) -> None:
        n = len(LookupLength.BUCKETS)
        self.accepted, self.trials = [0.0] * n, [0.0] * n


class LookupLength:
    """How many tokens of a prompt-lookup proposal (`lookup.PromptLookup`) a round verifies.

    The proposal costs nothing to make, but verifying it does (`PassCost`: ``alpha + c k``
    relative to a plain step, measured), and whether the target goes on agreeing depends
    mostly on how far back the context already agrees: the acceptance is estimated apart
    for each bucket of match length (`BUCKETS`), from the rounds of every request of the
    model, and within a request from its own rounds (`LookupTally`), the model's estimate
    their prior. A round verifies the ``k`` (at most what the proposal holds and the
    request allows) with the most tokens per unit of cost, ``(1 + a + ... + a^k) /
    cost(k)``; none where no ``k`` pays. So a request falls back to plain decoding at once
    where its text stops copying (a new match is short, and short matches are the ones
    that failed, in this request first) and drafts long runs where it copies. A bucket
    that does not pay is re-measured by a one-token probe on its 8th, then 16th, ... 128th
    match.

    One instance serves every request of a model (acceptance carries over); `next` and
    `observe` may be called from any thread. Which tokens are emitted never depends on it.
    """

    #: Lower bounds of the match-length buckets.
    BUCKETS = (1, 2, 3, 4, 6, 9, 16, 32)
    #: The acceptance assumed before any round, per bucket (worth ``weight`` proposals).
    PRIORS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85)
    #: What the model's estimate is worth in a request's own (in its rounds' trials): one
    #: failure of this request halves it.
    REQUEST_PRIOR = 1.0
    PROBE_FIRST, PROBE_MOST = 8, 128

    def __init__(self, cost: Optional[PassCost] = None, *, weight: float = 2.0,
                 memory: float = 0.97) -> None:
        self.cost = cost if cost is not None else PassCost()
        self._weight, self._memory = float(weight), float(memory)
        n = len(self.BUCKETS)
        self._accepted, self._trials = [0.0] * n, [0.0] * n
        self._idle, self._wait = [0] * n, [self.PROBE_FIRST] * n
        self._lock = threading.Lock()

    def acceptance(self, match: int, tally: Optional[LookupTally] = None) -> float:
        """The estimated probability that the target accepts a token proposed by a match
        of ``match`` tokens (in the request of ``tally``, when given)."""
        b = _bucket(match)
        with self._lock:
            a = self._estimate(b)
        if tally is None:
            return a
        w = self.REQUEST_PRIOR
        return (tally.accepted[b] + a * w) / (tally.trials[b] + w)

    def _estimate(self, b: int) -> float:
        return ((self._accepted[b] + self.PRIORS[b] * self._weight)
                / (self._trials[b] + self._weight))

    def speed(self, match: int, k: int, acceptance: Optional[float] = None) -> float:
        """Tokens per plain-step cost of a round verifying ``k`` tokens of a match of
        ``match`` tokens (1.0: plain decoding)."""
        a = self.acceptance(match) if acceptance is None else acceptance
        return sum(a ** i for i in range(k + 1)) / self.cost.relative(k)

    def best(self, match: int, most: int, tally: Optional[LookupTally] = None) -> int:
        """The ``k`` in ``0..most`` with the highest `speed` (the smallest on a tie)."""
        a = self.acceptance(match, tally)
        speeds = [self.speed(match, k, a) for k in range(max(0, int(most)) + 1)]
        return max(range(len(speeds)), key=lambda k: (speeds[k], -k))

    def next(self, match: int, most: int, tally: Optional[LookupTally] = None) -> int:
        """Tokens to verify of a proposal of a ``match``-token match, at most ``most``."""
        if most <= 0 or match <= 0:
            return 0
        k = self.best(match, most, tally)
        b = _bucket(match)
        with self._lock:
            if k:
                self._idle[b], self._wait[b] = 0, self.PROBE_FIRST
                return k
            self._idle[b] += 1
            if self._idle[b] < self._wait[b]:
                return 0
            self._idle[b], self._wait[b] = 0, min(2 * self._wait[b], self.PROBE_MOST)
            return 1

    def observe(self, match: int, proposed: int, accepted: int,
                tally: Optional[LookupTally] = None) -> None:
        """A round's outcome: ``accepted`` of the ``proposed`` tokens of a ``match``-token
        match (a round stops at its first rejection), in the request of ``tally``."""
        if proposed <= 0 or match <= 0:
            return
        b = _bucket(match)
        trials = accepted + (1 if accepted < proposed else 0)
        if tally is not None:
            tally.accepted[b] += accepted
            tally.trials[b] += trials
        with self._lock:
            m = self._memory
            self._accepted[b] = m * self._accepted[b] + accepted
            self._trials[b] = m * self._trials[b] + trials
            if accepted == proposed:  # a probe that came true: the next match probes again
                self._wait[b] = 1
