"""Scripted proposals for prompt-lookup tests: random tiny models rarely accept a real
lookup draft, so these propose what plain decoding emits, up to a chosen point, then a
wrong token — partial acceptance exactly where a test wants it (a window's wrap, the
middle of a recurrent layer's pass) — and a policy that verifies all of it."""

from typing import Callable, List, Sequence

from mlx_kvcache.generation.draft_length import LookupLength
from mlx_kvcache.generation.lookup import LookupPlan
from mlx_kvcache.generation.pass_cost import PassCost


class ScriptedDrafter:
    """Proposes ``ref`` (the prompt and plain decoding's answer) from the current
    position: ``agree(pos)`` tokens of it, then wrong ones.
    Checks that what it is told was emitted is ``ref``'s."""

    def __init__(self, ref: Sequence[int], tokens: Sequence[int],
                 agree: Callable[[int], int], vocab: int) -> None:
        self.ref, self.agree, self.vocab = list(ref), agree, vocab
        self.n = len(tokens)
        assert list(tokens) == self.ref[: self.n]
        self.calls: List[int] = []

    def __len__(self) -> int:
        return self.n

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            assert self.n < len(self.ref) and t == self.ref[self.n], (self.n, t)
            self.n += 1

    def propose(self, most: int):
        right = self.ref[self.n: self.n + most]
        j = min(self.agree(self.n), len(right))
        out = right[:j] + [(t + 1) % self.vocab for t in right[j:]]  # wrong from j on
        self.calls.append(self.n)
        return out[:most], 8  # (a "match" long enough for any policy)


class VerifyAll(LookupLength):
    """A lookup policy that verifies every proposed token (the tests' rounds are chosen
    by the script), with a fixed cost (no timing)."""

    def __init__(self) -> None:
        super().__init__(PassCost(alpha=1.0, c=0.0))
        self.cost.observe = lambda k, seconds: None
        self.seen = []

    def next(self, match: int, most: int, tally=None) -> int:
        return most

    def observe(self, match: int, proposed: int, accepted: int, tally=None) -> None:
        self.seen.append((proposed, accepted))


def scripted(ref: Sequence[int], agree: Callable[[int], int], vocab: int,
             most: int = 6):
    """``(plan, drafters)``: a `LookupPlan` proposing ``ref`` as `ScriptedDrafter` does,
    every token verified, and the drafters it made (newest last)."""
    made: List[ScriptedDrafter] = []

    def drafter(tokens):
        d = ScriptedDrafter(ref, tokens, agree, vocab)
        made.append(d)
        return d
    return LookupPlan(most, VerifyAll(), drafter), made
