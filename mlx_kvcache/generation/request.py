"""One request's run on a live set it owns: restore (`PrefixManager.checkout`), the one
chunked prefill stopping at the planned snapshot offsets (`prefill`), the one decode —
one step ahead, or speculatively with a draft model (`decode`) — and record (check-in).

Every model step runs on the cache's engine thread (`engine`), handed over and waited
for, so requests interleave freely — several generators on one thread, ``next()`` from a
pool of threads — without ever sharing caches or blocking each other across a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models import cache as mlc

from ..prefix.stats import RequestStats
from .decode import Responses, decoder, emitted
from .draft_length import DraftLength
from .lookup import LookupPlan
from .model_pair import ModelPair
from .prefill import Feed, prefill


@dataclass
class CachedGenerationResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse` plus the request's cache facts."""

    cache: Optional[RequestStats] = None


def run(pc, tokenizer, tokens: List[int], max_tokens: int, sampler: Optional[Callable],
        processors: Sequence[Callable], progress: Optional[Callable[[int, int], None]],
        snapshot_at: Sequence[int], chunk: int,
        num_draft: int = 0, draft_length: Optional[DraftLength] = None,
        lookup: Optional[LookupPlan] = None,
        ) -> Generator[CachedGenerationResponse, None, None]:
    """The body of `PrefixCache.stream_generate` (arguments already checked).

    With ``pc.draft_model`` the live set holds the target's caches, then the draft's; both
    are prefilled together (`prefill`) and decoding is speculative (at most ``num_draft``
    tokens a round, as ``draft_length`` decides: `decode`); with ``lookup``, proposals
    from the request's own tokens too (`lookup`). Model work runs on ``pc``'s
    engine thread; this generator only sequences it, so it may be advanced from any
    thread."""
    t0 = time.perf_counter()
    stats = RequestStats(prompt_tokens=len(tokens))
    pc.last_request = stats
    mgr, engine = pc.manager, pc.engine
    # The PrefixCache's models as they are now (a caller may have wrapped them since).
    pair = ModelPair(pc.model, pc.draft_model, target_entries=pc.target_entries,
                     vocabs=(pc.target_vocab, pc.draft_vocab))
    live, plan = mgr.checkout(tokens, snapshot_at)
    stats.matched_tokens, stats.restored_tokens = plan.matched, plan.restored
    stats.disk_tokens = plan.from_disk
    stats.reason = plan.reason
    start, stops = plan.restored, plan.stops
    if live is None:  # caching off (`NullManager`): mlx-lm's own caches, the whole prompt
        caches = engine.run(lambda: [c for m in pair.models for c in mlc.make_prompt_cache(m)])
        feed = Feed(pair, caches)
    else:
        stats.reuse = pc.explain(tokenizer, tokens, plan)
        feed = Feed(pair, live, tokens[:start])
    n = len(tokens)

    def checkpoint(at: int) -> None:
        if mgr.checkpoint(live, tokens[:at]):
            stats.snapshots_taken += 1
        else:
            stats.snapshots_skipped += 1

    def prefilled(at: int) -> None:
        stats.prefilled_tokens = at - start
        if progress:
            progress(at - start, n - start)

    dec = None
    try:
        # Prefill up to the last prompt token, stopping at every planned snapshot.
        prefill(feed, tokens, start, n - 1, step=chunk, stops=stops,
                checkpoint=checkpoint, progress=prefilled,
                run=engine.run)
        dec = engine.run(lambda: decoder(
            feed, tokens, num_draft=num_draft, sampler=sampler or (lambda x: mx.argmax(x, axis=-1)),
            processors=processors, eos=tokenizer.eos_token_ids, max_tokens=max_tokens,
            stats=stats, draft_length=draft_length, lookup=lookup))
        stats.prefilled_tokens += 1
        respond = Responses(tokenizer, prompt_tokens=n, computed=n - start, since=t0,
                            stats=stats, cls=CachedGenerationResponse)
        for tok, logprobs, from_draft, last in emitted(dec, engine.run):
            stats.cache_bytes = pc.nbytes
            yield respond(tok, logprobs, from_draft, last, cache=stats)
            if last:
                break
    finally:
        if dec is not None:  # (speculative: both models at one prefix of the emitted tokens)
            feed.fed, _ = engine.run(dec.finish, stats.finish_reason is not None)
        fed, pending = feed.fed, feed.pending
        mgr.checkin(live, fed, pending,
                    on_done=lambda recorded: pc.account(stats, fed if recorded else None))
