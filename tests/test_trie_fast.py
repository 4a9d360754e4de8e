"""The trie's fast paths against slow references: array edges vs a list model of lookup,
the ordered eviction candidates vs the scan they replaced (same victims, same order), and
the running counters vs a recount — on random tries (hypothesis)."""

from __future__ import annotations

import heapq
from typing import List

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_kvcache.prefix import eviction
from mlx_kvcache.prefix.eviction import evictable
from mlx_kvcache.prefix.tokens import TokenBuffer, Tokens, as_tokens, common_prefix
from test_trie import Env

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

# Small alphabets make shared prefixes and branch points; lengths cross several edges.
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=40)
FORMS = ("list", "tuple", "int64", "int32", "mx", "tokens", "writable")


def form(seq: List[int], how: str):
    """``seq`` as one of the shapes callers hand the trie."""
    if how == "list":
        return list(seq)
    if how == "tuple":
        return tuple(seq)
    if how == "int64":
        return as_tokens(seq)
    if how == "int32":
        return np.asarray(seq, dtype=np.int32)
    if how == "mx":
        return mx.array(seq)
    if how == "tokens":
        return Tokens(seq)
    return np.array(seq, dtype=np.int64)  # a caller's writable array


# -- lookup on array edges vs a list model ---------------------------------------------------
def ref_match(stored: List[List[int]], q: List[int]) -> int:
    best = 0
    for s in stored:
        i = 0
        while i < min(len(s), len(q)) and s[i] == q[i]:
            i += 1
        best = max(best, i)
    return best


@SETTINGS
@given(inserts=st.lists(st.tuples(seqs, st.sampled_from(FORMS)), min_size=1, max_size=12),
       queries=st.lists(st.tuples(seqs, st.sampled_from(FORMS)), min_size=1, max_size=8),
       budget=st.floats(0, 1))
def test_find_on_array_edges_matches_a_list_model(inserts, queries, budget):
    env = Env()
    t = env.trie
    for seq, how in inserts:
        raw = form(seq, how)
        env.insert(raw)
        if how == "writable":
            raw[:] = 9  # the caller changes its array afterwards: the trie kept its own copy
    env.check()
    t.evict(int(t.nbytes * budget))  # eviction reshapes edges (merges) and drops leaves
    env.check()
    stored = [t.tokens_to(n) for n in t.nodes() if not n.children]
    for q, how in queries:
        path, m = t.find(form(q, how))
        assert m == ref_match(stored, q)
        node = t.root
        for p in path:  # the path is a chain from the root, and only its last edge is partial
            assert p.parent is node
            node = p
        if path:
            assert path[-1].start < m <= path[-1].end
            assert all(p.end <= m for p in path[:-1])
            assert t.tokens_to(path[-1])[:m] == q[:m]
        else:
            assert m == 0
    for n in t.nodes():
        assert isinstance(n.tokens, Tokens) and not n.tokens.array.flags.writeable
        assert list(n.tokens) == n.tokens.tolist() and all(type(x) is int for x in n.tokens)


def test_long_edges_match_at_any_position():
    env = Env(kinds=("kv",))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, size=5000).tolist()
    env.insert(base)
    for cut in (0, 1, 7, 2048, 4999):
        q = base[:cut] + [base[cut] + 1] + [5, 6]
        path, m = env.trie.find(q)
        assert m == cut
    assert env.trie.find(base + [1])[1] == 5000
    assert env.trie.find(np.asarray(base[:3000]))[1] == 3000


# -- the ordered eviction vs the scan it replaced --------------------------------------------
def old_evict(trie, max_bytes, victims):
    """`eviction.evict` before the ordered candidates: a heap of every node per call."""
    key = lambda n: (n.last_used, -n.end, -n.nbytes)  # noqa: E731
    heap, seq = [], 0

    def push(n):
        nonlocal seq
        if evictable(trie, n):
            heapq.heappush(heap, (key(n), seq, n))
            seq += 1
    for n in trie.nodes():
        push(n)
    while heap and trie.nbytes > max_bytes:
        k, _, n = heapq.heappop(heap)
        if not evictable(trie, n) or k != key(n):
            continue
        victims.append(tuple(trie.tokens_to(n)))
        parent = n.parent
        if n.children:
            push(trie.merge_with_child(n))
        else:
            trie.remove(n)
            push(parent)


def old_evict_one(trie, victims):
    """`eviction.evict_one` before the ordered candidates: a scan of every node per step."""
    inv = lambda n: (n.last_used, -n.end, -len(n.tokens), n.tokens[0])  # noqa: E731
    victim = min((n for n in trie.nodes() if evictable(trie, n)), key=inv, default=None)
    if victim is None:
        return None
    victims.append(tuple(trie.tokens_to(victim)))
    if victim.children:
        trie.merge_with_child(victim)
    else:
        trie.remove(victim)
    return True


_split = st.tuples(st.just("split"), st.integers(0, 99), st.floats(0, 1))
# Splits weigh more: they make the nodes that share a use time (upper and lower half),
# where the order's tie-breaks decide.
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), seqs, st.booleans()),
    st.tuples(st.just("touch"), st.integers(0, 99)),
    _split, _split, _split,
    st.tuples(st.just("pin"), st.integers(0, 99)),
    st.tuples(st.just("unpin"), st.integers(0, 99)),
    st.tuples(st.just("restate"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("label"), st.integers(0, 99), st.sampled_from([None, "user", "system"])),
), min_size=1, max_size=40)


def build(ops) -> Env:
    """A trie made by ``ops`` (the same trie every time for the same ops)."""
    env = Env()
    t = env.trie
    for op in ops:
        nodes = sorted(t.nodes(), key=lambda n: (n.end, n.tokens.tolist()))
        pick = nodes[op[1] % len(nodes)] if nodes and op[0] != "insert" else None
        if op[0] == "insert":
            t.touch(env.insert(op[1], drop_state=op[2]))
        elif pick is None:
            continue
        elif op[0] == "touch":
            t.touch(pick)
        elif op[0] == "split" and len(pick.tokens) >= 2:
            t.split(pick, pick.start + 1 + int(op[2] * (len(pick.tokens) - 2)))
        elif op[0] == "pin":
            pick.in_use += 1
        elif op[0] == "unpin" and pick.in_use:
            pick.in_use -= 1
        elif op[0] == "restate":
            for s in t.take_snapshots(pick):
                if s is not None:
                    s.close()
            t.set_snapshots(pick, env.snaps(t.tokens_to(pick), pick.start, pick.end, op[2]))
        elif op[0] == "label":
            t.set_label(pick, op[2])
    return env


@pytest.fixture
def recorded(monkeypatch):
    victims: list = []
    real = eviction._step

    def step(trie, victim, *rest):
        victims.append(tuple(trie.tokens_to(victim)))
        return real(trie, victim, *rest)
    monkeypatch.setattr(eviction, "_step", step)
    return victims


@settings(SETTINGS, max_examples=200)
@given(ops=OPS, budget=st.floats(0, 1))
def test_evict_chooses_the_victims_of_the_old_scan(recorded, ops, budget):
    recorded.clear()
    new, old = build(ops), build(ops)
    target = int(new.trie.nbytes * budget)
    expect: list = []
    old_evict(old.trie, target, expect)
    new.trie.evict(target)
    assert recorded == expect
    assert new.trie.dump() == old.trie.dump()
    new.check()


@settings(SETTINGS, max_examples=200)
@given(ops=OPS, keep=st.integers(0, 3))
def test_evict_one_chooses_the_victims_of_the_old_scan(recorded, ops, keep):
    """Step by step (as the ranks of a sharded model evict), down to ``keep`` nodes."""
    recorded.clear()
    new, old = build(ops), build(ops)
    expect: list = []
    while new.trie.node_count > keep:
        got = eviction.evict_one(new.trie)
        want = old_evict_one(old.trie, expect)
        assert (got is None) == (want is None)
        if got is None:
            break
        assert recorded == expect
        new.check()
    assert new.trie.dump() == old.trie.dump()


def test_ties_in_use_time_break_the_same_way_every_time():
    """Hand-set equal ``last_used`` (a loader can do that): the order still ends in a
    total, replayable one (deeper first, then creation order) — the same on every rank."""
    def make():
        env = Env(kinds=("kv",))
        nodes = [env.insert([i, i + 10, i + 20]) for i in range(5)]
        for n in nodes:
            n.last_used = 1
        return env, nodes
    a, an = make()
    b, bn = make()
    order_a, order_b = [], []
    for env, order, nodes in ((a, order_a, an), (b, order_b, bn)):
        while env.trie.node_count:
            before = {id(n): i for i, n in enumerate(nodes) if not n.detached}
            eviction.evict_one(env.trie)
            order.append(next(i for i, n in enumerate(nodes) if n.detached and id(n) in before))
    assert order_a == order_b == [0, 1, 2, 3, 4]  # creation order among equals


def test_candidates_stay_few_and_drop_with_their_nodes():
    """Stale entries are bounded by the live nodes; a dropped node is not kept alive."""
    import gc
    import weakref

    env = Env(kinds=("kv",))
    t = env.trie
    nodes = [env.insert([i % 50, i]) for i in range(200)]
    for _ in range(20):
        for n in nodes:
            if not n.detached:
                t.touch(n)
    assert len(t.candidates._lru) <= 2 * t.node_count + 64
    ref = weakref.ref(nodes[0])
    t.remove(nodes[0])
    del nodes
    gc.collect()
    assert ref() is None
    env.check()


# -- counters --------------------------------------------------------------------------------
@SETTINGS
@given(ops=OPS, budget=st.floats(0, 1))
def test_counters_equal_a_recount(ops, budget):
    env = build(ops)
    t = env.trie

    def recount():
        by = {}
        for n in t.nodes():
            row = by.setdefault(n.label, [0, 0])
            row[0] += 1
            row[1] += n.nbytes
        return {k: tuple(v) for k, v in by.items()}
    assert t.node_count == len(list(t.nodes()))
    assert t.label_stats() == recount()
    t.evict(int(t.nbytes * budget))
    assert t.node_count == len(list(t.nodes()))
    assert t.label_stats() == recount()
    env.check()  # check_invariants recounts them too
    t.clear()
    assert t.node_count == 0 and t.label_stats() == {} and t.nbytes == 0


def test_check_invariants_catches_broken_counters():
    env = Env()
    t = env.trie
    a = env.insert([1, 2, 3])
    env.insert([1, 2, 4])
    t.set_label(a, "user")
    t.check_invariants()
    t._count += 1
    with pytest.raises(AssertionError, match="node counter"):
        t.check_invariants()
    t._count -= 1
    t._labels["user"][1] += 1
    with pytest.raises(AssertionError, match="label counters"):
        t.check_invariants()
    t._labels["user"][1] -= 1
    t.candidates.clear()
    with pytest.raises(AssertionError, match="eviction candidate missing"):
        t.check_invariants()
    t.candidates.rebuild()
    t.check_invariants()


# -- the token types ---------------------------------------------------------------------------
def test_tokens_read_like_a_tuple_of_ints():
    t = Tokens([5, 6, 7])
    assert t == [5, 6, 7] and [5, 6, 7] == t and t == (5, 6, 7) and t != [5, 6]
    assert t[0] == 5 and type(t[0]) is int and t[1:] == [6, 7] and isinstance(t[1:], Tokens)
    assert list(t) == [5, 6, 7] and len(t) == 3 and bool(t) and not Tokens()
    assert t + [8] == [5, 6, 7, 8] and [4] + t == [4, 5, 6, 7]
    assert np.asarray(t) is t.array and not t.array.flags.writeable
    assert sorted([Tokens([2]), Tokens([1, 5])]) == [[1, 5], [2]]
    with pytest.raises(TypeError):
        hash(t)


def test_as_tokens_copies_what_a_caller_may_change():
    mine = as_tokens([1, 2, 3])
    assert as_tokens(mine) is mine  # ours: read-only int64, shared
    theirs = np.array([1, 2, 3])
    got = as_tokens(theirs)
    theirs[0] = 9
    assert got.tolist() == [1, 2, 3] and not got.flags.writeable
    assert common_prefix([1, 2, 3], np.array([1, 2, 4])) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_token_buffer_views_never_change():
    b = TokenBuffer([1, 2])
    first = b.array
    for i in range(300):  # grows its buffer several times
        b.append(i)
    b.extend(np.arange(5))
    assert first.tolist() == [1, 2] and len(b) == 307 and b[0] == 1 and b[-1] == 4
    before = b.array
    del b[2:]
    b.extend([7, 7, 7])
    assert before[2:5].tolist() == [0, 1, 2]  # a truncation never rewrites a view handed out
    assert b.tolist() == [1, 2, 7, 7, 7] and not b.array.flags.writeable
    with pytest.raises(TypeError):
        del b[1]
