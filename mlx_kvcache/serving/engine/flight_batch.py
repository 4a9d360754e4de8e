"""mlx-lm's `BatchGenerator` whose running prompts are flights (`cache.inflight`): each
request it prefills is registered with how far it has computed, and can be asked to store
its caches at an offset chosen after it was inserted — the point where a request that
arrived later diverges from it.

mlx-lm's batch prefills each request segment by segment (a chunk never crosses a segment's
end) and its server stores the caches at every segment end but the prompt's. A cut
(`FlightBatchGenerator.cut`) splits the request's remaining segments at the offset, so
the prefill stops exactly there; at that step this class stores the caches itself (mlx-lm's
own extraction, the prompt cache's insert, as its server does at a segment end) and hands
mlx-lm's loop the step's response as a plain step, so the server's own segment-end inserts
(and their cache types) stay as they were. An offset that already is a segment end needs
nothing; one the request has just reached is stored at once; a model whose every layer
restores anywhere (KV caches) is stored at once from wherever the request is past it.

The server's generation thread builds the batch through ``mlx_lm.server.BatchGenerator``,
which `install` points here; the generator attaches its `FlightHooks` to its generation
thread (`attached`), and a batch built on another thread is mlx-lm's own. What this class
reads of mlx-lm's batch — the remaining segments of each request, unprocessed and in the
prompt batch — is probed by `serving.seam.check`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from mlx_lm import server as mlx_server
from mlx_lm.generate import BatchGenerator

from ..cache.inflight import Flight, InFlight
from ..cache.prompt_cache import TriePromptCache
from .segments import cut_remaining

__all__ = ["FlightBatchGenerator", "FlightHooks", "attached", "hooks", "install"]

log = logging.getLogger("mlx_kvcache")

_local = threading.local()


@dataclass
class FlightHooks:
    """What the batch needs of the server to register its requests as flights.

    Args:
        flights: the registry.
        key_of: a prompt's trie key (None: not cached: not a flight).
        model: what names the model of the request being inserted (its ``args.model``).
        store: store a cache list (mlx-lm's extraction) holding the given tokens, as the
            server stores one at a segment end.
        anywhere: whether every layer of the model restores at any offset (KV caches: a
            cut the request has passed can still be stored from where it is).
    """

    flights: InFlight
    key_of: Callable[[Sequence[int]], Any]
    model: Callable[[], Any]
    store: Callable[[Sequence[int], List[Any]], None]
    anywhere: Callable[[], bool]


def hooks(prompt_cache: TriePromptCache, model_key: Callable[[], Any],
          model: Callable[[], Any]) -> FlightHooks:
    """The hooks of a server whose prompt cache is ``prompt_cache``; ``model_key``: the
    loaded model's key (what its inserts are for), ``model``: the ``args.model`` of the
    request the batch takes next. Points mlx-lm's server at this batch (`install`)."""
    install()
    return FlightHooks(prompt_cache.flights, prompt_cache.key_of, model,
                       lambda tokens, cache: prompt_cache.insert_cache(
                           model_key(), tokens, cache, cache_type="user"),
                       prompt_cache.restores_anywhere)


@contextmanager
def attached(hooks: FlightHooks) -> Iterator[None]:
    """While inside, batches built on this thread register their requests with ``hooks``."""
    saved = getattr(_local, "hooks", None)
    _local.hooks = hooks
    try:
        yield
    finally:
        _local.hooks = saved


def install() -> None:
    """Make mlx-lm's server build `FlightBatchGenerator` (once per process; it behaves as
    mlx-lm's own on a thread without hooks)."""
    if not issubclass(mlx_server.BatchGenerator, FlightBatchGenerator):
        mlx_server.BatchGenerator = FlightBatchGenerator


class FlightBatchGenerator(BatchGenerator):
    """mlx-lm's `BatchGenerator`, each request a `Flight` (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.hooks: Optional[FlightHooks] = getattr(_local, "hooks", None)
        self._start: Dict[int, int] = {}  # uid -> tokens it restored
        self._flight: Dict[int, Flight] = {}
        self._added: Dict[int, Set[int]] = {}  # uid -> offsets cut here (not mlx-lm's segments)
        super().__init__(*args, **kwargs)

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None,
                        *args: Any, **kwargs: Any):
        uids = super().insert_segments(segments, max_tokens, caches, all_tokens, *args, **kwargs)
        hooks = self.hooks
        if hooks is None or all_tokens is None:
            return uids
        for uid, segs, cached in zip(uids, segments, all_tokens):
            key = hooks.key_of(cached + [t for s in segs for t in s])
            if key is None:
                continue
            self._start[uid] = len(cached)
            self._added[uid] = set()
            self._flight[uid] = hooks.flights.begin(
                key, len(cached), hooks.model(), cut=lambda at, uid=uid: self.cut(uid, at),
                holds=True, steps=lambda at, step, uid=uid: self.steps_to(uid, at))
        return uids

    # -- cuts -----------------------------------------------------------------------------
    def _remaining(self, uid: int) -> Optional[Tuple[List[List[int]], int, bool]]:
        """``(its remaining segments (mlx-lm's own list), the offset of their first token,
        whether it is in the prompt batch)`` of a request still prefilling, else None."""
        start = self._start.get(uid)
        if start is None:
            return None
        for i, u in enumerate(self._prompt_batch.uids):
            if u == uid:
                segments, done, _ = self._currently_processing[i]
                return segments, start + done, True
        for seq in self._unprocessed_sequences:
            if seq[0] == uid:
                return seq[1], start, False
        return None

    def cut(self, uid: int, offset: int) -> bool:
        """Have request ``uid``'s caches stored at prompt offset ``offset``: True when they
        will be (its prefill stops there), are now, or are already (a segment end: the
        server stores there); False when it cannot be done (it passed the offset on a model
        that restores only where a state was stored, or it prefills no more)."""
        where = self._remaining(uid) if self.hooks is not None else None
        if where is None:
            return False
        segments, pos, prompting = where
        if offset <= pos:
            if prompting and (offset == pos or self.hooks.anywhere()):
                self._store([uid])  # its caches hold the prompt up to ``pos`` now
                return True
            return False
        ends, made = cut_remaining(segments, pos, offset)
        if made:  # the prefill stops there: stored by `next` (mlx-lm's own ends by its server)
            self._added[uid].add(offset)
        return ends

    def steps_to(self, uid: int, offset: int) -> int:
        """The prefill steps request ``uid`` takes to reach ``offset``: a chunk of at most
        the batch's step at a time, never across a segment end (0 past it or gone)."""
        where = self._remaining(uid)
        if where is None:
            return 0
        segments, pos, _ = where
        steps = 0
        for seg in segments:
            if pos >= offset:
                break
            n = min(len(seg), offset - pos)
            steps += -(-n // self.prefill_step_size)
            pos += len(seg)
        return steps

    def _store(self, uids: List[int]) -> None:
        for uid, (cache, tokens) in self.extract_cache(uids).items():
            self.hooks.store(tokens[:], cache)

    # -- progress and ends ----------------------------------------------------------------
    def next(self):
        prompt_responses, generation_responses = super().next()
        if self.hooks is not None and prompt_responses:
            try:
                self._followed(prompt_responses)
            except Exception:  # never into the generation loop: the batch goes on as mlx-lm's
                log.exception("mlx_kvcache: following the batch's prompts failed; work in "
                              "flight is no longer shared by this batch")
                self.stop_following()
        return prompt_responses, generation_responses

    def stop_following(self) -> None:
        """From now on this batch is mlx-lm's own: its flights end (their followers compute
        for themselves) and no cut is taken (a cut already made is a segment end)."""
        for uid in list(self._flight):
            self._forget(uid)
        self.hooks = None

    def _followed(self, prompt_responses) -> None:
        """A step's prompt responses: the flights' progress and ends, the caches stored at
        the cuts the step reached."""
        self.hooks.flights.prefill_step()
        cut_here: Dict[int, int] = {}  # uid -> the offset it stopped at for a cut of ours
        for r in prompt_responses:
            flight = self._flight.get(r.uid)
            if flight is None:
                continue
            if r.end_of_prompt:
                self._forget(r.uid)  # its prompt is computed (and stored, but for its end)
                continue
            at = self._start[r.uid] + r.progress[0]
            if r.end_of_segment and at in self._added[r.uid]:
                r.end_of_segment = False  # ours: the server's own segment ends stay its own
                cut_here[r.uid] = at
            else:
                flight.advanced(at)
        if cut_here:
            self._store(list(cut_here))
            for uid, at in cut_here.items():
                self._flight[uid].advanced(at)  # (only now: stored)

    def remove(self, uids, *args: Any, **kwargs: Any):
        for uid in uids:
            self._forget(uid)  # its client left, or it was cut: its followers go
        return super().remove(uids, *args, **kwargs)

    def close(self) -> None:
        for uid in list(self._flight):
            self._forget(uid)
        super().close()

    def _forget(self, uid: int) -> None:
        flight = self._flight.pop(uid, None)
        self._start.pop(uid, None)
        self._added.pop(uid, None)
        if flight is not None:
            flight.end()
