"""Speculative decoding on every cache kind, with exact rollback from snapshots: proposals
from the context (prompt lookup) or from a draft model, verified by the target in one pass.

A round: a proposer offers ``k`` tokens — `lookup.PromptLookup` (the tokens that followed
the longest earlier match of the sequence's end: no model runs) or the draft model (``k``
passes of its own) — and the target scores the tokens it has not absorbed yet plus the
proposals in one pass, sampling a token at every position; proposals are accepted while
they equal the target's samples, and the target's sample after the last accepted one is
emitted too. Every emitted token is the target's own sample given the emitted prefix,
so the output has the target's distribution and, greedy, is token-for-token the target's
greedy output. For a proposal that is one token for sure (a lookup's, a draft model's
greedy one), "the target's sample equals it" is the standard speculative rule exactly:
accepted with probability ``p(t)``, and on rejection the emitted sample is distributed
as ``p`` with ``t`` removed and renormalised. With a draft model present, each round
takes the proposal with the more tokens per unit of cost (`_propose`).

Pipelined as mlx-lm decodes: a round's pass is queued before the tokens of the round
before are read, so the device never waits for Python. After a plain step (no drafts)
the next pass is built on that step's token while it is still being computed — with a
lookup proposal made from the tokens known so far, shifted by the one being computed
(whatever a proposal holds, the acceptance rule keeps the output exact). A round with
drafts must be read before the next is built: where drafts stop being accepted
`draft_length` stops drafting at once, so plain text decodes as fast as without.

Rollback. After a round each model must hold only emitted tokens; how each layer goes
back is its kind's rule (`caches.rollback`: ours, and mlx-lm's classes adapted there).
A layer that rewinds live (KV layers, a window that has not wrapped) just does. A layer
that cannot (a recurrent state, a window that wraps during the pass) is snapshotted before
a pass with drafts — its model's *checkpoint* — and when a live rewind fails, every layer
of that model returns to the checkpoint. The accepted tokens are then *carried*: fed again
at the front of that model's next pass, so a rejection costs no forward pass of its own
(llama.cpp replays them in a separate pass). A checkpoint stays valid while its model sits
on it, so a carry needs no new snapshot. A carry longer than ``2 * (k + 1)`` tokens is
replayed at once, which bounds the length of a pass.

Every method of `SpeculativeDecoder` runs on the thread that runs the model (the engine
thread, a stream); `decode.emitted` sequences the rounds and yields their tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..caches import settle
from ..caches.factory import recurrent_arrays
from ..caches.rollback import layers_of, rollback_of
from ..prefix.stats import RequestStats
from .draft_length import DraftLength, LookupTally
from .lookup import LookupPlan
from .model_pair import clamp_ids

__all__ = ["SpeculativeDecoder", "Emitted"]

#: One emitted token: id, the target's log-probs at its position, whether it was proposed.
Emitted = Tuple[int, mx.array, bool]


class _Lost(RuntimeError):
    """A model's caches cannot be brought back to a committed prefix."""


class _Side:
    """One model of a speculative request: its caches, the committed tokens they hold
    (``n``: ``seq[:n]``), drafted tokens held past those (``extra``) and its checkpoint."""

    def __init__(self, model, caches: List[Any], n: int, vocab: Optional[int] = None) -> None:
        self.model = model
        self.set_caches(caches)
        self.vocab = vocab  # ids at or past it are fed as ``vocab - 1`` (see `clamp_ids`)
        self.n, self.extra = n, 0
        self.high = n  # most committed tokens ever held: feeding below it is a replay
        self.passes = self.replayed = 0
        self.busy = False  # inside a pass: an exception there leaves layers half written
        self.at: Optional[int] = None  # the checkpoint's offset
        self.snaps: Dict[int, Any] = {}
        #: The kv_bits switch (see `SpeculativeDecoder`): where it happens, and the call
        #: that makes it and refreshes both models' cache lists.
        self.quant_start: Optional[int] = None
        self.before: Callable[[], None] = lambda: None

    def set_caches(self, caches: List[Any]) -> None:
        """The cache list to run on from now (the kv_bits switch replaces cache objects)."""
        self.caches, self.leaves = caches, layers_of(caches)
        #: Each layer's rollback rules (`caches.rollback`: its kind's, mlx-lm's adapted).
        self.rules = [rollback_of(c) for c in self.leaves]

    def forward(self, ids: mx.array, committed: int) -> mx.array:
        """Feed ``ids``: their first ``committed`` continue ``seq[:n]``, the rest are drafts.

        With kv_bits, a pass never spans the switch: committed tokens crossing it are fed in
        two passes, the caches switched in between (the decoder keeps drafts below it)."""
        at = self.n + self.extra
        cut = None if self.quant_start is None else self.quant_start - at
        self.busy = True
        if cut is not None and 0 < cut < ids.size:
            if cut > committed:
                raise _Lost("a pass with drafts would span the kv_bits switch")
            logits = mx.concatenate([self._pass(ids[:cut]), self._pass(ids[cut:])], axis=1)
        else:
            logits = self._pass(ids)
        self.busy = False
        self.passes += 1
        self.replayed += max(0, min(self.n + committed, self.high) - self.n)
        self.n += committed
        self.high = max(self.high, self.n)
        self.extra += ids.size - committed
        return logits

    def _pass(self, ids: mx.array) -> mx.array:
        self.before()  # the kv_bits switch, when due
        logits = self.model(clamp_ids(ids, self.vocab)[None], cache=self.caches)
        settle(self.caches, ids.size)
        return logits

    def checkpoint(self, ahead: int, snapshot: bool = True) -> None:
        """Snapshot each layer that may not rewind after ``ahead`` more tokens. Kept while
        the model sits at the same committed offset (a carry reuses it). Without
        ``snapshot`` (a pass with nothing to roll back) only the offset is noted: layers
        that rewind live can still go back there after a failed pass."""
        if self.at != self.n:
            self.drop()
            self.at = self.n
        if not snapshot:
            return
        for i, r in enumerate(self.rules):
            if i not in self.snaps and r.needs_checkpoint(ahead):
                self.snaps[i] = r.rollback_point()

    def rollback(self, keep: int) -> int:
        """Hold ``keep`` committed tokens, or fewer: each layer rewinds live where it can;
        when one cannot, every layer returns to the checkpoint. Returns the tokens held."""
        if not self.busy and all([r.rewind(keep) for r in self.rules]):
            self.n, self.extra = keep, 0
            return keep
        if self.at is None or self.at > keep:
            raise _Lost(f"no checkpoint at or below offset {keep}")
        for i, r in enumerate(self.rules):
            ok = r.return_to(self.snaps[i], self.at) if i in self.snaps else r.rewind(self.at)
            if not ok:
                raise _Lost(f"{type(self.leaves[i]).__name__} layer {i} cannot return to "
                            f"offset {self.at}")
        self.n, self.extra, self.busy = self.at, 0, False
        return self.at

    def drop(self) -> None:
        for s in self.snaps.values():
            close = getattr(s, "close", None)
            if close is not None:
                close()
        self.snaps.clear()
        self.at = None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Flight:
    """A pass queued and not read yet: ``k`` proposals (``drafts``, ``[k]``) after its
    committed tokens, the target's samples and log-probs at its last ``k + 1`` positions.
    ``base``: the committed tokens the target holds once its committed part is in;
    ``source``: ``"lookup"``, ``"draft"`` or ``""`` (none); ``match``: a lookup's."""

    k: int
    drafts: Optional[mx.array]
    toks: mx.array
    logprobs: mx.array
    base: int
    source: str = ""
    match: int = 0


class SpeculativeDecoder:
    """The decode loop of one request with proposals (every method on the engine thread).

    The caches hold ``tokens[:-1]`` (the prefill); `step` reads the pass in flight and
    queues the next, returning the emitted tokens; `finish` brings the models to one
    committed prefix for the check-in and drops the checkpoints.

    Args:
        target, target_caches: the model and its caches.
        draft, draft_caches: a draft model and its caches, or None.
        num_draft: the most tokens a round drafts with the draft model.
        length: picks each draft-model round's count (`draft_length`); a round that
            drafts nothing is a plain target step, and the draft, left behind, catches
            up in its next pass.
        lookup: prompt lookup (`lookup.LookupPlan`): its drafter reads these tokens, its
            policy picks how much of each proposal to verify; None: off.
        vocab: the target's vocabulary size (see `_target_width`).
        draft_vocab: the draft's, when smaller than the target's (see `clamp_ids`).
    """

    def __init__(self, target, target_caches: List[Any], draft, draft_caches: List[Any],
                 tokens: Sequence[int], *, num_draft: int, sampler: Callable,
                 processors: Sequence[Callable], eos, max_tokens: int, stats: RequestStats,
                 vocab: Optional[int] = None, draft_vocab: Optional[int] = None,
                 switch: Optional[Callable[[], Tuple[List[Any], List[Any]]]] = None,
                 quant_start: Optional[int] = None,
                 length: Optional[DraftLength] = None,
                 lookup: Optional[LookupPlan] = None) -> None:
        self.seq: List[int] = np.asarray(tokens).tolist()  # Python ints (a numpy prompt too)
        n = len(self.seq) - 1
        self.t = _Side(target, target_caches, n)
        self.d = None if draft is None else _Side(draft, draft_caches, n, draft_vocab)
        self.sides = [self.t] if self.d is None else [self.t, self.d]
        self.quant_start = quant_start
        if switch is not None:
            # kv_bits: the switch happens exactly when a cache reaches ``quant_start``
            # (rows below it unquantized, rows from it quantized, as in plain decoding), and
            # replaces cache objects. No pass with drafts may span it (`_launch` keeps
            # drafts below it), so a rejection never rewinds a switched cache below it.
            def before() -> None:
                tc, dc = switch()
                self.t.set_caches(tc)
                if self.d is not None:
                    self.d.set_caches(dc)
            for side in self.sides:
                side.quant_start, side.before = quant_start, before
        self.k = int(num_draft) if self.d is not None else 0
        self.length = length
        self.lookup = lookup
        self.drafter = None if lookup is None or lookup.most <= 0 else lookup.drafter(self.seq)
        self.tally = LookupTally()  # this request's own lookup rounds
        self.max_carry = 2 * (max(self.k, lookup.most if self.drafter else 0) + 1)
        self.sampler, self.processors, self.eos = sampler, list(processors), eos
        self.max_tokens, self.stats, self.vocab = max_tokens, stats, vocab
        self.generated = 0
        self._hist: Optional[mx.array] = None
        self._flight: Optional[_Flight] = None
        self._last: Optional[float] = None  # when the last step returned

    # -- sampling --------------------------------------------------------------------------
    def _history(self, head: List[mx.array], drafts: Optional[mx.array], i: int) -> mx.array:
        if self._hist is None or self._hist.size != len(self.seq):  # once per round
            self._hist = mx.array(self.seq, mx.uint32)
        parts = [self._hist] + [x.astype(mx.uint32) for x in head]
        if drafts is not None and i:
            parts.append(drafts[:i].astype(mx.uint32))
        return mx.concatenate(parts)

    def _sample(self, logits: mx.array, head: List[mx.array], drafts: Optional[mx.array],
                first: int = 0):
        """Sample each row of ``logits`` ``[R, V]``; row ``i`` follows ``seq + head +
        drafts[:first + i]`` (the history logits processors see, as in plain decoding)."""
        if self.processors:
            rows = []
            for i in range(logits.shape[0]):
                row, hist = logits[i:i + 1], self._history(head, drafts, first + i)
                for p in self.processors:
                    row = p(hist, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs), logprobs

    def _target_width(self, logits: mx.array) -> mx.array:
        """The draft's logits over exactly the target's ids: a wider draft never proposes
        an id the target lacks; a narrower one is padded with -inf (logits processors index
        them by ids of the history, which may be past the draft's vocabulary)."""
        width = logits.shape[-1]
        if self.vocab is None or width == self.vocab:
            return logits
        if width > self.vocab:
            return logits[:, : self.vocab]
        pad = mx.full((logits.shape[0], self.vocab - width), -mx.inf, logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)

    # -- proposals -------------------------------------------------------------------------
    def _draft(self, k: int, head: List[mx.array]) -> mx.array:
        """``k`` tokens of the draft model after ``seq + head`` (lazy: queued, not read)."""
        d, seq = self.d, self.seq
        drafts: List[mx.array] = []
        d.checkpoint(len(seq) + len(head) - d.n + k - 1)
        ids = mx.concatenate([mx.array(seq[d.n:], mx.uint32)]
                             + [x.astype(mx.uint32) for x in head])
        for j in range(k):
            logits = d.forward(ids, ids.size if j == 0 else 0)[0, -1:, :]
            ids, _ = self._sample(self._target_width(logits), head,
                                  mx.concatenate(drafts) if drafts else None, j)
            mx.async_eval(ids)  # the next draft step is queued behind it, no sync
            drafts.append(ids)
        return mx.concatenate(drafts)

    def _propose(self, most: int, shifted: bool) -> Tuple[str, int, List[int], int]:
        """``(source, k, lookup tokens, match)`` for the next round: the lookup's proposal
        (``shifted``: its first token guesses the token being computed, and is dropped) or
        the draft model's, whichever promises the more tokens per unit of cost."""
        if most <= 0:
            return "", 0, [], 0
        if self.d is not None and self.length is None:  # fixed: the draft, as mlx-lm
            k = min(self.k, most)
            return ("draft", k, [], 0) if k else ("", 0, [], 0)
        toks, match, kl = [], 0, 0
        if self.drafter is not None:
            toks, match = self.drafter.propose(min(most, self.lookup.most) + shifted)
            toks = toks[1:] if shifted else toks
            kl = self.lookup.length.next(match, len(toks), self.tally) if toks else 0
        kd = 0
        if self.d is not None:
            kd = min(self.k, most) if self.length is None else self.length.next(min(self.k, most))
        if kl and kd:
            a = self.length.acceptance
            draft_speed = (sum(a ** i for i in range(kd + 1))
                           / (self.lookup.length.cost.relative(kd) + kd * self.length.cost))
            if self.lookup.length.speed(
                    match, kl, self.lookup.length.acceptance(match, self.tally)) >= draft_speed:
                kd = 0
            else:
                kl = 0
        if kl:
            return "lookup", kl, toks[:kl], match
        return ("draft", kd, [], 0) if kd else ("", 0, [], 0)

    # -- one round -------------------------------------------------------------------------
    def _launch(self, first: Optional[mx.array]) -> _Flight:
        """Queue the next pass: the committed tokens the target lacks (and ``first``, a
        token still being computed, when given) and a proposal after them."""
        seq, t = self.seq, self.t
        head = [] if first is None else [first]
        base = len(seq) + len(head)
        left = math.inf if self.max_tokens < 0 else self.max_tokens - self.generated - len(head)
        most = int(min(1 << 30, left - 1))
        qs = self.quant_start
        if qs is not None and base <= qs:
            most = min(most, qs - base)  # drafted positions stay below the kv_bits switch
        source, k, toks, match = self._propose(most, first is not None)
        if source == "draft":
            drafts: Optional[mx.array] = self._draft(k, head)
        else:
            drafts = mx.array(toks, mx.uint32) if k else None
        t.checkpoint(base - t.n + k, snapshot=k > 0)
        ids = mx.concatenate([mx.array(seq[t.n:], mx.uint32)]
                             + [x.astype(mx.uint32) for x in head]
                             + ([drafts] if drafts is not None else []))
        logits = t.forward(ids, base - t.n)[0, -(k + 1):, :]
        toks_out, logprobs = self._sample(logits, head, drafts)
        mx.async_eval(toks_out, logprobs, recurrent_arrays(t.leaves))
        return _Flight(k, drafts, toks_out, logprobs, base, source, match)

    def step(self) -> Tuple[List[Emitted], bool]:
        """Read the pass in flight and queue the next. Returns the emitted tokens (at least
        one) and whether the request is done (end of sequence or ``max_tokens``)."""
        fl = self._flight if self._flight is not None else self._launch(None)
        self._flight = None
        seq, st = self.seq, self.stats
        if fl.k == 0:
            # A plain pass: the next is built on its token before it is read.
            if self.max_tokens < 0 or self.generated + 1 < self.max_tokens:
                self._flight = self._launch(fl.toks)
            proposed: List[int] = []
            sampled = [int(fl.toks.item())]
        else:
            mx.eval(fl.toks, fl.logprobs, fl.drafts)
            proposed, sampled = fl.drafts.tolist(), fl.toks.tolist()
        n = _common(proposed, sampled)
        out = [(sampled[i], i < n) for i in range(n + 1)]
        done = False
        for j, (tok, _) in enumerate(out):
            if tok in self.eos or self.generated + j + 1 == self.max_tokens:
                out, done = out[: j + 1], True
                break
        rows = [fl.logprobs[i] for i in range(len(out))]
        mx.eval(rows)  # handed to the caller's thread: data, not a graph
        seq.extend(tok for tok, _ in out)
        if self.drafter is not None:
            self.drafter.extend([tok for tok, _ in out])
        self.generated += len(out)
        k = fl.k
        st.drafted_tokens += k
        st.accepted_tokens += n
        if fl.source == "lookup":
            st.lookup_drafted_tokens += k
            st.lookup_accepted_tokens += n
            self.lookup.length.observe(fl.match, k, n, self.tally)
        elif self.d is not None and self.length is not None:
            self.length.observe(k, n)  # (a round without drafts too: a scripted length sees it)
        if k:
            self._settle(self.t, fl.base, proposed, replay=not done)
            if self.d is not None and fl.source == "draft":
                # (a draft left behind by rounds without it catches up in its next pass)
                self._settle(self.d, fl.base, proposed[: k - 1], replay=not done)
        if not done and self._flight is None:
            self._flight = self._launch(None)
        now = time.perf_counter()
        if self._last is not None and self.lookup is not None:
            self.lookup.length.cost.observe(k, now - self._last)
        self._last = now
        self._count()
        return [(tok, row, fd) for (tok, fd), row in zip(out, rows)], done

    def _count(self) -> None:
        # (a pass in flight is not counted until it is read: the one queued after the
        # last token of an answer that ends on an end-of-sequence token never is)
        self.stats.target_passes = self.t.passes - (self._flight is not None)
        self.stats.replayed_tokens = self.t.replayed

    def _settle(self, side: _Side, base: int, absorbed: List[int], replay: bool) -> None:
        """Keep what the emitted tokens confirm (never the last one: no model has seen it);
        with ``replay``, feed a carry longer than ``max_carry`` now."""
        end = len(self.seq) - 1
        keep = min(base + _common(absorbed, self.seq[base:]), end) if side.extra else side.n
        if keep != side.n + side.extra:
            side.rollback(keep)
        else:
            side.n, side.extra = keep, 0
        if replay and end - side.n > self.max_carry:  # replay a long carry on its own
            side.forward(mx.array(self.seq[side.n:end], mx.uint32), end - side.n)

    # -- the end ---------------------------------------------------------------------------
    def finish(self, complete: bool = False) -> Tuple[List[int], bool]:
        """Bring the models to one committed prefix (also after an exception mid-round)
        and drop the checkpoints; a pass still in flight is dropped. A ``complete``
        request first feeds each model what it lacks of the emitted tokens, so the trie
        records what plain decoding records (all but the last token, or all of them).
        Returns the prefix and whether it was reached; when it was not, the check-in
        finds the caches inconsistent and keeps only what it can."""
        t, d = self.t, self.d
        unread = self._flight is not None
        self._flight = None
        end = len(self.seq) - 1
        try:
            for side in self.sides:
                if side.busy or side.extra:
                    side.rollback(min(side.n, len(self.seq)))
            for side in self.sides if complete else ():
                if side.n < end:
                    side.forward(mx.array(self.seq[side.n:end], mx.uint32), end - side.n)
            if d is not None:
                lo, hi = sorted((t, d), key=lambda s: s.n)
                if lo.n < hi.n:
                    # The draft catches up (a short pass of a small model); the target
                    # rewinds to the draft if it can, else it catches up too.
                    # (Never below the kv_bits switch: a switched cache's rows there are
                    # not the unquantized ones.)
                    below_switch = self.quant_start is not None and lo.n < self.quant_start
                    if lo is t and not below_switch and all(r.rewinds_live() for r in hi.rules):
                        hi.rollback(lo.n)
                    else:
                        lo.forward(mx.array(self.seq[lo.n:hi.n], mx.uint32), hi.n - lo.n)
            ok = len({s.n for s in self.sides}) == 1 and not any(s.busy for s in self.sides)
        except Exception:  # _Lost, or a failed catch-up pass
            ok = False
        finally:
            for side in self.sides:
                side.drop()
        self.stats.target_passes, self.stats.replayed_tokens = t.passes - unread, t.replayed
        return self.seq[: min(s.n for s in self.sides)], ok
