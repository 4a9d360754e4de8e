"""The requests the generation thread keeps aside while a prefix they share is computed for
another request (`cache.inflight`), and the stops a prompt computed in one call takes for
the requests queued behind it.

On mlx-lm's batch path every request taken from the queue is asked, before mlx-lm fetches
it, whether a flight in the batch (`engine.flight_batch`) is computing more of its prompt
than the trie holds (`InFlight.best`): then that flight is cut at their shared point and the
request is held (`hold`: kept here, the loop goes on with its batch) until the flight has
stored that point, ended, or taken as many prefill steps as the request would need to
compute the part itself (`release`, asked at every turn of the loop); it then goes to
mlx-lm, whose fetch reads what the trie holds. A held request whose client left is dropped.

On the sequential path the request being fetched computes its prompt in one call: the
requests queued behind it are looked at between its chunks (`scan`), and each one sharing
more of it than the trie holds has it stop, and store its caches, where they diverge; they
are fetched after it, in their turn, and read that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..cache.inflight import Hold, Waited
from ..cache.namespace import Namespaced
from ..cache.prompt_cache import TriePromptCache
from ..guards.admission import DecodeJob
from ..guards.lifecycle import Control

__all__ = ["Followers", "Prompt", "prompt_reader"]

log = logging.getLogger("mlx_kvcache")


@dataclass(frozen=True)
class Prompt:
    """A queued request's prompt as the prompt cache sees it: its trie ``key``, what the
    trie restores of it now (``restored``), its model (mlx-lm's ``args.model``) and whether
    mlx-lm batches it (a request it serves alone drains the batch: never held)."""

    key: Any
    restored: int
    model: Any
    batchable: bool


def prompt_reader(prompt_cache: TriePromptCache, tokenized: Callable[[Any], Optional[tuple]],
                  image_bytes: Callable[[Any], int], batchable: Callable[[Any], bool]
                  ) -> Callable[[Any], Optional[Prompt]]:
    """A queued item's `Prompt`, from ``tokenized`` (mlx-lm's tokenizing, kept for its
    fetch), or None: a command, images (their decoding is the memory guard's to admit), a
    prompt not tokenizable here or not cached. ``batchable``: mlx-lm's test of its
    generation arguments."""
    def read(item) -> Optional[Prompt]:
        request, args = item[1], item[2]
        if isinstance(request, (Control, DecodeJob)) or image_bytes(item):
            return None
        out = tokenized(item)
        if out is None or out[4] is not None:
            return None
        namespace = getattr(request, "namespace", None)  # (mlx-lm's requests have none)
        key = prompt_cache.key_of(Namespaced(out[0], namespace) if namespace else out[0])
        if key is None:
            return None
        return Prompt(key, prompt_cache.restorable(key), args.model, batchable(args))
    return read


class Followers:
    """The held requests of one generation thread (see the module doc).

    Args:
        prompt_cache: whose registry (`TriePromptCache.flights`) the flights are in.
        step: the batch's prefill step (``--prefill-step-size``).
        prompt_of: a queued item's `Prompt` (`prompt_reader`), or None where it cannot
            share.
    """

    def __init__(self, prompt_cache: TriePromptCache, step: Callable[[], int],
                 prompt_of: Callable[[Any], Optional[Prompt]]) -> None:
        self.flights = prompt_cache.flights
        self._prompt_of = prompt_of
        self._step = step
        self._held: List[Hold] = []
        # id(request) -> (request, its wait), for its fetch; the request is kept so that its
        # id is not another's meanwhile
        self._waited: Dict[int, Tuple[Any, Waited]] = {}
        self._scanned: Dict[int, Any] = {}  # the same, queued requests a sequential prompt saw

    def holding(self) -> bool:
        """Whether a request is held."""
        return bool(self._held)

    # -- the batch path ---------------------------------------------------------------------
    def hold(self, item: Tuple[Any, Any, Any]) -> bool:
        """Keep ``item`` (mlx-lm's ``(queue, request, args)``) aside when a flight in the
        batch computes enough of its prompt (the flight is cut at their shared point);
        False: it goes to mlx-lm now (also when anything here fails: logged, never raised
        into the generation loop)."""
        if not self.flights.enabled or not self.flights.running():
            return False
        try:
            return self._hold(item)
        except Exception:
            log.exception("mlx_kvcache: looking for a prefix in flight failed; the request "
                          "goes on")
            return False

    def _hold(self, item: Tuple[Any, Any, Any]) -> bool:
        prompt = self._prompt_of(item)
        if prompt is None or not prompt.batchable:
            return False
        share = self.flights.best(prompt.key, prompt.restored, self._step(), prompt.model,
                                  holds=True)
        if share is None or not share.flight.cut(share.offset):
            return False
        hold = self.flights.hold(item, share)
        if hold.state(self.flights.steps) is not None:  # stored at once (it was there)
            self._note(item[1], self.flights.release(hold, "stored"))
            return False
        self._held.append(hold)
        log.info("mlx_kvcache: a request waits for %d tokens of its prompt another request "
                 "is computing (at %d of them; at most %d prefill steps)", share.offset,
                 share.flight.at, share.budget)
        return True

    def release(self) -> Optional[Tuple[Any, Any, Any]]:
        """The oldest held request that may go now (`Hold.state`), or None; requests whose
        client left are dropped on the way (refused: no one reads it)."""
        for hold in list(self._held):
            item = hold.item
            if getattr(item[1], "abandoned", False):  # (an agent route's request)
                self._held.remove(hold)
                self.flights.release(hold, "left")
                item[0].put(ValueError("its client left before it started"))
                continue
            how = hold.state(self.flights.steps)
            if how is None:
                continue
            self._held.remove(hold)
            self._note(item[1], self.flights.release(hold, how))
            return item
        return None

    def refuse_all(self, error: BaseException) -> None:
        """The server stops: every held request gets ``error`` (its memory reservation goes
        with it)."""
        held, self._held = self._held, []
        for hold in held:
            self.flights.release(hold, "ended")
            hold.item[0].put(error)

    def _note(self, request: Any, waited: Waited) -> None:
        if len(self._waited) > 256:  # released requests mlx-lm never tokenized
            self._waited.clear()
        self._waited[id(request)] = (request, waited)

    def waited(self, request: Any) -> Optional[Waited]:
        """The wait of ``request``, released from a hold just now (once), for its fetch."""
        kept = self._waited.pop(id(request), None)
        return kept[1] if kept is not None and kept[0] is request else None

    # -- the sequential path ----------------------------------------------------------------
    def begin_scan(self) -> None:
        """A prompt computed in one call starts: no queued request was looked at for it."""
        self._scanned.clear()

    def scan(self, queued: Iterable[Tuple[Any, Any, Any]]) -> None:
        """A prompt computed in one call (a flight whose followers wait in the queue) is
        between two chunks: each queued request not looked at yet that shares more of it
        than the trie holds has it stop where they diverge."""
        if not self.flights.enabled or not self.flights.running():
            return
        try:
            self._scan(queued)
        except Exception:  # (never into the prefill: the queued requests only lose a stop)
            log.exception("mlx_kvcache: looking at the queue for a prefix in flight failed")

    def _scan(self, queued: Iterable[Tuple[Any, Any, Any]]) -> None:
        for item in queued:
            if self._scanned.get(id(item[1])) is item[1]:
                continue
            self._scanned[id(item[1])] = item[1]
            prompt = self._prompt_of(item)
            if prompt is None:
                continue
            share = self.flights.best(prompt.key, prompt.restored, self._step(), prompt.model,
                                      holds=False)
            if share is not None and share.flight.cut(share.offset):
                log.info("mlx_kvcache: the prompt being computed stops at %d for a request "
                         "queued behind it that shares it", share.offset)
