"""Prompt lookup: the drafter that reads the context.

An agent's answer copies from its context — an ``Edit`` quoting the old code, a file
rewritten with a few lines changed, a patch's context lines. `PromptLookup` proposes the
tokens that followed the latest earlier occurrence of the longest suffix of the request's
own tokens (prompt and answer so far): the n-gram the sequence ends with is looked up
in everything before it, extended backwards as far as it keeps matching (at most
`PromptLookup.LONGEST` tokens), and among the longest matches the most recent one wins
(an answer quoting itself, or the last version of a file the context holds). The match
length comes with the proposal: how far back the text agrees is the best predictor of
whether it goes on agreeing (`draft_length.LookupLength` learns by it).

No model runs and nothing is held but the token ids (8 bytes each). The target verifies
the proposal in one pass (`speculative`); what is emitted never depends on it.

Cost: while a match goes on being confirmed it is followed (O(1) per token); otherwise
one vectorised scan of the tokens per proposal (~30 µs for 30k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

from .draft_length import LookupLength

__all__ = ["PromptLookup", "Proposal", "LookupPlan", "DEFAULT_MOST"]

#: Tokens a round may verify by default (HF transformers' ``prompt_lookup_num_tokens``
#: examples use 10; `LookupLength` verifies fewer where they would not pay).
DEFAULT_MOST = 10

#: ``(tokens, match)``: the proposed continuation and the length of the suffix match it
#: continues (0 and no tokens: nothing in the context matches).
Proposal = Tuple[List[int], int]


class PromptLookup:
    """The tokens of one request, and proposals continuing them from earlier in them.

    Not thread-safe: one request's decoder owns it (`speculative.SpeculativeDecoder`).
    """

    #: Matches are extended backwards at most this far (longer ones tie; the latest wins).
    LONGEST = 64

    def __init__(self, tokens: Sequence[int]) -> None:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self._buf = np.empty(max(2 * len(ids), 256), dtype=np.int64)
        self._buf[: len(ids)] = ids
        self._n = len(ids)
        # The match being followed: the index of the token it predicts next, and its length.
        self._next = -1
        self._match = 0

    def __len__(self) -> int:
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        """The tokens so far (a read-only view)."""
        view = self._buf[: self._n]
        view.flags.writeable = False
        return view

    def extend(self, tokens: Sequence[int]) -> None:
        """Append emitted tokens; a followed match goes on while they confirm it."""
        for t in tokens:
            if self._n == len(self._buf):
                grown = np.empty(2 * len(self._buf), dtype=np.int64)
                grown[: self._n] = self._buf[: self._n]
                self._buf = grown
            self._buf[self._n] = t
            self._n += 1
            if self._next >= 0 and self._buf[self._next] == t:
                self._next += 1
                self._match = min(self._match + 1, self.LONGEST)
            else:
                self._next = -1

    def propose(self, most: int) -> Proposal:
        """At most ``most`` tokens continuing the sequence, and the match length."""
        if most <= 0 or self._n < 2:
            return [], 0
        if self._next < 0:
            self._next, self._match = self._find()
            if self._next < 0:
                return [], 0
        # The continuation runs into the sequence's own end when the match is recent
        # (repeated text): it goes on as a copy of itself, as an LZ77 match does.
        span = self._buf[self._next:self._n]
        reps = -(-int(most) // len(span))
        return np.tile(span, reps)[: int(most)].tolist(), self._match

    def _find(self) -> Tuple[int, int]:
        """``(index after the match, match length)`` of the longest (then latest) earlier
        occurrence of the sequence's suffix; ``(-1, 0)`` when its last token is new."""
        buf, n = self._buf, self._n
        cand = np.flatnonzero(buf[: n - 1] == buf[n - 1])
        if not len(cand):
            return -1, 0
        length = 1
        while length < self.LONGEST:
            back = cand - length
            ok = back >= 0
            nxt = cand[ok]
            nxt = nxt[buf[back[ok]] == buf[n - 1 - length]]
            if not len(nxt):
                break
            cand, length = nxt, length + 1
        return int(cand[-1]) + 1, length


@dataclass(frozen=True)
class LookupPlan:
    """Prompt lookup as a request uses it: at most ``most`` tokens a round (0: off),
    ``length`` (shared by the model's requests) picks how many of a proposal to verify,
    ``drafter`` makes the request's drafter from its tokens (`PromptLookup`)."""

    most: int
    length: LookupLength
    drafter: Callable[[Sequence[int]], Any] = PromptLookup

    def with_most(self, most: int) -> "LookupPlan":
        """The same plan with another ``most`` (a request's own)."""
        return replace(self, most=int(most))
