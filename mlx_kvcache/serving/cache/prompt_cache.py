"""`TriePromptCache`: our prefix trie behind mlx-lm's server, in place of its `LRUPromptCache`.

The server calls, from its one generation thread (where the model lives, so all MLX work
here runs inline): ``fetch_nearest_cache(model_key, tokens) -> (cache, rest)``,
``insert_cache(model_key, tokens, cache, cache_type=...)``, ``trim_to(n_sequences=,
n_bytes=)``, ``nbytes``, ``len()`` and ``stats_by_type()``. Here:

* a fetch restores a fresh cache list to the deepest offset every layer reaches (never
  aliasing a snapshot, never an empty ``rest``), as mlx-lm's own classes so the batch path
  can merge it and the sequential path extend it;
* an insert stores only what the trie lacks: the KV beyond the matched prefix and, for
  recurrent / sliding-window layers, whole states at that point — so sessions sharing a
  system prompt hold it once;
* on mlx-lm's sequential path (draft model, ``--kv-bits``, images) the inserted caches
  are the request's own: they are kept, and the next request continues from them in
  place — the rows it shares with the last one (a session's history, a system prompt)
  are neither restored nor copied (`PrefixManager.adopt`; counted in ``nbytes``, given
  up first when the budget is tight);
* `checkpoints` tells the generation loop where else to stop during prefill (every
  ``checkpoint_interval`` tokens and at branch points, hybrid and sliding-window models);
* one byte budget, the same as `PrefixCache`'s (`generation.core`): snapshots plus the
  caches of the requests running — mlx-lm trims the cache to the budget less its running
  batch's caches (`trim_to`), the manager counts the caches it lends — holding after
  every insert, on every path;
* a request with a cache namespace (`namespace`: a client's ``cache_salt``, header or API
  key) reads and writes only its namespace's part of the trie: its token list carries it,
  and the trie is keyed by its ids salted with it (`_key`);
* with a cache directory the disk is a second tier (`mlx_kvcache.store.tiers`): each new
  snapshot is written once in the background after its insert, the memory budget parks
  nodes that are on disk instead of dropping them, a fetch reads back the parked nodes it
  needs (checked), and a disk budget evicts on its own; loaded when the model loads,
  flushed by `close`. The log line and ``GET /v1/cache`` say how many tokens came from
  memory and from disk, and the bytes in each tier.

On the ranks of a sharded model (``mlx.launch``) every decision is agreed between ranks
(`mlx_kvcache.prefix.agreement`), so every rank restores, stores and evicts alike: where a
request restores at its fetch; what its inserts leave rank-local (bytes, a cache list that
cannot be stored) once per turn of the generation loop (`rank_turn`), so checkpoints
cost no collective. The HTTP threads (rank 0) only read counters; `clear` and the
gather of every rank's counters run on every rank's generation thread.

This module is the seam: what mlx-lm calls and what the server asks of its cache. The
rest is in the modules named for it: the trie of the loaded model (`model_state`), the
sequential path's fetch (`sequential`), when disk captures run (`idle_writes`), the ranks'
turn (`rank_turn`), the totals of ``GET /v1/cache`` (`counters`), ``DELETE /v1/cache``
on every rank (`clearing`), a fetch explained by the prompt's parts (`layout`), the
request log (`request_log`), the prompts foreseen (`foresight`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...prefix.agreement import SOLO, Agreement
from ...prefix.explain import Reuse
from ...prefix.stats import RequestStats
from ...prefix.tokens import as_tokens
from ..guards.lifecycle import exit_now
from ..guards.counters import GuardCounters
from ..guards.memory import MemoryGuard
from . import clearing, decoding, sequential
from .counters import FetchCounters, RankCounters, Reading, gather
from .layout import FetchExplainer, Layout
from .namespace import namespace_of, salted, scoped_session
from .extract import release
from .foresight import Foresight
from .idle_work import IdleWork
from .inflight import InFlight, Waited
from .idle_writes import IdleWrites
from .model_state import ModelState, ModelStates, open_model
from . import native  # called through the module: a profile probes it (`profile`)
from .padding import was_padded
from .restored_merge import holds_restored
from .profile import Profile, probe_request_path
from .rank_turn import RankTurn
from .request_log import RequestLog

__all__ = ["TriePromptCache"]

log = logging.getLogger("mlx_kvcache")


class TriePromptCache:
    """A prompt cache for ``mlx_lm.server`` backed by a prefix trie of snapshots.

    Args:
        model_provider: the server's ``ModelProvider`` (its loaded model and tokenizer).
        max_bytes: the memory budget (``--prompt-cache-bytes``): snapshots plus the
            running requests' caches (None: half of what the model leaves of the machine's
            memory, at most a quarter of it, said in the log when the model loads).
        checkpoint_interval: hybrid and sliding-window models also checkpoint every this
            many prompt tokens (``--checkpoint-interval``).
        cache_dir: keep a disk tier under this directory (None: memory only).
        max_disk_bytes: disk budget for the model's cache directory (None: a quarter of
            the free disk, at most 32 GiB, said in the log).
        cold_bits: write KV snapshots to disk compressed to 8 or 4 bits (lossy; None).
        max_entries: ``--prompt-cache-size``, honoured by ``trim_to(n_sequences=...)``.
        agree: how the ranks of a sharded model agree (one process: `SOLO`).
        sharding: names this rank's shard of the model (its persisted cache's directory).
        profile: counts collectives and checkpoints (and, profiling, times them).
        excerpts: show prompt text around where reuse stopped (``recent`` in
            ``GET /v1/cache`` and the log lines); False: offsets and rules only.
        foresight: compute the prefixes the agent routes foresee (`foresee`) while the
            generation loop is idle (one process; ``--no-foresight``: False).
        guard_counters: the guards' refusals and queue wait, read into `counters_now`
            (the server's one `GuardCounters`; None: none counted here).
        share_in_flight: a request whose prefix another is computing right now reads it
            once stored instead of computing it again (`flights`; one process;
            ``--no-share-in-flight``: False).
    """

    def __init__(self, model_provider, *, max_bytes: Optional[int] = None,
                 checkpoint_interval: int = 2048,
                 cache_dir: Optional[str] = None, max_disk_bytes: Optional[int] = None,
                 max_entries: Optional[int] = None, pre_end_margin: int = 4,
                 agree: Agreement = SOLO, sharding: str = "",
                 cold_bits: Optional[int] = None, profile: Optional[Profile] = None,
                 excerpts: bool = True, memory: Optional[MemoryGuard] = None,
                 foresight: bool = True, share_in_flight: bool = True,
                 guard_counters: Optional[GuardCounters] = None) -> None:
        self.provider = model_provider
        self.excerpts = bool(excerpts)
        self.asked_max_bytes = None if max_bytes is None else int(max_bytes)
        #: The memory budget in force (set when a model loads when not given).
        self.max_bytes = 0 if max_bytes is None else int(max_bytes)
        self.cold_bits = cold_bits
        self.checkpoint_interval = int(checkpoint_interval)
        self.pre_end_margin = int(pre_end_margin)
        self.cache_dir = cache_dir
        self.max_disk_bytes = max_disk_bytes
        self.max_entries = max_entries
        self.agree = agree
        self.sharding = sharding
        #: The fetch totals of ``GET /v1/cache`` (`counters`).
        self.counters = FetchCounters()
        self.guard_counters = guard_counters or GuardCounters()
        self._model: Optional[ModelState] = None
        self._models = ModelStates()  # the served model's trie and the loaded one's
        self._log = RequestLog()
        #: Each fetch explained for the request log (`layout`).
        self._explain = FetchExplainer(self.excerpts)
        self._told: List[str] = []
        self._told_padded = False
        self._ranks: List[RankCounters] = []  # every rank's counters, as last shared
        #: Counts checkpoints and collectives (the agreement's own: the app hands both
        #: the one profile).
        self.profile = profile or Profile()
        #: The server's memory guard (`MemoryGuard`), when it has one: the cache holds at
        #: most what its limit leaves beside the running requests, and gives way to them.
        self.memory = memory
        if memory is not None:
            memory.hold(self)
        self._turn = RankTurn()
        #: One process: captures for the disk writer wait for an idle batch (`idle`).
        self._writes = IdleWrites()
        #: The next prompts the agent routes foresee, computed in idle time (`ahead`); off on
        #: the ranks of a sharded model (running would need the ranks to agree per chunk).
        self.foresight = Foresight(enabled=foresight and agree.size == 1)
        #: Foresight's offers and runs, and retention (`idle_work`).
        self.idle_work = IdleWork(self.foresight, self.key_of, self._per_token)
        #: The prompts being computed now (`inflight`): off on the ranks of a sharded model
        #: (holding a request would need the ranks to agree per turn).
        self.flights = InFlight(enabled=share_in_flight and agree.size == 1)
        self._waited: Optional[Waited] = None  # the next fetch's wait (`expect`)

    # -- the model's trie, made when the model loads (in the generation thread) ----------
    def _state(self, model_key) -> ModelState:
        if self._model is not None and self._model.key == model_key:
            return self._model
        if self._model is not None:  # its captures go to its own writer before a switch
            self._settle(self._model)
        with self.profile.phase("open"):
            # (the served model's trie is kept while another model is loaded: `ModelStates`)
            self._model = self._models.switch(self.provider, model_key, lambda key: open_model(
                self.provider, key, self.agree, max_bytes=self.asked_max_bytes,
                checkpoint_interval=self.checkpoint_interval, pre_end_margin=self.pre_end_margin,
                cache_dir=self.cache_dir, max_disk_bytes=self.max_disk_bytes,
                sharding=self.sharding, cold_bits=self.cold_bits),
                lambda st: st.core.close(None, recapture=False))
        self.max_bytes = self._model.max_bytes
        if self.agree.size == 1:  # (sharded: captured once a turn, `end_turn`)
            self._model.core.capture_deferred = self._capture_inside
        self._explain.open(self.provider.tokenizer)
        if self.profile.timing:
            probe_request_path(self.profile, self._model, self._explain.explainer)
        self._share_stats()
        return self._model

    def prepare(self, model_key) -> None:
        """Open the trie of the model just loaded, so the first request does not pay for it."""
        self._guard("opening the prompt cache", lambda: self._state(model_key), None)

    # -- the protocol mlx-lm's server calls ---------------------------------------------
    def _guard(self, what: str, fn, fallback, phase: str = "other"):
        # Nothing here may raise into the server: an exception in its generation thread
        # ends it. One process: log, and the request goes on without reuse. A rank of a
        # sharded model must not go on out of step with the others (the next collective
        # would hang them all): it exits, and the launcher stops the rest.
        try:
            with self.profile.phase(phase):
                return fn()
        except Exception:
            log.exception("mlx_kvcache: %s failed", what)
            if self.agree.size > 1:
                exit_now(70)
            return fallback

    def fetch_nearest_cache(self, model_key, tokens: Sequence[int]) -> Tuple[Optional[List[Any]], List[int]]:
        return self._guard("a prompt cache fetch", lambda: self._fetch(model_key, tokens),
                           (None, list(tokens)), "fetch")

    def insert_cache(self, model_key, tokens: Sequence[int], prompt_cache: List[Any],
                     *, cache_type: str = "assistant") -> None:
        tokens = self._key(tokens)
        if tokens is not None:  # (a namespaced prompt that cannot be keyed apart: not stored)
            final = self._log.final_of(tokens)
            self._guard("a prompt cache insert",
                        lambda: self._insert(model_key, tokens, prompt_cache, cache_type, final),
                        None, "checkpoint" if final is None else "final")
        self._give_way()
        release(prompt_cache)  # mlx-lm never reads an inserted cache again (`extract`)

    def _give_way(self) -> None:
        """Hold at most what the memory guard's limit leaves beside the running requests
        (`MemoryGuard.room`; no guard: nothing to do)."""
        room = self.memory.room() if self.memory is not None else None
        if room is not None and self.nbytes > room:  # the cache gives way to requests
            self.trim_to(n_bytes=room)

    def checkpoints(self, model_key, tokens: Sequence[int], extra: Sequence[int] = (),
                    guess_end: bool = True) -> List[int]:
        """Prompt offsets where prefill should stop so the caches can be stored there:
        every ``checkpoint_interval`` tokens, a few tokens before the end (unless
        ``guess_end`` is False: the next request goes on past the end), at the branch
        point where a restore will land short and at ``extra`` (offsets the request asks
        for: an agent's ``cache_control``) — hybrid and sliding-window models; KV layers
        reach any token from the final insert anyway. Those below where the fetch will
        restore are included (the server drops them with the cached tokens): they follow
        from the trie's structure, the same on every rank without a collective. Changes
        nothing."""
        def plan():
            st = self._state(model_key)
            key = self._key(tokens)
            if key is None:
                return []
            if st.store is not None:  # parked nodes of this prompt: start reading them
                st.manager.peek(st.store.prefetch, key)
            if not st.manager.whole_state or len(key) < 2:
                return []
            if sequential.current() is not None:
                return []  # the sequential fetch plans (and takes) its own stops
            return st.manager.cuts(key, extra, guess_end)
        return self._guard("planning checkpoints", plan, [], "plan")

    def expect(self, tokens: Sequence[int], marks: Sequence[Tuple[int, str]],
               session: Optional[str] = None, agent: Optional[str] = None,
               one_shot: bool = False, waited: Optional[Waited] = None) -> None:
        """The next fetch (in this generation thread) is for ``tokens``, whose parts start
        at ``marks`` (``(offset, name)``, ascending): its miss explanation names the part
        where the prompt diverged; ``session`` (the client's session name) is listed with
        the request; ``waited``: it was held for a prefix in flight (`inflight`). Eviction
        stays least-recently-used: each request touches its session's whole path, so the
        leaves that go first are those of the sessions idle longest, with no second order
        for the ranks of a sharded model to agree on.
        ``agent``: the agent in the session that sent it (a subagent's id; None: the main
        loop): foresight's key is the agent's. ``one_shot``: a request with no next one (a
        title): it takes and settles no agent's foreseen prefix."""
        scoped = None if one_shot else scoped_session(session, namespace_of(tokens), agent)
        self._explain.expect(Layout(len(tokens), tuple(marks), session, scoped)
                             if marks or session else None)
        self._waited = waited
        self.foresight.request_for(scoped)  # this request is the session's next prompt

    def stores_prompts(self) -> bool:
        """Whether a request's prompt is stored for reuse once computed (the trie is open
        and the model's caches can be snapshotted)."""
        st = self._model
        return st is not None and st.why_not is None

    def key_of(self, tokens: Sequence[int]) -> Optional[np.ndarray]:
        """What the trie keys ``tokens`` by (`_key`), or None where they are not cached (a
        prompt that cannot be keyed apart, or no trie storing prompts)."""
        return self._key(tokens) if self.stores_prompts() else None

    def restorable(self, key: np.ndarray) -> int:
        """The tokens a fetch of the trie key ``key`` would restore now (no MLX; any
        thread; 0 without a trie)."""
        st = self._model
        if st is None or st.why_not is not None or not len(key):
            return 0
        return self._guard("planning a fetch", lambda: st.manager.preview(key).restored, 0)

    def restores_anywhere(self) -> bool:
        """Whether every layer of the loaded model restores at any offset (KV caches): a
        prefix in flight can then be stored from wherever its request is past it."""
        st = self._model
        return st is not None and not st.manager.whole_state

    @staticmethod
    def _key(tokens: Sequence[int]) -> Optional[np.ndarray]:
        """What the trie keys ``tokens`` by: their ids, salted with their namespace when
        they carry one (`namespace`); None when a namespaced prompt cannot be kept apart
        (it is then neither restored nor stored)."""
        return salted(as_tokens(tokens), namespace_of(tokens))

    def _fetch(self, model_key, tokens: Sequence[int]) -> Tuple[Optional[List[Any]], List[int]]:
        # The server's list becomes an array once; everything after is O(edges + bytes).
        st = self._state(model_key)
        seq = sequential.current()
        ids = self._key(tokens)
        if ids is None:  # a namespaced prompt that starts with an image: not cached
            if seq is not None:
                seq.restoring(0)
            return None, list(tokens)
        if st.why_not is not None or not len(tokens):  # mlx-lm computes the whole prompt
            why = st.why_not or "the prompt cache is off"
            self._log.fetched(tokens, 0, 0, "sequential" if seq else "batch",
                              Reuse("off", 0, len(tokens), None, "", "", "", f"caching is off: {why}"))
            if seq is not None:
                seq.restoring(0)
            return None, list(tokens)
        mgr = st.manager
        # The batch path's merge copies the rows into mlx-lm's batch cache: no room to grow.
        live, plan = mgr.checkout(ids, seq.extra_stops if seq is not None else (),
                                  room=None if seq is not None else 0,
                                  guess_end=seq.guess_end if seq is not None else True)
        self.counters.fetched(len(ids), plan.from_disk)
        if seq is None:
            mgr.forget(live)  # the server owns these caches from here on
            self._fetched(st, ids, plan, plan.restored, "batch")
            rest = list(tokens[plan.restored:])
            # A miss too: mlx-lm merges a batch with its first row's classes, so a miss's
            # empty `RestoredKVCache` copies the hits' rows once when it leads the batch,
            # and tracking batch padding needs our recurrent class in every row.
            out = native.to_native(live.caches, st.track_padding, merged=True)
            if plan.restored == 0 and not st.track_padding and not holds_restored(out):
                return None, rest
            return out, rest
        try:
            handed = sequential.fetch(  # prefilled through its stops
                mgr, st.pair, live, plan, ids, seq, self.flights,
                lambda start: self._fetched(st, ids, plan, start, "sequential"))
        except Exception:
            seq.restored = seq.handed = 0  # mlx-lm recomputes the prompt (see `_guard`)
            raise
        finally:
            mgr.forget(live)
        return native.to_native(live.caches), list(tokens[handed:])

    def _fetched(self, st: ModelState, tokens: np.ndarray, plan, restored: int, path: str) -> None:
        self.counters.restored(restored)
        reuse, layout = self._explain.explain(st.manager, tokens, plan, restored,
                                              self.counters.clears)
        foreseen = self.foresight.read(layout.scoped if layout else None, tokens, restored)
        waited, self._waited = self._waited, None
        if waited is not None:
            self.flights.fetched(waited, restored)
        self._log.fetched(tokens, plan.matched, restored, path, reuse,
                          from_disk=plan.from_disk if st.store is not None else None,
                          session=layout.session if layout else None, foreseen=foreseen,
                          waited=waited)

    def _insert(self, model_key, tokens: np.ndarray, prompt_cache: List[Any], cache_type: str,
                final: Optional[int] = None) -> None:
        st = self._state(model_key)
        if st.why_not is not None or not len(tokens):  # caching off: nothing to store or log
            return
        seq = sequential.current()
        key = tokens  # prompt + answer; ``tokens`` what the caches hold
        tokens, note = seq.held(key) if seq is not None else (key, "")
        # the request's proposals and passes (`decoding`), where our decoder counted them
        decoded = seq.stats if seq is not None and seq.absorbed is not None else None
        caches = (native.from_native(prompt_cache, len(tokens), st.manager.kv_quant)
                  if len(tokens) else None)
        if caches is not None and st.track_padding and was_padded(prompt_cache):
            caches = None  # mlx-lm computed this row's recurrent state over its padding
            if not self._told_padded:
                self._told_padded = True
                log.info("mlx_kvcache: not storing a recurrent state computed in a padded "
                         "batch row (said once)")
        elif caches is None and len(tokens):
            kinds = sorted({type(c).__name__ for c in prompt_cache})
            if kinds != self._told:  # once per kind of cache, not once per request
                self._told = kinds
                log.warning("mlx_kvcache: not caching: a %s cache list does not hold exactly "
                            "the tokens it is stored under, or cannot be snapshotted",
                            "/".join(kinds))
        if seq is None and final is not None:  # a batch row's end
            decoded = decoding.take(prompt_cache)
            note = decoding.note(decoded) if decoded is not None else note
        sharded = self.agree.size > 1
        if caches is None and (not sharded or not len(tokens)):
            if final is not None:
                self._log_request(st, key, final, note + " | not stored", decoded)
            return
        # On a sharded model every rank records (the node without state where its caches
        # cannot be stored), with no collective; the turn settles the rest (`rank_turn`).
        made = sharded and RankTurn.makes_node(st.manager, tokens)
        if seq is not None and caches is not None and not sharded:
            # The sequential path's caches are this request's own (mlx-lm drops them after
            # this insert): kept, the next request continues from them in place — no copy
            # of the prefix it shares with this one (`PrefixManager.adopt`).
            node = st.manager.adopt(caches, tokens, label=cache_type)
        else:
            node = st.manager.record(caches, tokens, label=cache_type) if len(tokens) else None
        if sharded:
            self._turn.inserted(node, made, caches is None)
        self.profile.add(f"{'stored' if node is not None and caches is not None else 'not_stored'}"
                         f".{self.profile.current}")
        if node is not None and caches is not None and cache_type == "assistant":
            # a request's end (segment ends are its prefixes)
            self._explain.explainer.remember(tokens, st.manager.evicted_bytes,
                                             self.counters.clears)
        if final is not None:
            self._log_request(st, key, final,
                              note if caches is not None else note + " | not stored", decoded)
        if not sharded and self._writes.changed():
            # sharded: once a turn, after the budget is settled (`end_turn`); else while
            # the batch is idle (`idle`), or now when too much has waited
            self._writes.capture(st)

    # -- idle work: foresight, retention --------------------------------------------------
    def ahead(self, waiting, step: int, stream=None) -> None:
        """The generation loop is idle: compute foreseen prefixes until ``waiting()`` says a
        request came (`IdleWork.ahead`). Generation thread."""
        st = self._model
        if st is None or st.why_not is not None or not self.foresight.pending():
            return  # (caching off: nothing is computed ahead, as nothing is stored)
        if self._guard("computing a foreseen prefix",
                       lambda: self.idle_work.ahead(st, waiting, step, stream), False,
                       "foresight") and self.agree.size == 1 and self._writes.changed():
            self._writes.capture(st)
        self._give_way()  # what it computed is cache: within the memory guard's room too

    def _per_token(self) -> Optional[float]:
        """The bytes a token's caches take, as the memory guard measured them (None: no
        guard, or not measured)."""
        fp = self.memory.footprint if self.memory is not None else None
        return fp.kv_per_token if fp is not None and fp.kv_per_token > 0 else None

    def busy(self) -> None:
        """A request reached the generation loop: the disk writer holds what it has not
        started until the loop is `idle` again (one process; on the ranks of a sharded
        model the turn settles the writes, `end_turn`)."""
        st = self._model
        if st is not None and st.writer is not None and self.agree.size == 1:
            st.writer.busy()

    def idle(self) -> None:
        """The generation loop has no request in flight (and before it stops): age what
        was retired (`IdleWork.retire`), capture what the inserts changed for the disk writer,
        which writes once the loop has stayed idle a moment (one process; `idle_writes`,
        `store.autosave`)."""
        st = self._model
        if st is not None and st.why_not is None:
            self._guard("ageing finished prompts", lambda: self.idle_work.age(st), None, "idle")
        if st is not None and st.writer is not None:
            st.writer.idle()
        if not self._writes.pending or st is None:
            return
        self._guard("capturing the prompt cache for the disk",
                    lambda: self._writes.capture(st), None, "idle")

    def _capture_inside(self) -> None:
        """Capture the inserts waiting for an idle batch now (an eviction is about to drop
        what they made: inside the trie's critical section, where it runs)."""
        if self._model is not None:
            self._writes.capture_inside(self._model)

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        st = self._model
        if st is None:
            return
        mgr = st.manager

        def trim():
            # Every ceiling below the budget lands here: mlx-lm's (the budget less its
            # running batch's caches, `model_state._share_budget`) and the memory guard's.
            if n_bytes is not None:
                if mgr.defer_budget:  # this rank's ceiling, fitted at the turn's settle
                    self._turn.limit = max(int(n_bytes), 0)
                else:
                    st.core.fit(n_bytes)
            if n_sequences is not None:
                mgr.fit_count(int(n_sequences))  # the node count: the same on every rank
        self._guard("trimming the prompt cache", lambda: mgr.run(trim), None, "trim")

    # -- once per turn of a sharded server's generation loop ----------------------------
    def turn_flags(self) -> List[int]:
        """This rank's part of the turn's collective (`rank_turn`): read-only."""
        st = self._model
        return self._turn.flags(st.manager) if st is not None else [0, 0]  # no model yet

    def end_turn(self, agreed: Sequence[int]) -> None:
        """After the turn's collective, on every rank (``agreed``: every rank's
        `turn_flags`, element-wise max): fit the budget, drop what not every rank stored."""
        st = self._model
        if st is None:
            return

        def settle() -> None:
            if self._turn.settle(st.manager, self.agree, agreed):
                self._writes.capture(st)  # what this turn's inserts left, once the budget holds
        self._guard("settling the prompt cache", settle, None, "settle")

    @property
    def nbytes(self) -> int:
        st = self._model
        # snapshots, and the last sequential request's caches kept for the next (`adopt`)
        return 0 if st is None else st.manager.peek(lambda: st.manager.held_bytes)

    def __len__(self) -> int:
        st = self._model
        if st is None:
            return 0
        return st.manager.trie.node_count  # a counter: no lock needed to read one int

    def __bool__(self) -> bool:  # an empty cache is still a cache
        return True

    def stats_by_type(self) -> Dict[str, Dict[str, int]]:
        out = {t: {"n_sequences": 0, "n_bytes": 0} for t in ("assistant", "user", "system")}
        st = self._model
        if st is None:
            return out

        # mlx-lm logs this before every request: counters kept by the trie, O(labels).
        for label, (n, nbytes) in st.manager.peek(st.manager.trie.label_stats).items():
            row = out.setdefault(label or "assistant", {"n_sequences": 0, "n_bytes": 0})
            row["n_sequences"] += n
            row["n_bytes"] += nbytes
        return out

    # -- GET and DELETE /v1/cache: counters read in O(1), every rank's gathered when asked,
    # and a clear that is durable on every rank before it answers ------------------------
    def _local(self) -> RankCounters:
        st, c = self._model, self.counters
        if st is None:
            return RankCounters(requests=c.requests, cached_tokens=c.cached_tokens,
                                disk_tokens=c.disk_tokens)
        mgr = st.manager
        # Counters only: O(1) in the trie's size (the idle set: O(layers)), under the lock.
        held, nodes, evicted = mgr.peek(lambda: (mgr.held_bytes, mgr.trie.node_count,
                                                 mgr.evicted_bytes))
        disk = st.store.disk_bytes if st.store is not None else 0
        return RankCounters(held, nodes, disk, evicted, c.requests, c.cached_tokens,
                            c.disk_tokens)

    def share_stats(self) -> None:
        """Gather every rank's counters for rank 0's ``GET /v1/cache`` (one small gather;
        on every rank's generation thread, at the same point)."""
        self._guard("gathering the ranks' counters", self._share_stats, None)

    def _share_stats(self) -> None:
        """Every rank's counters, for rank 0's ``GET /v1/cache`` (one small gather)."""
        if self.agree.size > 1:
            with self.profile.phase("stats"):
                self._ranks = gather(self.agree, self._local())

    def counters_now(self) -> Reading:
        """Every counter now, read once (any thread; on a sharded model, this rank's):
        what ``GET /v1/cache``'s ``counters`` and ``GET /metrics`` show."""
        here, c, fs, g = self._local(), self.counters, self.foresight, self.guard_counters
        return Reading(
            requests=c.requests, prompt_tokens=c.prompt_tokens,
            computed_tokens=c.prompt_tokens - c.cached_tokens, restored_tokens=c.cached_tokens,
            disk_tokens=c.disk_tokens, ahead_tokens=fs.computed, ahead_used_tokens=fs.used,
            evicted_bytes=here.evicted_bytes, clears=c.clears, ram_bytes=here.bytes_held,
            disk_bytes=here.disk_bytes, nodes=here.nodes, refusals=g.by_reason(),
            queue_wait=g.queue_wait())

    def report(self) -> Dict[str, Any]:
        """What ``GET /v1/cache`` returns (on a sharded model: this rank's view, and every
        rank's counters as of the last `share_stats` under ``ranks``): its figures and
        ``counters`` come from one `counters_now`."""
        now, st = self.counters_now(), self._model
        out: Dict[str, Any] = {
            "bytes_held": now.ram_bytes, "max_bytes": self.max_bytes,
            "disk_bytes": now.disk_bytes,
            "max_disk_bytes": st.store.max_disk_bytes if st and st.store else None,
            "nodes": now.nodes, "requests": now.requests, "prompt_tokens": now.prompt_tokens,
            "cached_tokens": now.restored_tokens,
            "ram_tokens": now.restored_tokens - now.disk_tokens, "disk_tokens": now.disk_tokens,
            "hit_rate": now.restored_tokens / now.prompt_tokens if now.prompt_tokens else 0.0,
            "evicted_bytes": now.evicted_bytes, "checkpoint_interval": self.checkpoint_interval,
            "cache_dir": str(st.store.directory()) if st and st.store else None,
            "cold_bits": self.cold_bits, "enabled": st is not None and st.why_not is None,
            # the layers each node holds (with a draft model: the target's, then the draft's)
            "layers": len(st.manager.ops) if st else 0,
            "kv_bits": st.manager.kv_quant.signature()[1:] if st and st.manager.kv_quant
            else None,
            "recent": self._log.listing(), "prompt_excerpts": self.excerpts,
            "foresight": self.foresight.report(),
            "in_flight": self.flights.report(),
            "profile": self.profile.snapshot(), "counters": now.as_dict(),
        }
        if st is not None and st.store is not None:
            mgr, tier = st.manager, st.store.tier
            out["disk_nodes"] = mgr.trie.parked_count
            out["demoted_bytes"], out["promoted_bytes"] = tier.demoted_bytes, tier.promoted_bytes
            # inserts the disk does not hold yet (written once the server idles a moment)
            out["disk_writes_pending"] = bool(self._writes.pending) or (
                st.writer is not None and st.writer.pending)
        if st is not None and st.why_not is not None:
            out["disabled_because"] = st.why_not
        if self.memory is not None:  # the server's memory guard
            out["memory"] = self.memory.report()
        if self.agree.size > 1:
            out["rank"], out["world_size"] = self.agree.rank, self.agree.size
            out["ranks"] = [r.as_dict(i) for i, r in enumerate(self._ranks)]
        return out

    def clear(self) -> Dict[str, Any]:
        """Drop every snapshot, in memory and on disk, durably, before returning
        (``DELETE /v1/cache``). Runs where the model lives (the generation thread); on a
        sharded model every rank calls it at the same point and the results are gathered.
        Returns ``cleared``, ``memory_cleared``, ``disk_cleared``, ``freed_bytes`` and
        ``freed_files`` (what the disk got back) and, when a directory could not be
        cleared, ``error`` naming it (per rank under ``ranks``)."""
        return self._guard("clearing the prompt cache", self._clear_here,
                           {"cleared": False, "memory_cleared": False, "disk_cleared": False,
                            "error": "clearing the prompt cache failed (see the log)"}, "clear")

    def _clear_here(self) -> Dict[str, Any]:
        if self._model is not None:
            self.foresight.clear()
            self.counters.clears += 1
        # (the loaded model's trie, and the served model's kept while another is loaded)
        ranks = [clearing.clear_rank(list(self._models.held()), self.agree.rank)]
        if self.agree.size > 1:
            ranks = clearing.gather(self.agree, ranks[0])
            self._share_stats()
        return clearing.answer(ranks, self.agree.size > 1)

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background writes submitted so far."""
        st = self._model
        return True if st is None or st.writer is None else st.writer.flush(timeout)

    def _settle(self, st: ModelState) -> None:
        if st.writer is not None and self._writes.pending:
            self._writes.capture(st)

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background writes of every model's trie held (at the stop)."""
        if self._model is None:
            return
        self._settle(self._model)  # the generation thread has stopped: nothing else runs MLX
        for st in self._models.held():
            st.core.close(timeout, recapture=False)

    # -- the request log line -------------------------------------------------------------
    def _log_request(self, st: ModelState, tokens: np.ndarray, fetch: int, extra: str = "",
                     decoded: Optional[RequestStats] = None) -> None:
        """One line per request, at its final insert (``tokens``: prompt plus answer;
        ``fetch``: its fetch in the log, `RequestLog.final_of`; ``decoded``: its
        proposals and passes, where our decoder counted them)."""
        mgr = st.manager
        held = mgr.peek(lambda: mgr.trie.nbytes)
        disk = st.store.disk_bytes if st.store is not None else None
        self._log.finished(fetch, tokens, held, self.max_bytes,
                           self.agree.rank if self.agree.size > 1 else None, extra, disk,
                           decoding=None if decoded is None else decoding.summary(decoded))
        if self.profile.timing:
            log.info(self.profile.line(self.agree.rank))
