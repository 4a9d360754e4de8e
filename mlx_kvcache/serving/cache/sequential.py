"""The server's sequential path: requests mlx-lm serves one at a time (a ``seed``, images,
a draft model, ``--kv-bits``, models whose caches cannot batch) get the batch path's
checkpoints.

mlx-lm's ``_serve_single`` fetches one cache for the prompt, runs ``stream_generate`` on
the rest and inserts at the end; on a hybrid model that stores a state only at the end of
each request, so a prompt diverging inside a long message recomputes it all. Here the
generator marks the fetch as sequential (`serving`: a per-thread `SequentialRequest`,
filled in by ``_tokenize`` with the prompt and images), and the prompt cache's fetch then
restores, prefills through the planned stops — the ``--checkpoint-interval`` offsets, the
branch point, the pre-end margin, ``quantized_kv_start`` — storing the caches at each, and
hands mlx-lm the caches at the last stop with the rest of the prompt. mlx-lm's own
``stream_generate`` (or, with a draft model, ours: `stream`) goes on from there.

Images: mlx-lm keys such a prompt by its tokens with each image's patch tokens replaced by
a negative id of that image, so two images never share a prefix. What is before the first
image is plain text, computed from token ids exactly as mlx-lm computes it (the model embeds
text ids the same way with or without images); from the first image on, the rows depend on
the image's pixels, which only mlx-lm's prefill computes. So: stops only up to the first
image, and a restore never lands inside an image (mlx-lm counts an image as cached only
when its first patch is; a part of an image would be fed twice).

Work in flight (`inflight`): the prompt being fetched is a flight while its stops are
prefilled; between its chunks the generator looks at the requests queued behind it
(`SequentialRequest.between`), and each one sharing more of the prompt than the trie holds
adds a stop where the two diverge — so it restores exactly there once its turn comes, on
a hybrid or sliding-window model too.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ...generation.draft_length import DraftLengths
from ...generation.model_pair import ModelPair
from ...generation.prefill import Feed, on_stream
from ...generation.prefill import prefill as run_prefill
from ...prefix.stats import RequestStats
from .inflight import Flight, InFlight
from . import decoding

__all__ = ["SequentialRequest", "current", "serving", "image_runs", "image_sizes", "outside_images",
           "plan_stops", "prefill", "fetch"]

_local = threading.local()


@dataclass
class SequentialRequest:
    """One sequential request, as the prompt cache and `stream` see it."""

    #: mlx-lm's progress report for this request (``(done, total)`` on its queue).
    progress: Optional[Callable[[int, int], None]] = None
    #: The stream mlx-lm generates on.
    stream: Any = None
    #: The largest prefill chunk (``--prefill-step-size``).
    prefill_step: int = 2048
    #: The prompt's token ids (set by ``_tokenize``; the cache key differs with images).
    prompt: Optional[List[int]] = None
    #: mlx-lm's ``Vision`` of the prompt (its images), or None.
    vision: Any = None
    #: Offsets the request itself asks to checkpoint at (an agent's ``cache_control``).
    extra_stops: List[int] = field(default_factory=list)
    #: False where the next request goes on past this prompt's end (`templates`): no
    #: stop a few tokens before it.
    guess_end: bool = True
    #: mlx-lm's ``GenerationContext`` (its ``prompt_cache_count`` is what usage reports).
    ctx: Any = None
    #: Tokens restored from the cache, and tokens the caches hold when mlx-lm takes over
    #: (restored + what the fetch prefilled through its stops).
    restored: int = 0
    handed: int = 0
    #: After a draft-model generation: the tokens its caches hold (-1: none consistently).
    #: None: mlx-lm's convention (the caches hold the whole key the server inserts).
    absorbed: Optional[int] = None
    #: Speculative decoding counters of a draft-model generation.
    stats: RequestStats = field(default_factory=RequestStats)
    #: Each round's draft length (``--draft-policy``; None: ``--num-draft-tokens`` each).
    draft_lengths: Optional[DraftLengths] = None
    #: Told what the fetch restores, once it knows (before it computes the rest).
    on_restored: Optional[Callable[[int], None]] = None
    #: What names its model (mlx-lm's ``args.model``): a queued request on another model
    #: shares nothing with it.
    model: Any = None
    #: Called between the chunks of its prefill: the generator looks at the queue behind it
    #: (requests sharing its prompt ask its flight for stops, `inflight`).
    between: Optional[Callable[[], None]] = None

    def restoring(self, n: int) -> None:
        """The fetch restores ``n`` tokens of the prompt (0: it computes it all)."""
        self.restored = self.handed = n
        if self.on_restored is not None:
            self.on_restored(n)

    def held(self, key: np.ndarray) -> Tuple[np.ndarray, str]:
        """What of ``key`` (prompt + answer, as inserted at its end) this request's caches
        hold, and what its log line adds: after our decoder's generation (prompt lookup, a
        draft model), the prefix the caches hold at one committed offset (nothing when none
        is consistent) and the proposals' counts (`decoding.note`); else all of ``key``."""
        if self.absorbed is None:
            return key, ""
        note = decoding.note(self.stats)
        length = None if self.draft_lengths is None else self.draft_lengths.current
        if length is not None and not self.stats.drafted_tokens:
            note += (f" (--draft-policy adaptive: a draft step costs "
                     f"{length.cost:.2f} of a target step; acceptance "
                     f"{length.acceptance:.2f})")
        return key[: max(self.absorbed, 0)], note


def current() -> Optional[SequentialRequest]:
    """The sequential request this (generation) thread is serving, if any."""
    return getattr(_local, "request", None)


@contextmanager
def serving(request: SequentialRequest) -> Iterator[SequentialRequest]:
    """Mark this thread as serving ``request`` on the sequential path."""
    saved = current()
    _local.request = request
    try:
        yield request
    finally:
        _local.request = saved


def image_runs(key: Sequence[int]) -> List[Tuple[int, int]]:
    """``[start, end)`` of each run of image placeholders (negative ids) in a cache key
    (vectorised: no per-token Python on the request path)."""
    neg = np.asarray(key) < 0
    edges = np.flatnonzero(np.diff(neg.astype(np.int8), prepend=0, append=0))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def image_sizes(key: Sequence[int]) -> Tuple[int, ...]:
    """The tokens of each image in a cache key (each image has its own negative id)."""
    ids = np.asarray(key)
    return tuple(np.unique(ids[ids < 0], return_counts=True)[1].tolist())


def plan_stops(live, plan, key: Sequence[int], seq: SequentialRequest,
          quant: Any = None) -> Tuple[int, List[int]]:
    """``(start, stops)`` of a sequential request restored by ``plan`` onto ``live``: the
    plan's stops, plus the prompt's end when decoding will cross ``quant``'s start (its
    rows must be stored before they are quantized); with images, text ones only, and
    never a start inside an image (`outside_images`)."""
    start, out, n = plan.restored, list(plan.stops), len(key)
    if quant is not None and start < n - 1 < quant.start:
        out = sorted(set(out) | {n - 1})
    runs = image_runs(key) if seq.vision is not None else []
    if runs:
        start = outside_images(live, start, runs)
        out = [s for s in out if start < s <= runs[0][0]]
    return start, out


def outside_images(live, start: int, runs: Sequence[Tuple[int, int]]) -> int:
    """``live`` restored to ``start``, moved back to the beginning of the image ``start``
    falls inside of, if any (every layer rewinds live, or all start over from 0): mlx-lm
    counts an image as cached only when its first patch is, and would feed the rest of a
    part-cached image again. Returns the offset ``live`` holds."""
    for a, b in runs:
        if a < start < b:
            if not all([c.restore(None, a) for c in live.leaves]):
                live.reset()
                return 0
            return a
    return start


def prefill(live, pair: ModelPair, tokens: Sequence[int], start: int, stops: Sequence[int], *,
            step: int, checkpoint: Callable[[int], bool],
            progress: Optional[Callable[[int, int], None]] = None, stream: Any = None,
            end: Optional[int] = None, flight: Optional[Flight] = None,
            between: Optional[Callable[[], None]] = None) -> int:
    """Feed ``tokens[start:stops[-1]]`` (or on to ``end`` when it is further) to ``live``
    (a live set holding ``tokens[:start]``; with a draft model its caches follow the
    target's) on ``stream`` through the one chunked prefill (`generation.prefill`: chunks
    of at most ``step`` ending exactly at each stop, the ``kv_bits`` switch at its start),
    calling ``checkpoint(offset)`` at each stop. With a ``flight`` the stops asked of it
    join, ``between()`` (when given) is called before each chunk to let them be asked, and
    the flight follows the prefill. Returns the offset the caches hold."""
    total = len(tokens) - start
    feed = Feed(pair, live, tokens[:start])
    report = None if progress is None else lambda at: progress(at - start, total)
    if flight is None:
        last = max([start, *stops] + ([] if end is None else [end]))
        return run_prefill(feed, tokens, start, last, step=step, stops=stops,
                           checkpoint=checkpoint, progress=report, run=on_stream(stream))
    pos = start
    while True:
        if between is not None:
            between()
        planned = sorted(set(stops) | set(flight.stops_in(pos, len(tokens))))
        last = max([pos, *planned] + ([] if end is None else [end]))
        if pos >= last:
            return pos
        nxt = min(pos + step, last)  # one chunk, cut at the stops inside it
        pos = run_prefill(feed, tokens, pos, nxt, step=step,
                          stops=[s for s in planned if pos < s <= nxt], checkpoint=checkpoint,
                          progress=report, run=on_stream(stream))
        flight.advanced(pos)


def fetch(manager, pair: ModelPair, live, plan, key, seq: SequentialRequest, flights: InFlight,
          fetched: Callable[[int], None]) -> int:
    """The sequential fetch after its restore: ``live`` (restored by ``manager`` to
    ``plan``) prefilled through its stops, storing the caches at each (`plan_stops`,
    `prefill`), while the requests queued behind it may ask for more (it is a flight of
    ``flights`` meanwhile); ``fetched(start)`` is told where it starts computing. Returns
    the offset its caches are handed to mlx-lm at (`SequentialRequest.handed`)."""
    start, stops = plan_stops(live, plan, key, seq, manager.kv_quant)
    fetched(start)
    seq.restoring(start)
    prompt = seq.prompt if seq.prompt is not None and len(seq.prompt) == len(key) else key
    # With --kv-bits the prompt but its last token is prefilled here, not by mlx-lm:
    # our passes attend over the quantized rows dequantized (`attention_views`), several
    # times faster than mlx-lm's quantized attention for many tokens on MLX's CPU build.
    end = len(key) - 1 if manager.kv_quant is not None and seq.vision is None else None
    # Only where a state is restored at stored points alone (hybrid, sliding window): a KV
    # model's queued requests restore anywhere in what this request stores at its end.
    flight = (flights.begin(key, start, seq.model)
              if seq.vision is None and manager.whole_state else None)
    if flight is not None and flights.enabled and end is None:
        # The prompt is computed here, but its last token (as with --kv-bits): a request
        # queued behind it can ask for a stop until then, not only up to the planned ones.
        end = len(key) - 1
    try:
        seq.handed = prefill(
            live, pair, prompt, start, stops, step=seq.prefill_step,
            checkpoint=lambda at: manager.checkpoint(live, key[:at]), progress=seq.progress,
            stream=seq.stream, end=end, flight=flight, between=seq.between)
    finally:
        if flight is not None:
            flight.end()
    return seq.handed
