"""Prompt lookup in mlx-lm's batch: verified rounds for a batch of one row.

mlx-lm's server decodes every batchable request in its ``BatchGenerator``, whose
``GenerationBatch`` steps all rows one token a pass. `LookupBatch` is that class with
one more kind of step: while the batch holds a single row (one user, one agent: the case
where decode speed is the answer's speed) and the row's request has prompt lookup
(`lookup_request`), a step may verify the row's proposal — the tokens that followed the
latest longest match of its end (`generation.lookup`) — in one pass, as
`generation.speculative` does: the target's sample at every position, the proposals
accepted while they equal it. `seam.patched` puts the class in mlx-lm's place while the
server runs (every batch mlx-lm makes is then one).

Between steps the row is exactly as mlx-lm leaves it — the caches hold the tokens fed,
the next token is sampled and not fed — so a row that joins later, a step of mlx-lm's
own, an extraction or a removal find nothing else. So a round is decided before the
pending token is read (on the proposal made from the tokens already fed, shifted by the
token being computed: the pipeline stays as mlx-lm runs it while nothing is drafted),
and what a round fed past the accepted tokens is taken back before it returns: KV layers
and a window that did not wrap are trimmed; any other layer (a recurrent state, a window
that wrapped) returns to a snapshot taken before the pass, the trimmed KV layers with
it, and the accepted tokens are *carried*: fed again at the front of the row's next
round (so a rejection costs no pass of its own). A carry is the one thing a step may
leave behind, and it never meets mlx-lm: it is fed before anything of mlx-lm's reads or
merges the caches (`extend`, `extract_cache`, the row's end), or when it grows long.

Several rows at once are stepped by mlx-lm alone: their caches share one write offset
(left-padded), so rows accepting different numbers of tokens would need re-padding every
step — a cost that grows with the batch, where the gain shrinks (a batch already feeds
one token per row per pass).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from ...caches.rollback import ForeignRollback, layers_of
from ...prefix.stats import RequestStats
from ..cache import decoding
from .lookup_request import LookupSampler, RequestLookup

__all__ = ["LookupBatch"]


def _kv(c: Any) -> bool:
    """Whether layer ``c`` rewinds by trimming whatever a pass fed (attention without a
    window); any other layer is snapshotted before a verify pass."""
    return bool(c.is_trimmable()) and not isinstance(getattr(c, "max_size", None), int)


class LookupBatch(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` whose single row may verify prompt-lookup proposals
    (see the module doc). Every other step is mlx-lm's own."""

    #: Tokens the row emitted that its caches lack (after a return to a snapshot).
    _carry: Tuple[int, ...] = ()
    #: A carry longer than this is fed on its own (bounds a pass's length).
    MAX_CARRY = 32

    def next(self):
        rows = self._lookups()
        plan = self._plan(rows)
        if plan is None:
            out = super().next()
            self._count(rows, out)
            return out
        return self._round(*plan)

    # -- what mlx-lm reads finds the caches whole -----------------------------------------
    def extend(self, batch):
        self._feed_carry()
        super().extend(batch)

    def extract_cache(self, idx: int):
        self._feed_carry()
        return super().extract_cache(idx)

    def filter(self, keep):
        if not keep:
            self._carry = ()
        super().filter(keep)

    def _feed_carry(self) -> None:
        """Feed the carry, if any: the caches then hold every token the row emitted."""
        if not self._carry:
            return
        self.model(mx.array([list(self._carry)], mx.uint32), cache=self.prompt_cache)
        mx.eval([c.state for c in layers_of(self.prompt_cache)])
        rows = self._lookups()
        if self.uids and self.uids[0] in rows:
            rows[self.uids[0]].stats.target_passes += 1
        self._carry = ()

    # -- which step -----------------------------------------------------------------------
    def _lookups(self) -> Dict[int, RequestLookup]:
        """The `RequestLookup` of each row, by uid."""
        return {uid: s.request for uid, s in zip(self.uids, self.samplers or ())
                if isinstance(s, LookupSampler)}

    def _plan(self, rows: Dict[int, RequestLookup]) -> Optional[Tuple[RequestLookup, List[int], int]]:
        """``(lookup, proposal, match)`` when this step is our round (one with proposals,
        or one that feeds a carry)."""
        if len(self.uids) != 1 or self.uids[0] not in rows or self._next_tokens is None:
            return None
        req = rows[self.uids[0]]
        left = self.max_tokens[0] - self._num_tokens[0] - 1  # (the pending token comes first)
        most = min(req.most, left)
        k, toks, match = 0, [], 0
        if most > 0:
            fed = self.tokens[0]
            if req.drafter is None:
                req.drafter = req.make_drafter(fed)
            elif len(req.drafter) < len(fed):
                req.drafter.extend(fed[len(req.drafter):])
            toks, match = req.drafter.propose(most + 1)
            toks = toks[1:]  # (its first token guesses the pending one)
            k = req.length_on(self.model).next(match, len(toks), req.tally) if toks else 0
        return (req, toks[:k], match) if k or self._carry else None

    def _count(self, rows: Dict[int, RequestLookup], out: List[Any]) -> None:
        """A step of mlx-lm's own: one pass for each row, one token for each response."""
        now = time.perf_counter()
        for r in out:
            req = rows.get(r.uid)
            if req is None:
                continue
            st = req.stats
            st.target_passes += 1
            st.generated_tokens += 1
            if len(rows) == 1 and req.last is not None and req.most > 0:
                req.length_on(self.model).cost.observe(0, now - req.last)
            req.last = now
            if r.finish_reason is not None:
                decoding.ended(r.prompt_cache, st)

    # -- our round ------------------------------------------------------------------------
    def _round(self, req: RequestLookup, drafts: List[int], match: int) -> List[Any]:
        k, carry = len(drafts), list(self._carry)
        pending = self._next_tokens
        pending_logprobs = self._next_logprobs[0]
        inputs = mx.concatenate([mx.array(carry, mx.uint32), pending.astype(mx.uint32),
                                 mx.array(drafts, mx.uint32)])
        leaves = layers_of(self.prompt_cache)
        snaps = {i: ForeignRollback(c).rollback_point() for i, c in enumerate(leaves)
                 if not _kv(c)} if k else {}
        logits = self.model(inputs[None], cache=self.prompt_cache)[0, len(carry):]
        self._carry = ()
        processors = (self.logits_processors[0] if self.logits_processors else None) or ()
        ours = inputs[len(carry):]
        if processors:
            head = self._token_context[0].tokens
            rows = []
            for i in range(k + 1):
                hist = mx.concatenate([head, ours[: i + 1].astype(head.dtype)])
                row = logits[i:i + 1]
                for p in processors:
                    row = p(hist, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = self.samplers[0] if self.samplers and self.samplers[0] is not None \
            else self.fallback_sampler
        sampled = sampler(logprobs)
        mx.eval(sampled, logprobs, pending)
        first = int(pending.item())
        samples = sampled.tolist()
        n = 0
        while n < k and drafts[n] == samples[n]:
            n += 1
        emitted = [first] + drafts[:n]
        finish: Optional[str] = None
        for j, tok in enumerate(emitted):
            self._num_tokens[0] += 1
            if self._num_tokens[0] >= self.max_tokens[0]:
                finish = "length"
            if self._matchers[0].advance(tok):
                finish = "stop"
            if finish is not None:
                emitted = emitted[: j + 1]
                break
        self._take_back(leaves, snaps, len(inputs), carry + emitted)
        if finish is not None or len(self._carry) > self.MAX_CARRY:
            self._feed_carry()  # (before the row's cache is read, or a pass grows long)
        self.tokens[0].extend(emitted)
        if processors:
            self._token_context[0].update_and_fetch(mx.array(emitted, mx.int32))
        row_logprobs = [pending_logprobs] + [logprobs[i] for i in range(len(emitted) - 1)]
        self._current_tokens = ours[len(emitted) - 1: len(emitted)]
        self._current_logprobs = row_logprobs[-1:]
        self._next_tokens = sampled[n: n + 1]
        self._next_logprobs = [logprobs[n]]
        self._counted(req, k, n, match, emitted)
        uid = self.uids[0]
        out = []
        for j, tok in enumerate(emitted):
            last = finish is not None and j == len(emitted) - 1
            out.append(self.Response(
                uid=uid, token=tok, logprobs=row_logprobs[j],
                finish_reason=finish if last else None,
                prompt_cache=self.extract_cache(0) if last else None,
                all_tokens=self.tokens[0] if last else None))
        if finish is not None:
            decoding.ended(out[-1].prompt_cache, req.stats)
            self.filter([])
        return out

    def _take_back(self, leaves: List[Any], snaps: Dict[int, Any], fed: int,
                   kept: List[int]) -> None:
        """The pass fed ``fed`` tokens past what the caches held: keep ``kept`` of them,
        trimming the rest — or, where a layer cannot trim, every layer back to before the
        pass, the kept tokens carried."""
        drop = fed - len(kept)
        if not drop:
            return
        if all(i not in snaps or c.is_trimmable() for i, c in enumerate(leaves)):
            for c in leaves:
                c.trim(drop)
            return
        for i, c in enumerate(leaves):
            if i in snaps:
                ForeignRollback(c).return_to(snaps[i], 0)
            else:
                c.trim(fed)
        self._carry = tuple(kept)

    def _counted(self, req: RequestLookup, k: int, n: int, match: int,
                 emitted: List[int]) -> None:
        st: RequestStats = req.stats
        accepted = len(emitted) - 1
        st.drafted_tokens += k
        st.accepted_tokens += accepted
        st.lookup_drafted_tokens += k
        st.lookup_accepted_tokens += accepted
        st.generated_tokens += len(emitted)
        st.target_passes += 1
        length = req.length_on(self.model)
        now = time.perf_counter()
        took = None if req.last is None else now - req.last
        req.last = now
        if req.unsettled is not None and took is not None:
            # The round before left a carry: what feeding it cost beyond a plain step is
            # part of that round's cost.
            prev_k, prev = req.unsettled
            extra = max(0.0, took - length.cost.plain_seconds) if not k else 0.0
            length.cost.observe(prev_k, prev + extra)
        req.unsettled = None
        if k:
            length.observe(match, k, n, req.tally)
            if took is not None:
                if self._carry:
                    req.unsettled = (k, took)
                else:
                    length.cost.observe(k, took)
