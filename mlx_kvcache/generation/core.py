"""`CacheCore`: the one composition root of a cached model, for both front ends.

`PrefixCache` (generation) and the server's `TriePromptCache` (serving) hold one each. It
builds the `PrefixManager` for a `ModelPair` with every setting passed to its constructor
(or, when this model's caches cannot be reused, a `NullManager` that stores nothing: the
core always holds a manager, and ``why_not`` says why it is the null one), attaches the
disk store once (`attach_store`: the store's check before each restore, the no-merge rule
for nodes on disk, load, the budget, the purge of bad files — in one critical section),
owns the background writer and the fingerprint that names the persisted cache, and
measures whether the memory budget can hold one checkpoint.

The memory budget (``max_bytes``) has one meaning in both front ends: every byte of KV
cache held in memory for the model — the trie's snapshots plus the caches of the requests
running now. `PrefixCache` lends those caches itself (live sets, counted by the manager);
the server's batch holds its own, and mlx-lm trims the cache to the budget less them
(`serving.cache.model_state.open_model` hands it the budget in force,
`TriePromptCache.trim_to` is where every ceiling below the budget lands). docs/design.md,
"The memory budget".
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ..caches import CacheError, KVQuantization, layer_signature, make_prompt_cache
from ..prefix.agreement import SOLO, Agreement, every
from ..prefix.live import LiveSet
from ..prefix.manager import PrefixManager
from ..prefix.null import Manager, NullManager
from ..store import PersistentStore, cache_key, model_fingerprint
from ..store.autosave import Autosaver
from . import sizing
from .model_pair import ModelPair

__all__ = ["CacheCore", "COLD_BITS", "check_cold_bits"]

#: ``cold_bits`` accepted: `QuantizedSnapshot` widths worth storing.
COLD_BITS = (4, 8)
#: Seconds an eviction waits for the background writer before it drops an unwritten node
#: (a write is one request's capture: well under a second on a working disk).
WRITE_WAIT = 10.0


def check_cold_bits(bits: Any) -> Optional[int]:
    """``bits`` if None or one of `COLD_BITS`; ``ValueError`` / ``TypeError`` otherwise."""
    if bits is None:
        return None
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"cold_bits must be an int (4 or 8) or None, got {type(bits).__name__} {bits!r}")
    if bits not in COLD_BITS:
        raise ValueError(f"cold_bits must be 4 or 8 (or None for exact snapshots), got {bits}")
    return bits


Identify = Callable[[], Tuple[str, Optional[str]]]


class CacheCore:
    """The manager, disk store, background writer and fingerprint of one `ModelPair`.

    Args:
        pair: the target model and its optional draft (one node holds both's layers).
        max_bytes: the memory budget (see the module doc).
        kv_quant: the ``kv_bits`` schedule (`KVQuantization`), fixed for the trie.
        pre_end_margin, snapshot_interval, merge_below, keep_live, executor, defer_budget:
            the `PrefixManager`'s.
        agree: how the ranks of a sharded model decide together; every rank must construct
            its core at the same point (the constructor agrees whether caching is on and
            where checkpoints are planned).
        off: this rank already knows it cannot cache (the reason); agreed like a cache
            list that cannot be snapshotted.
        cold_bits: KV layers go to disk compressed to this many bits (None: exact).
        identify: ``(model identity, draft identity or None)`` for the fingerprint
            (default: `model_fingerprint` of the loaded models, the target's with
            ``tokenizer``); called once, when first needed.
        sharding: names this rank's shard of the model in the fingerprint (sharded only).
    """

    def __init__(self, pair: ModelPair, *, max_bytes: int,
                 kv_quant: Optional[KVQuantization] = None, pre_end_margin: int = 4,
                 snapshot_interval: int = 2048, merge_below: int = 256, keep_live: bool = False,
                 executor: Optional[Callable[..., Any]] = None, agree: Agreement = SOLO,
                 defer_budget: bool = False, off: Optional[str] = None,
                 cold_bits: Optional[int] = None, tokenizer: Any = None,
                 identify: Optional[Identify] = None, sharding: Optional[str] = None) -> None:
        self.pair = pair
        self.kv_quant = kv_quant
        self.agree = agree
        self.max_bytes = int(max_bytes)
        self.cold_bits = check_cold_bits(cold_bits)
        self._exec = executor or (lambda fn, *a: fn(*a))
        self._identify = identify or (lambda: (
            model_fingerprint(pair.model, tokenizer),
            None if pair.draft is None else model_fingerprint(pair.draft)))
        self._sharding = sharding if agree.size > 1 else None
        self._fingerprint: Optional[str] = None
        #: Why this model's caches are not reused (None: they are).
        self.why_not: Optional[str] = off
        #: The trie and live sets; a `NullManager` (stores nothing) when ``why_not``.
        self.manager: Manager
        #: The disk tier (`attach_store`), and its background writer.
        self.store: Optional[PersistentStore] = None
        self.autosaver: Optional[Autosaver] = None
        #: An owner that defers captures (the server captures while its batch is idle)
        #: puts here the call that captures what it deferred (inside the trie's critical
        #: section, as `autosave`): an eviction about to drop unwritten nodes makes it.
        self.capture_deferred: Callable[[], None] = lambda: None
        #: The disk budget in force, and how its default was chosen (None: given).
        self.max_disk_bytes: Optional[int] = None
        self.disk_budget_note: Optional[str] = None
        if off is None:
            try:  # a layer that cannot be snapshotted, found before any collective
                LiveSet(pair.make_caches(), quant=kv_quant)
            except CacheError as e:
                self.why_not = str(e)
        if not every(agree, self.why_not is None):  # a rank that cannot cache turns it off for all
            self.why_not = self.why_not or "another rank cannot snapshot its layers"
            self.manager = NullManager(self.why_not, max_bytes=self.max_bytes, agree=agree)
            return
        self.manager = PrefixManager(
            pair.make_caches, max_bytes=self.max_bytes, pre_end_margin=pre_end_margin,
            snapshot_interval=snapshot_interval, merge_below=merge_below, keep_live=keep_live,
            executor=executor, kv_quant=kv_quant, agree=agree, defer_budget=defer_budget)

    def turn_off(self, why: str) -> None:
        """Stop reusing caches (a check after construction found them wrong); before any
        request, and on every rank alike."""
        self.manager = NullManager(why, max_bytes=self.max_bytes, agree=self.agree)
        self.why_not = why

    # -- the memory budget ----------------------------------------------------------------
    def budget_problem(self, interval: int) -> Optional[str]:
        """The warning when ``max_bytes`` cannot hold one checkpoint of the pair (at
        ``interval`` tokens, at most 2048) beside a request's own caches; None when it
        can, when the models cannot be measured, or when caching is off (nothing is
        held). Runs both models on one token."""
        if self.why_not is not None:
            return None
        tokens = max(1, min(int(interval), 2048) if interval > 0 else 2048)
        try:
            one = self._exec(lambda: sum(
                sizing.checkpoint_bytes(m, lambda m=m: make_prompt_cache(m), tokens)
                for m in self.pair.models))
        except Exception:  # noqa: BLE001 - a model that cannot take one token: no advice
            return None
        return sizing.budget_problem(self.max_bytes, one, tokens, live_counted=True)

    def fit(self, ceiling: Optional[int] = None) -> None:
        """Fit the budget now, and ``ceiling`` for the snapshots when given (a lower one
        asked for from outside: what the server's running batch or its memory guard
        leaves); agreed between ranks in one collective. Callable inside a critical
        section too."""
        self.manager.settle(None if ceiling is None else max(int(ceiling), 0))

    # -- the disk tier --------------------------------------------------------------------
    def fingerprint(self) -> str:
        """The name of this cache on disk (`mlx_kvcache.store.cache_key`): the models'
        identities, and the rank's shard, ``cold_bits`` and ``kv_bits`` when set.
        Computed once."""
        if self._fingerprint is None:
            model_fp, draft_fp = self._identify()
            self._fingerprint = cache_key(
                model_fp, draft_fp=draft_fp, sharding=self._sharding, cold_bits=self.cold_bits,
                kv_quant=None if self.kv_quant is None else self.kv_quant.signature())
        return self._fingerprint

    def open_store(self, root: Any, max_disk_bytes: Optional[int] = None, *,
                   default: bool = False) -> PersistentStore:
        """The disk store under ``root`` (made the trie's second tier and hooked into every
        restore the first time; later calls return it). ``max_disk_bytes`` None: no disk
        budget, or with ``default`` the default one (`sizing.disk_budget_for`, said in
        ``disk_budget_note``; a budget already recorded for the directory wins). On a
        sharded model every rank opens its own or none does (raises where any rank
        could not)."""
        if self.store is not None:
            return self.store
        if self.why_not is not None:  # (agreed: every rank is off alike)
            raise RuntimeError(f"caching is off for this model: {self.why_not}")
        mgr = self.manager
        store, error = None, None
        try:
            if default and max_disk_bytes is None:
                max_disk_bytes, self.disk_budget_note = sizing.disk_budget_for(
                    root, self.fingerprint())
            self.max_disk_bytes = max_disk_bytes
            store = PersistentStore(mgr.trie, layer_signature(mgr.ops, self.kv_quant), root,
                                    self.fingerprint(), max_disk_bytes, keep=mgr.keep,
                                    agree=self.agree, cold_bits=self.cold_bits,
                                    default_budget=self.disk_budget_note is not None)
        except Exception as e:  # noqa: BLE001 - agreed first, raised after
            error = e
        if not every(self.agree, store is not None):  # all ranks persist, or none do
            if store is not None:
                store.close()
            raise error or OSError("another rank could not open its cache directory")
        mgr.attach_disk(store.before_request)
        self.store = store
        return store

    def load(self, root: Any = None) -> int:
        """Merge what the store holds under ``root`` (default: its own directory) into the
        trie, fit the budget, drop the nodes of bad files — one critical section. Returns
        the tokens loaded (on disk; read when first needed)."""
        store, mgr = self.store, self.manager
        if store is None:
            raise RuntimeError("no disk store is open (open_store)")

        def load() -> int:
            n = store.load(root)
            mgr.enforce_budget()
            store.purge_bad()
            return n
        return mgr.run(load)

    def attach_store(self, root: Any, max_disk_bytes: Optional[int] = None, *,
                     default: bool = False) -> int:
        """Open the store under ``root`` (`open_store`), load it (`load`) and start the
        background writer; returns the tokens loaded."""
        store = self.open_store(root, max_disk_bytes, default=default)
        n = self.load()
        mgr = self.manager
        # Half the memory budget held: the tier parks only written nodes, so writes that
        # waited for an idle moment go now (a full budget would drop unwritten ones). Read
        # from the writer's thread: a counter, no lock.
        self.autosaver = Autosaver(store.write, pressing=lambda: (
            2 * mgr.snapshot_bytes >= mgr.max_bytes))
        store.tier.set_writer(self._write_now)
        return n

    def _write_now(self) -> bool:
        """Eviction parks only written nodes: before it drops one, what was deferred is
        captured and every capture not yet written is written (the last requests', on a
        writer that lags), waited for at most `WRITE_WAIT`. Whether any was pending."""
        saver = self.autosaver
        if saver is None:
            return False
        self.capture_deferred()
        return saver.pending and saver.flush(timeout=WRITE_WAIT)

    def autosave(self) -> None:
        """Hand what changed in the trie to the background writer (inside a critical
        section: the capture reads the trie). Never raises: a failed capture is the
        writer's to report and retry."""
        if self.autosaver is None or self.store is None:
            return
        try:
            plan = self.store.capture()
        except Exception as e:  # never break the request that just ended
            self.autosaver.failed(e)
        else:
            self.autosaver.submit(plan)

    def save(self) -> int:
        """Write what the trie holds now (incremental); bytes on disk."""
        store, mgr = self.store, self.manager
        if store is None:
            raise RuntimeError("no disk store is open (open_store)")
        return store.write(*mgr.run(store.capture))

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the background saves asked for so far are on disk (False on timeout)."""
        return True if self.autosaver is None else self.autosaver.flush(timeout)

    def close(self, timeout: Optional[float] = None, recapture: bool = True) -> None:
        """Finish the background saves (with ``recapture``, capture and write once more:
        what changed since, what a failed write owed) and close the store. Idempotent."""
        mgr, store = self.manager, self.store
        if self.autosaver is not None:
            again = (lambda: mgr.run(store.capture)) if recapture and store is not None else None
            self.autosaver.close(timeout, again)
        if store is not None:
            store.close()
