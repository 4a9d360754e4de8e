"""The prefix-cache manager (layer 3): what to restore, where to snapshot, what to keep.

It owns one model's trie of snapshots and lends *live sets* (cache lists) to requests:
`checkout` gives a request a live set of its own, restored for its prompt, and the
offsets where its prefill must stop; `checkpoint` records the live set at such a stop;
`checkin` records the request's end and takes the live set back. Requests own their
live sets, so any number may run at once, from any threads or event loops; the trie,
the budget and the pool of live sets change only inside critical sections (`run`), which never
span a generator step (docs/design.md, "Concurrency").

The restore rules are in `planner`. The byte budget (``max_bytes``) counts everything
the manager holds: the trie's snapshots and every live set, lent to a request or idle.
It is enforced whenever that grows: after a restore, before each snapshot (a snapshot
that cannot fit is skipped and counted) and at a request's end. The idle live set goes
first (the trie holds its tokens too), then the least recently used snapshots. Its
public verbs — `fit_bytes`, `fit_count`, `enforce_budget`, `settle` — may be called from
anywhere, inside a critical section (`run`) too.

On the ranks of a sharded model every eviction step takes the same node everywhere (the
victim is chosen from structure and use alone, `eviction.evict_one`), so "evict until
every rank fits" needs no collective per step: each rank evicts until it fits on its own,
then all catch up with the rank that needed the most steps (one ``all_max``). The result
is the step-by-step agreement's, at the cost of one collective. With a disk tier a step
may park its node instead (its data stays on disk), and whether this rank's copy is
written yet is rank-local: there each step agrees on it (park only where every rank
can), one collective per step, so the tries keep one shape.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple


from ..caches.schedule import KVQuantization
from . import planner
from .agreement import SOLO, Agreement, any_rank, every
from .eviction import evict_one
from .live import LiveSet
from .planner import Plan
from .tokens import as_tokens, join
from .trie import PrefixTrie, TrieNode

__all__ = ["PrefixManager", "Plan"]

log = logging.getLogger("mlx_kvcache")


class PrefixManager:
    """Trie + live sets for one model.

    Args:
        make_caches: returns a fresh cache list for the model (one per live set).
        max_bytes: budget for everything held: snapshots and live caches.
        pre_end_margin: snapshot this many tokens before a prompt's end (hybrid and
            sliding-window models), so a retried answer or a re-rendered assistant
            turn still lands on a snapshot.
        snapshot_interval: also snapshot every this many prompt tokens (hybrid and
            sliding-window models), bounding the recompute after any divergence.
        merge_below: a plain node shorter than this is merged into its single new child
            (cheap, avoids a chain of tiny nodes); longer ones stay until eviction.
        keep_live: keep a finished request's live set, so a request continuing it starts
            without a restore copy. The trie holds the same tokens, so this trades memory
            (the whole conversation's caches, counted in the budget) for a copy that is
            small next to any prefill; off by default.
        executor: runs a callable on the thread that may do this model's MLX work and
            returns its result (`PrefixCache` passes its engine; None runs inline, for
            callers that are that thread already, like mlx-lm's server thread).
        kv_quant: the ``kv_bits`` schedule every live set's full-attention layers follow
            (`KVQuantization`); prefill also stops, and snapshots, at its start.
        agree: how the ranks of a sharded model decide together (`agreement`; one process
            decides alone). The constructor agrees once: checkpoints are planned where any
            rank has a layer that needs them, so every rank must construct at one point.
        defer_budget: the budget is fitted by the caller once in a while (`settle`, agreed
            in one collective), not at every record and restore: records then store on
            every rank without agreement (a sharded server settles once per turn).
    """

    def __init__(self, make_caches: Callable[[], List[Any]], *, max_bytes: int,
                 pre_end_margin: int = 4, snapshot_interval: int = 2048,
                 merge_below: int = 256, keep_live: bool = False,
                 executor: Optional[Callable[..., Any]] = None,
                 kv_quant: Optional[KVQuantization] = None, agree: Agreement = SOLO,
                 defer_budget: bool = False) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.make_caches = make_caches
        self.kv_quant = kv_quant
        # A cache list that never holds state: its classes split and merge snapshots, and
        # `preview` plans on it (it is only ever read).
        self._blank = LiveSet(make_caches(), quant=kv_quant)
        self.ops = self._blank.leaves
        self.trie = PrefixTrie(self.ops)
        self.max_bytes = int(max_bytes)
        self.pre_end_margin = int(pre_end_margin)
        self.snapshot_interval = int(snapshot_interval)
        chunk = min((c.interval_cap for c in self.ops if c.interval_cap), default=0)
        if chunk and not 0 < self.snapshot_interval <= chunk:
            # A chunked layer keeps only about one chunk of rows: stopping at least once a
            # chunk lets every node's snapshot hold all of its rows (reach at any token).
            self.snapshot_interval = chunk
        self.merge_below = int(merge_below)
        self.keep_live = bool(keep_live)
        self.agree: Agreement = agree
        #: Whether some layer (on some rank) can only come back from a snapshot at a node end.
        self.whole_state = any_rank(agree, any(not c.any_offset for c in self.ops))
        #: Nodes that are deliberate restore points (never merged away except by eviction).
        #: Weak: a node the trie drops leaves it by itself (no sweep after an eviction).
        self.keep: "weakref.WeakSet[TrieNode]" = weakref.WeakSet()
        #: Called with a prompt's tokens inside `checkout`, before anything is restored
        #: (`attach_disk`): the disk store fills the parked nodes of its path there
        #: (checked) and returns their ``(start, end)`` spans (counted in `Plan.from_disk`).
        self.verify: Optional[Callable[[Sequence[int]], Any]] = None
        self.evicted_bytes = 0
        self.defer_budget = bool(defer_budget)
        self._lock = threading.Lock()
        self._exec = executor or (lambda fn, *a: fn(*a))
        self._inside = threading.local()  # per thread: critical sections entered, not left
        self._deferred: deque = deque()
        self._idle: Optional[LiveSet] = None
        self._lent: "weakref.WeakSet[LiveSet]" = weakref.WeakSet()
        self._epoch = 0

    # -- critical sections ----------------------------------------------------------------
    @contextmanager
    def _held(self, drain: bool) -> Iterator[None]:
        # Counted before acquiring: a finaliser the garbage collector runs on this thread
        # anywhere from here on must defer instead of waiting for the lock it holds.
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            with self._lock:
                while drain and self._deferred:
                    self._deferred.popleft()()
                yield
        finally:
            self._inside.depth -= 1

    def _busy_here(self) -> bool:
        return bool(getattr(self._inside, "depth", 0))

    def _section(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a critical section: this one when the caller is inside one."""
        return fn(*args) if self._busy_here() else self.run(fn, *args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` inside a critical section on the MLX thread (see ``executor``):
        short, never spanning a generator step; deferred work runs first."""
        if self._busy_here():
            raise RuntimeError("PrefixManager.run called from inside a critical section")

        def section():
            with self._held(drain=True):
                return fn(*args)
        return self._exec(section)

    def peek(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the trie's lock on the calling thread: for reading counters
        (no MLX work, nothing deferred runs)."""
        with self._held(drain=False):
            return fn(*args)

    # -- checkout: restore ----------------------------------------------------------------
    def checkout(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
                 room: Optional[int] = None, guess_end: bool = True) -> Tuple[LiveSet, Plan]:
        """A live set of the caller's own, restored for ``tokens``, and its prefill plan.

        Always leaves at least one prompt token to evaluate (the model needs logits).
        ``extra_stops`` adds snapshot offsets (e.g. chat message boundaries). ``tokens``
        may be any token sequence; an int64 numpy array is used without a copy.
        ``room``: tokens the live set will be written past the restored ones in place
        (None: the rest of the prompt and the first new token; 0 for a caller that copies
        the caches elsewhere before writing, like mlx-lm's batch merge). ``guess_end``
        False: the caller knows the next request goes on past this prompt's end, so hybrid
        and sliding-window models take no stop a few tokens before it (`planner.stops`).
        """
        tokens = as_tokens(tokens)
        if not len(tokens):
            raise ValueError("the prompt is empty")
        return self.run(self._checkout, tokens, list(extra_stops), room, guess_end)

    def preview(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
                guess_end: bool = True) -> Plan:
        """The plan `checkout` would make for ``tokens`` on fresh caches; changes nothing
        and runs no MLX (any thread)."""
        tokens = as_tokens(tokens)
        if not len(tokens):
            raise ValueError("the prompt is empty")
        return self.peek(self._plan, self._blank, tokens, list(extra_stops), guess_end)

    def _plan(self, live: LiveSet, tokens, extra_stops: List[int], guess_end: bool) -> Plan:
        return self._target(live, tokens, extra_stops, guess_end)[0]

    def cuts(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
             guess_end: bool = True) -> List[int]:
        """Every offset where a fresh live set's prefill of ``tokens`` may have to stop:
        the stops of whatever plan `checkout` will make, and the ones below its restored
        offset (never reached). From the trie's structure alone, so the same on every rank
        with no agreement; no MLX (any thread)."""
        tokens = as_tokens(tokens)
        n = len(tokens)
        if n < 2:
            return []

        def structural() -> List[int]:
            path, matched = self.trie.find(tokens)
            if matched >= n:
                path, matched = self.trie.find(tokens[: n - 1])
            return self._stops(n, 0, matched, list(extra_stops), path, guess_end)
        return self.peek(structural)

    def _target(self, live: LiveSet, tokens, extra_stops: List[int], guess_end: bool = True):
        """``(plan, path, live_common)`` for ``tokens`` on ``live``."""
        n = len(tokens)
        path, matched = self.trie.find(tokens)
        if matched >= n:  # full hit: hold back the last token so it produces logits
            path, matched = self.trie.find(tokens[: n - 1])
        target, top, live_common, reason = planner.choose_target(live, tokens, path, matched,
                                                                 self.agree)
        stops = self._stops(n, target, top, extra_stops, path, guess_end)
        return Plan(n, max(matched, target), target, reason, stops), path, live_common

    def _stops(self, n: int, restored: int, matched: int, extra: Sequence[int],
               path: Sequence[TrieNode] = (), guess_end: bool = True) -> List[int]:
        if self.kv_quant is not None:  # the switch to quantized rows happens exactly here
            extra = list(extra) + [self.kv_quant.start]
        # node ends holding every layer's state (in memory or parked): a split's upper
        # half holds none for recurrent layers (only whole-state models guess stops)
        known = [nd.end for nd in path if nd.end <= matched and (
            nd.parked or all(s is not None for s in nd.snapshots))] if self.whole_state else []
        return planner.stops(n, restored, matched, whole_state=self.whole_state,
                             pre_end_margin=self.pre_end_margin,
                             snapshot_interval=self.snapshot_interval, extra=extra, known=known,
                             guess_end=guess_end)

    def _checkout(self, tokens, extra_stops: List[int], room: Optional[int] = None,
                  guess_end: bool = True) -> Tuple[LiveSet, Plan]:
        live = self._idle
        if live is not None and len(live.tokens) and live.tokens[0] == tokens[0]:
            self._idle = None
        else:
            live = LiveSet(self.make_caches(), quant=self.kv_quant)
        live.epoch = self._epoch
        self._lent.add(live)
        loaded = self.verify(tokens) if self.verify is not None else None
        plan, path, live_common = self._target(live, tokens, extra_stops, guess_end)
        target = plan.restored
        live.align(target)
        if room is None:
            room = len(tokens) - target + 1  # the rest of the prompt and the first new token
        ok = all(planner.restore_layer(c, i, target, path, live_common, room)
                 for i, c in enumerate(live.leaves))
        if not every(self.agree, ok and live.consistent(target)):
            log.warning("restore to offset %d failed; recomputing the prompt from scratch", target)
            live.reset()
            plan.reason = f"restore to offset {target} failed unexpectedly; recomputed from 0"
            plan.restored = target = 0
            plan.stops = self._stops(len(tokens), 0, plan.matched, extra_stops)
        plan.from_disk = sum(max(0, min(b, target) - a) for a, b in (loaded or ()))
        live.tokens = tokens[:target]
        for nd in path:
            if nd.end <= target:
                self.trie.touch(nd)
        if not self.defer_budget:
            self._enforce()
        return live, plan

    # -- recording ------------------------------------------------------------------------
    def checkpoint(self, live: LiveSet, tokens: Sequence[int]) -> bool:
        """Record ``live`` (which holds exactly ``tokens``) at a prefill stop.

        False when nothing was recorded: the budget had no room for the snapshot, or the
        cache was cleared since the request started.
        """
        seq = as_tokens(tokens)
        return self.run(lambda: live.epoch == self._epoch
                        and self._record(live, seq) is not None)

    def _record(self, live: Optional[LiveSet], seq, keep: bool = True) -> Optional[TrieNode]:
        """Record the live state (which holds exactly ``seq``) as a trie node end.

        Splits an edge where the point falls inside one, adds a child for tokens the trie
        lacks, and fills in the snapshots of layers that have none at that node. ``seq``
        is an array (`tokens.as_tokens`): nothing here walks it token by token. With
        ``defer_budget`` nothing is evicted or skipped here, and ``live`` may be None: the
        node is made (the same structure as on the ranks that have states) without state.
        """
        o = len(seq)
        if o == 0:
            return None
        if live is not None:
            if not live.consistent(o):
                raise RuntimeError(f"caches are not all at offset {o}: {[c.offset for c in live.leaves]}")
            live.tokens = seq
        path, m = self.trie.find(seq)
        if not self.defer_budget:
            if live is None or not self._make_room(self._need(live, path, m, o)):
                return None
            if path and path[-1].detached:
                # Eviction removed the node the match ended in, or merged it into its
                # child. (Merges above it keep it valid: a merge keeps the deeper node,
                # and m stays inside or at the end of its edge.)
                path, m = self.trie.find(seq)
        node = path[-1] if path else self.trie.root
        if path and node.end > m:
            node = self.trie.split(node, m)  # the point (or the divergence) is inside the edge
        if m == o:
            missing = [] if live is None else [i for i in range(len(live.leaves))
                                               if not node.has_state(i)]
            if missing:
                snaps = list(node.snapshots)
                for i in missing:
                    snaps[i] = live.leaves[i].snapshot(node.start)
                self.trie.set_snapshots(node, snaps)
        else:
            snaps = ([None] * self.trie.num_layers if live is None
                     else [c.snapshot(m) for c in live.leaves])
            parent = node
            node = self.trie.add_child(parent, seq[m:], snaps)
            q = self.kv_quant
            if (parent is not self.trie.root and len(parent.children) == 1
                    and parent not in self.keep and len(parent.tokens) < self.merge_below
                    # merging would quantize unquantized rows that targets <= start need
                    and (q is None or not parent.end <= q.start < node.end)):
                node = self.trie.merge_with_child(parent)
        self.trie.touch(node)
        if keep and (self.whole_state or (self.kv_quant is not None and o == self.kv_quant.start)):
            self.keep.add(node)  # the last unquantized rows stay a node end of their own
        return node

    def checkin(self, live: LiveSet, tokens: Sequence[int], pending: Sequence[int] = (),
                on_done: Optional[Callable[[bool], None]] = None) -> None:
        """End a request whose caches absorbed ``tokens``: record them, free ``live`` (or,
        with ``keep_live``, keep it as the idle set), enforce the budget, then call
        ``on_done(recorded)`` (inside the critical section).

        ``pending`` are tokens of a forward pass that an interruption may or may not have
        let every layer absorb. A live state that cannot be made consistent (a recurrent
        layer half-way through a write) is dropped; the snapshots already taken stay.
        Safe from a generator's ``finally``, on any thread, also during garbage collection.
        """
        seq, pend = as_tokens(tokens), as_tokens(pending)
        if self._busy_here():
            # A generator finalised by the garbage collector can run while this very thread
            # is inside a critical section; re-entering would corrupt it (or deadlock), so
            # the work waits for the next section. The live set stays counted meanwhile.
            self._deferred.append(lambda: self._checkin(live, seq, pend, on_done))
            return
        self.run(self._checkin, live, seq, pend, on_done)

    def _checkin(self, live, seq, pending, on_done) -> None:
        self._lent.discard(live)
        usable = live.epoch == self._epoch
        if usable:
            if len(pending) and live.consistent(len(seq) + len(pending)):
                seq = join(seq, pending)
            elif not live.consistent(len(seq)):
                for c in live.leaves:  # KV layers (and unwrapped windows) that ran ahead rewind
                    if c.offset != len(seq):
                        c.restore(None, len(seq))
            usable = len(seq) > 0 and live.consistent(len(seq))
            if not usable and len(seq):
                log.info("discarding an interrupted live state at %s", [c.offset for c in live.leaves])
        recorded = usable and self._record(live, seq) is not None
        if usable and self.keep_live:  # the next turn of this conversation continues from it
            self._keep_idle(live)
        else:
            live.reset()
        self._enforce()
        if on_done is not None:
            on_done(recorded)

    def record(self, caches: Optional[List[Any]], tokens: Sequence[int],
               label: Optional[str] = None) -> Optional[TrieNode]:
        """Record a cache list computed elsewhere (it holds exactly ``tokens``; it is read,
        never kept or written), then enforce the budget. None when nothing was recorded.
        ``label`` tags the node (`PrefixTrie.label_stats` counts per label). With
        ``defer_budget`` the budget waits for `settle`, and ``caches`` None records the
        node without state."""
        return self._record_list(caches, tokens, label, keep=False)

    def adopt(self, caches: List[Any], tokens: Sequence[int],
              label: Optional[str] = None) -> Optional[TrieNode]:
        """Record a request's own cache list, holding exactly ``tokens``, as `record` does,
        then keep it as the idle live set: the next `checkout` whose prompt starts alike
        continues from it in place — the rows it shares with that prompt are neither
        restored nor copied — until the budget needs its bytes (the idle set goes first).
        The caller gives the caches up: nothing else may write them. None (and nothing
        kept) when nothing was recorded."""
        return self._record_list(caches, tokens, label, keep=True)

    def _record_list(self, caches: Optional[List[Any]], tokens: Sequence[int],
                     label: Optional[str], keep: bool) -> Optional[TrieNode]:
        tokens = as_tokens(tokens)

        def section() -> Optional[TrieNode]:
            live = None if caches is None else LiveSet(caches, self._epoch, quant=self.kv_quant)
            node = self._record(live, tokens)
            if node is not None and label is not None:
                self.trie.set_label(node, label)
            if keep and node is not None:
                self._keep_idle(live)
            if not self.defer_budget:
                self._enforce()
            return node
        return self.run(section)

    def forget(self, live: LiveSet) -> None:
        """Stop counting a lent live set whose caches were handed to someone else."""
        self.run(self._lent.discard, live)

    # -- retention: what goes first under the budget ---------------------------------------------
    def age(self, tokens: Sequence[int], first: int) -> None:
        """Make the nodes that hold only ``tokens[first:]`` (as far as the trie holds them)
        the least recently used, so the budget evicts them before anything a request
        touched; the first request that reads them touches them like any other. A node
        that also holds tokens before ``first`` is cut there first, so only the part from
        ``first`` on goes first."""
        self.run(self._age, as_tokens(tokens), int(first))

    def age_tail(self, tokens: Sequence[int]) -> None:
        """`age` what ``tokens`` alone hold: every node on their path past the last one
        another prompt branches off from (the shared prefix stays as it was), and what grew
        under it (the answer)."""
        def tail() -> None:
            path, _ = self.trie.find(as_tokens(tokens))
            if not path:
                return
            shared = max((n.end for n in path[:-1] if len(n.children) > 1), default=0)
            for node in path:
                if node.end <= shared:
                    continue
                if node.start < shared:
                    self.trie.split(node, shared)  # (``node`` keeps the part past it)
                node.last_used = 0
            below = list(path[-1].children.values())
            while below:
                node = below.pop()
                node.last_used = 0
                below.extend(node.children.values())
        self.run(tail)

    def _age(self, tokens: Sequence[int], first: int) -> None:
        path, matched = self.trie.find(tokens)
        for node in reversed(path):
            if node.end > matched or node.end <= first:
                break
            if node.start < first:
                self.trie.split(node, first)  # only the part from ``first`` on goes first
            node.last_used = 0
            if node.start <= first:
                break

    # -- the disk tier ------------------------------------------------------------------------
    def attach_disk(self, verify: Callable[[Sequence[int]], Any]) -> None:
        """A disk store now keeps this trie's nodes: ``verify`` (its ``before_request``)
        runs in every `checkout` before anything is restored. Every node is written once,
        when recorded, so plain nodes are no longer merged into their new child (a merge
        would write both again; a chain of nodes costs nothing on disk)."""
        def attach() -> None:
            self.verify = verify
            self.merge_below = 0
        self._section(attach)

    # -- the byte budget ----------------------------------------------------------------------
    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the trie's snapshots."""
        return self.trie.nbytes

    @property
    def live_bytes(self) -> int:
        """Bytes of every live set, lent to a request or idle (but those a working copy
        shares with the trie: `LiveSet.shared`)."""
        sets = set(self._lent)
        if self._idle is not None:
            sets.add(self._idle)
        return sum(s.counted_bytes for s in sets)

    @property
    def free_bytes(self) -> int:
        """What the budget has room for now, without evicting anything."""
        return max(0, self.max_bytes - self.nbytes)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle live set (0 when there is none)."""
        idle = self._idle
        return 0 if idle is None else idle.nbytes

    @property
    def held_bytes(self) -> int:
        """What stays held between requests: the snapshots and the idle live set (the sets
        lent to running requests are theirs)."""
        return self.trie.nbytes + self.idle_bytes

    @property
    def nbytes(self) -> int:
        """Everything the manager holds: snapshots and live caches."""
        return self.snapshot_bytes + self.live_bytes

    def _evict(self, target: int) -> None:
        target = max(target, 0)
        if self.agree.size == 1:
            freed = self.trie.evict(target)
        elif self.trie.tier is not None:
            # Parking is agreed node by node ("still over" then needs every rank too).
            freed = 0
            while any_rank(self.agree, self.trie.nbytes > target):
                step = evict_one(self.trie, self._demote())
                if not every(self.agree, step is not None):
                    break
                freed += step
        else:
            # Ranks hold different bytes (pipeline shards are uneven): evict until every
            # rank fits, agreed in one collective (see the module doc).
            steps, freed = self._evict_steps(target)
            freed += self._evict_steps(None, self.agree.all_max([steps])[0] - steps)[1]
        self._evicted(freed)

    def _demote(self) -> Optional[Callable[[TrieNode], bool]]:
        """Whether an eviction step parks its node (a disk tier holds its copy)."""
        tier = self.trie.tier
        if tier is None:
            return None
        if self.agree.size == 1:
            return tier.demotable
        # Whether a file is on disk is rank-local (each rank writes its own shard when
        # it gets to it): park only where every rank can, so the tries stay alike.
        return lambda node: every(self.agree, tier.demotable(node))

    def _evict_steps(self, target: Optional[int], limit: Optional[int] = None) -> Tuple[int, int]:
        """Eviction steps here until the snapshots fit ``target`` (None: no target), at
        most ``limit`` steps or until nothing is evictable: ``(steps, bytes freed)``."""
        steps = freed = 0
        while (target is None or self.trie.nbytes > target) and (limit is None or steps < limit):
            step = evict_one(self.trie)  # no tier here (see `_evict`)
            if step is None:  # at the same step on every rank: the tries have one shape
                break
            steps += 1
            freed += step
        return steps, freed

    def _evicted(self, freed: int) -> None:
        if freed:
            self.evicted_bytes += freed

    def fit_bytes(self, target: int) -> None:
        """Evict (or park) least recently used snapshots until they hold at most
        ``target`` bytes; agreed between ranks."""
        self._section(self._evict, int(target))

    def fit_count(self, n: int) -> None:
        """Evict (or park) least recently used nodes until at most ``n`` hold memory."""
        self._section(self._evict_to_count, int(n))

    def _evict_to_count(self, n: int) -> None:
        """Evict, one least-recently-used node at a time, until at most ``n`` nodes hold
        memory (parked nodes hold none; O(log n) per node evicted). The counts are the
        same on every rank: no agreement beyond a tier's parking."""
        demote = self._demote()
        while self.trie.node_count - self.trie.parked_count > max(n, 0):
            step = evict_one(self.trie, demote)
            if step is None:
                break
            self.evicted_bytes += step

    def enforce_budget(self) -> None:
        """Fit ``max_bytes``: drop the idle live set first (the trie holds its tokens too),
        then evict least recently used snapshots. Lent live sets cannot be dropped."""
        self._section(self._enforce)

    def _enforce(self) -> None:
        if not any_rank(self.agree, self.nbytes > self.max_bytes):
            return
        self._drop_idle()
        self._evict(self.max_bytes - self.live_bytes)

    def _make_room(self, need: int) -> bool:
        """Evict so ``need`` more bytes fit; False when they cannot (on some rank)."""
        budget = self.max_bytes - self.live_bytes
        if self.trie.nbytes + need > budget and self._idle is not None:
            self._drop_idle()
            budget = self.max_bytes - self.live_bytes
        if self.agree.size == 1 or self.trie.tier is not None:
            if any_rank(self.agree, self.trie.nbytes + need > budget):
                self._evict(budget - need)
            return every(self.agree, self.trie.nbytes + need <= budget)
        # One collective: the most steps any rank needed, and whether some rank cannot
        # fit even with nothing evictable left (then it cannot after more steps either).
        steps, freed = self._evict_steps(budget - need)
        most, short = self.agree.all_max([steps, int(self.trie.nbytes + need > budget)])
        freed += self._evict_steps(None, most - steps)[1]
        self._evicted(freed)
        return not short

    def over_budget(self, limit: Optional[int] = None) -> bool:
        """Whether this rank holds more than the budget (or its snapshots more than
        ``limit``): read-only, no agreement (see `settle`)."""
        return self.nbytes > self.max_bytes or (limit is not None and self.trie.nbytes > limit)

    def settle(self, limit: Optional[int] = None) -> None:
        """Fit the budget — and ``limit``, this rank's own ceiling for the snapshots —
        now, agreed with the other ranks in one collective (with ``defer_budget``, the
        caller's once-a-turn enforcement; every rank must call it at the same point)."""
        def fit() -> None:
            if limit is not None and self.held_bytes > limit:
                self._drop_idle()  # the trie holds its tokens too: it goes first
            target = self.max_bytes - self.live_bytes
            self._evict(target if limit is None else min(target, limit))
        self._section(fit)

    def _need(self, live: LiveSet, path: List[TrieNode], m: int, o: int) -> int:
        """Bytes the snapshots of a record at ``o`` (trie match ``m``) will add."""
        if m < o:
            return sum(c.snapshot_nbytes(m) for c in live.leaves)
        node = path[-1]  # holds ``o`` inside or at the end of its edge
        need = 0
        for i, c in enumerate(live.leaves):
            kv = getattr(c, "delta_snapshots", False)
            if not node.has_state(i):
                need += c.snapshot_nbytes(node.start if kv else 0)
            elif node.end != o and not kv:  # the split's upper half needs a whole state
                need += c.snapshot_nbytes(0)
        return need

    # -- reset --------------------------------------------------------------------------------
    def reset_live(self) -> None:
        """Forget the idle live state (the trie keeps every snapshot)."""
        self.run(self._drop_idle)

    def _keep_idle(self, live: LiveSet) -> None:
        """``live`` becomes the idle set (the one it replaces is freed)."""
        if self._idle is not None and self._idle is not live:
            self._idle.reset()
        self._idle = live

    def _drop_idle(self) -> None:
        if self._idle is not None:
            self._idle.reset()
            self._idle = None

    def clear(self) -> None:
        """Drop every snapshot and the idle live state. Requests running now finish
        correctly on their own live sets, but record nothing."""
        self.run(self._clear)

    def _clear(self) -> None:
        self.trie.clear()
        self.keep.clear()
        self._drop_idle()
        self._epoch += 1
