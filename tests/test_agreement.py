"""Rank coherence in one process: two "ranks" whose layers differ (one only attention,
one with recurrent and sliding-window layers, as pipeline shards can) and whose bytes
differ, each with its own manager, deciding through an agreement over threads. Every
restored offset, every stored node and every eviction must come out the same."""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest

import mlx_kvcache as mk
from mlx_kvcache.prefix.agreement import SOLO, any_rank, every
from mlx_kvcache.prefix.manager import PrefixManager
from models import V, build


class ThreadGroup:
    """Collectives between threads of one process (a stand-in for ``mx.distributed``)."""

    def __init__(self, n: int):
        self.size = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots = [None] * n

    def member(self, rank: int):
        group = self

        class Member:
            def __init__(self):
                self.rank, self.size = rank, group.size

            def _exchange(self, value):
                group.slots[rank] = value
                group.barrier.wait()
                values = list(group.slots)
                group.barrier.wait()
                return values

            def all_min(self, values):
                return [min(v) for v in zip(*self._exchange(list(values)))]

            def all_max(self, values):
                return [max(v) for v in zip(*self._exchange(list(values)))]

            def all_gather(self, data):
                return self._exchange(bytes(data))
        return Member()


def shape(trie):
    return sorted((n.start, n.end, n.last_used) for n in trie.nodes())


def run_rank(model, agree, script, out, budget, agreed=True):
    mgr = PrefixManager(lambda: mk.make_prompt_cache(model), max_bytes=budget,
                        pre_end_margin=2, snapshot_interval=8)
    if agreed:
        mgr.agree = agree
        mgr.whole_state = any_rank(agree, mgr.whole_state)
    log = []
    for prompt in script:
        live, plan = mgr.checkout(prompt)
        caches = live.caches
        pos = plan.restored
        for stop in plan.stops + [len(prompt)]:
            if stop <= pos:
                continue
            model(mx.array(prompt[pos:stop])[None], cache=caches)
            mk.settle(caches, stop - pos)
            pos = stop
            if stop < len(prompt):
                mgr.checkpoint(live, prompt[:stop])
        mgr.checkin(live, prompt)
        log.append((plan.restored, plan.stops, shape(mgr.trie)))
    out[agree.rank] = (log, mgr.evicted_bytes, mgr.trie.nbytes)


def play(seed, agreed=True):
    models = [build("llama"), build("qwen3_next" if seed == 2 else "gemma3_text")]
    rng = random.Random(seed)
    base = [rng.randrange(V) for _ in range(30)]
    script = []
    for _ in range(10):
        p = list(rng.choice(script)) if script and rng.random() < 0.5 else list(base)
        cut = rng.randrange(1, len(p))
        script.append(p[:cut] + [rng.randrange(V) for _ in range(rng.randrange(3, 20))])
    group = ThreadGroup(2)
    out = {}
    threads = [threading.Thread(target=run_rank, args=(models[r], group.member(r), script, out,
                                                       60_000, agreed))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return out[0], out[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_with_different_layers_decide_alike(seed):
    """llama (attention only) beside gemma3_text (sliding windows) or qwen3_next (recurrent)."""
    (log0, ev0, held0), (log1, ev1, held1) = play(seed)
    assert [x[0] for x in log0] == [x[0] for x in log1]  # restored offsets
    assert [x[1] for x in log0] == [x[1] for x in log1]  # prefill stops
    assert [x[2] for x in log0] == [x[2] for x in log1]  # trie shape and LRU stamps
    assert ev0 > 0 and ev1 > 0 and held0 != held1  # both evicted, from different bytes
    assert held0 <= 60_000 and held1 <= 60_000


def test_without_agreement_they_would_not():
    """The control: deciding alone, the same two ranks restore or evict differently."""
    (log0, _, _), (log1, _, _) = play(0, agreed=False)
    assert [x[0] for x in log0] != [x[0] for x in log1] or \
        [x[2] for x in log0] != [x[2] for x in log1]


def test_solo_agreement_is_the_identity():
    assert SOLO.all_min([3, 1]) == [3, 1] and SOLO.all_gather(b"x") == [b"x"]
    assert every(SOLO, True) and not any_rank(SOLO, False)
