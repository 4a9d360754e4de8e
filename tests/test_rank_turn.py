"""The sharded server's protocol in one process (issue 19): a request agrees once, at its
fetch; its checkpoint and final inserts issue no collective; what they leave rank-local
(bytes over the budget, a cache list one rank could not store) is settled once per turn
of the generation loop. Two "ranks" whose layers and bytes differ (as pipeline shards
can), each with its own manager, deciding through an agreement over threads that counts
every collective by phase. Every restored offset, every stop, every stored and evicted
node must come out the same, with the counts the protocol promises."""

from __future__ import annotations

import random
import threading
from collections import Counter

import mlx.core as mx
import pytest

import mlx_kvcache as mk
from mlx_kvcache.prefix import planner
from mlx_kvcache.prefix.agreement import any_rank
from mlx_kvcache.prefix.manager import PrefixManager
from mlx_kvcache.serving.cache.rank_turn import RankTurn
from models import V, build
from test_agreement import ThreadGroup, shape


class Counted:
    """A `ThreadGroup` member that counts its collectives under ``phase``."""

    def __init__(self, member):
        self._m = member
        self.rank, self.size = member.rank, member.size
        self.phase = "setup"
        self.counts = Counter()

    def all_min(self, values):
        self.counts[self.phase] += 1
        return self._m.all_min(values)

    def all_max(self, values):
        self.counts[self.phase] += 1
        return self._m.all_max(values)

    def all_gather(self, data):
        self.counts[self.phase] += 1
        return self._m.all_gather(data)


def serve(model, agree, script, out, budget, stateless=()):
    """What a sharded server's generation thread does with the prompt cache, per request:
    cuts (no collective), fetch (checkout), a prefill piece per cut with an insert at
    each, the final insert, then the turn's collective and its settle. ``stateless``:
    (rank, insert number) whose cache list this rank cannot store (e.g. a padded row)."""
    mgr = PrefixManager(lambda: mk.make_prompt_cache(model), max_bytes=budget,
                        pre_end_margin=2, snapshot_interval=8)
    mgr.agree = agree
    mgr.whole_state = any_rank(agree, mgr.whole_state)
    mgr.defer_budget = True
    turn = RankTurn()
    log, held, seq = [], [], 0
    for prompt in script:
        agree.phase = "plan"
        cuts = mgr.cuts(prompt)
        agree.phase = "fetch"
        live, plan = mgr.checkout(prompt)
        mgr.forget(live)  # the server owns the caches from here on
        caches, pos = live.caches, plan.restored
        agree.phase = "insert"
        stops = [c for c in cuts if c > pos]
        for stop in stops + [len(prompt)]:
            model(mx.array(prompt[pos:stop])[None], cache=caches)
            mk.settle(caches, stop - pos)
            pos = stop
            seq += 1
            mine = None if (agree.rank, seq) in stateless else caches
            made = RankTurn.makes_node(mgr, prompt[:stop])
            turn.inserted(mgr.record(mine, prompt[:stop]), made, mine is None)
        agree.phase = "turn"
        agreed = agree.all_max([0, *turn.flags(mgr)])[1:]
        turn.settle(mgr, agree, agreed)
        held.append(mgr.trie.nbytes)
        log.append((plan.restored, stops, plan.stops, shape(mgr.trie)))
    out[agree.rank] = (log, mgr.evicted_bytes, held, agree.counts, mgr)


def script_of(seed, n=10):
    rng = random.Random(seed)
    base = [rng.randrange(V) for _ in range(30)]
    script = []
    for _ in range(n):
        p = list(rng.choice(script)) if script and rng.random() < 0.5 else list(base)
        cut = rng.randrange(1, len(p))
        script.append(p[:cut] + [rng.randrange(V) for _ in range(rng.randrange(3, 20))])
    return script


def play(seed, budget, stateless=()):
    models = [build("llama"), build("qwen3_next" if seed == 2 else "gemma3_text")]
    script = script_of(seed)
    group = ThreadGroup(2)
    out = {}
    threads = [threading.Thread(target=serve, args=(models[r], Counted(group.member(r)), script,
                                                    out, budget, stateless))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return script, out[0], out[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_checkpoints_cost_no_collective_and_ranks_stay_alike(seed):
    """A budget small enough to evict on both ranks, from different bytes."""
    budget = 60_000
    script, (log0, ev0, held0, c0, _), (log1, ev1, held1, c1, _) = play(seed, budget)
    assert log0 == log1  # restored offsets, stops, trie shape and LRU stamps, per request
    assert ev0 > 0 and ev1 > 0 and held0 != held1  # both evicted, from different bytes
    assert max(held0) <= budget and max(held1) <= budget  # the budget holds at every turn
    n = len(script)
    assert sum(len(x[1]) for x in log0) > n  # checkpoints were taken (more than one a request)
    for c in (c0, c1):
        assert c["insert"] == 0 and c["plan"] == 0  # no collective at a checkpoint or a cut
        assert c["fetch"] == 2 * n  # one to agree where to restore, one that it worked
        evicting = c["turn"] - n  # one collective a turn, one more when some rank is over
        assert 0 < evicting <= n
    assert c0 == c1
    # The plan each request restored to matched what it agreed at fetch, and every stop
    # left after the restore was one of the structural cuts (nothing was missed).
    for restored, stops, planned, _ in log0:
        assert set(planned) <= set(stops)


def test_a_rank_that_cannot_store_an_insert_leaves_no_node_behind():
    """Rank 1's cache lists of some inserts cannot be stored (a padded recurrent row, say):
    it still makes the nodes, without state; at the turn every rank drops the states of
    what those inserts made and removes the leaves among them, so both tries stay alike
    and hold nothing only one rank could store (a node a later insert of the same turn
    hangs below stays, without state on any rank)."""
    budget = 10 ** 9  # no eviction: only the repair changes the tries
    script, (log0, _, _, c0, m0), (log1, _, _, c1, m1) = play(1, budget, stateless={(1, 3), (1, 7)})
    assert log0 == log1
    assert c0["turn"] > len(script)  # the repair's gather ran
    bare = []
    for mgr in (m0, m1):
        for node in mgr.trie.nodes():
            if not any(s is not None for s in node.snapshots):
                assert node.children, node  # no leaf without state
                bare.append((node.start, node.end))
    assert bare[: len(bare) // 2] == bare[len(bare) // 2:]  # the same nodes on both ranks
    # Both ranks dropped what rank 1 alone could not store (rank 0 had stored it).
    _, (_, _, _, _, n0), (_, _, _, _, n1) = play(1, budget)
    assert m0.trie.nbytes < n0.trie.nbytes and m1.trie.nbytes < n1.trie.nbytes


def _gather_agreed(lists, oks):
    group = ThreadGroup(len(lists))
    members = [Counted(group.member(r)) for r in range(len(lists))]
    out = [None] * len(lists)

    def go(r):
        out[r] = planner._agreed(members[r], lists[r], oks[r])
    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out, [sum(m.counts.values()) for m in members]


def test_restore_agreement_is_one_reduction():
    ordered = [40, 32, 24, 16, 8, 0]
    out, n = _gather_agreed([ordered, ordered], [[0, 1, 1, 0, 1, 1], [1, 0, 1, 1, 1, 1]])
    assert out == [[0, 0, 1, 0, 1, 1]] * 2 and n == [1, 1]


def test_restore_agreement_with_many_candidates():
    ordered = list(range(300, -1, -1))
    a = [int(t % 7 == 0) for t in ordered]
    b = [int(t % 3 == 0) for t in ordered]
    out, n = _gather_agreed([ordered, ordered], [a, b])
    assert out[0] == out[1] == [x & y for x, y in zip(a, b)]
    assert n[0] == n[1] == -(-len(ordered) // planner._AGREE_BITS)


@pytest.mark.parametrize("other", [[40, 24, 0], [40, 32, 24, 8, 0], list(range(100, -1, -1))])
def test_ranks_whose_candidates_differ_fall_back_to_zero_together(other):
    mine = [40, 32, 24, 0]
    out, n = _gather_agreed([mine, other], [[1] * len(mine), [1] * len(other)])
    assert out[0] == [0, 0, 0, 1] and out[1] == [int(t == 0) for t in other]
    assert n == [1, 1]  # the same collectives on both: nobody waits forever
