"""Tests for the prefix trie (layer 2), with fake layer ops and fake snapshots.

The fake KV snapshot stores the token ids of ``[from, to)`` and the fake whole-state
snapshot stores every token up to its end, so split and merge are checked by content.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlx_kvcache.caches.snapshot import Snapshot
from mlx_kvcache.prefix.trie import PrefixTrie, TrieNode


# -- fakes -----------------------------------------------------------------------------
class FakeKV(Snapshot):
    """Delta snapshot: the token ids of ``[from_offset, to_offset)``."""

    kind = "fake_kv"
    needs_base = True

    def __init__(self, reg: list, start: int, tokens: List[int]):
        super().__init__(start, start + len(tokens), {"tok": np.asarray(tokens, dtype=np.int64)})
        reg.append(self)

    @property
    def content(self) -> List[int]:
        return self._get("tok").tolist()


class FakeState(Snapshot):
    """Whole-state snapshot: every token up to ``to_offset``."""

    kind = "fake_state"
    needs_base = False

    def __init__(self, reg: list, prefix: List[int]):
        super().__init__(0, len(prefix), {"h": np.asarray(prefix, dtype=np.int64)})
        reg.append(self)

    @property
    def content(self) -> List[int]:
        return self._get("h").tolist()


class KVOps:
    def __init__(self, reg: list):
        self.reg = reg

    def split(self, s, at):
        if at <= s.from_offset:
            return None, s
        if at >= s.to_offset:
            return s, None
        toks, k = s.content, at - s.from_offset
        head, tail = FakeKV(self.reg, s.from_offset, toks[:k]), FakeKV(self.reg, at, toks[k:])
        s.close()
        return head, tail

    def merge(self, parent, child):
        if parent is None or child is None:
            raise ValueError("KV merge needs both halves")
        assert parent.to_offset == child.from_offset, (parent, child)
        out = FakeKV(self.reg, parent.from_offset, parent.content + child.content)
        parent.close()
        child.close()
        return out


class StateOps:
    def __init__(self, reg: list):
        self.reg = reg

    def split(self, s, at):
        return None, s

    def merge(self, parent, child):
        if parent is not None:
            parent.close()
        return child


KINDS = ("kv", "state", "kv")


class Env:
    """A trie over fake layers plus a record of every snapshot ever made."""

    def __init__(self, kinds=KINDS):
        self.reg: list = []
        self.kinds = kinds
        self.trie = PrefixTrie([KVOps(self.reg) if k == "kv" else StateOps(self.reg) for k in kinds])

    def snaps(self, seq: List[int], start: int, end: int, drop_state: bool = False):
        out: List[Optional[Snapshot]] = []
        for k in self.kinds:
            if k == "kv":
                out.append(FakeKV(self.reg, start, seq[start:end]))
            else:
                out.append(None if drop_state else FakeState(self.reg, seq[:end]))
        return out

    def insert(self, seq, drop_state: bool = False) -> TrieNode:
        """What the manager does for a new sequence: split at the divergence, add a child."""
        t = self.trie
        path, m = t.find(seq)
        parent = t.root
        if path:
            parent = path[-1]
            if m < parent.end:
                parent = t.split(parent, m)
        if m == len(seq):
            return parent
        return t.add_child(parent, seq[m:], self.snaps(list(seq), m, len(seq), drop_state))

    def check(self) -> None:
        """Invariants, content of every snapshot, and no leaked or double-held snapshot."""
        t = self.trie
        t.check_invariants()
        held = set()
        for node in t.nodes():
            prefix = t.tokens_to(node)
            for i, s in enumerate(node.snapshots):
                if s is None:
                    continue
                assert id(s) not in held
                held.add(id(s))
                if self.kinds[i] == "kv":
                    assert s.content == node.tokens, (node, s.content)
                else:
                    assert s.content == prefix, (node, s.content)
            if all(n.has_state(0) for n in t.path_to(node)):
                kv = [x for n in t.path_to(node) for x in n.snapshots[0].content]
                assert kv == prefix
        live = {id(s) for s in self.reg if not s.closed}
        assert live == held, "a snapshot leaked (unclosed but not held) or a held one is closed"
        assert t.nbytes == sum(n.nbytes for n in t.nodes())


def leaf_seqs(env: Env):
    return sorted(tuple(env.trie.tokens_to(n)) for n in env.trie.nodes() if not n.children)


# -- find ------------------------------------------------------------------------------
def test_find_empty_trie_and_empty_query():
    env = Env()
    assert env.trie.find([1, 2, 3]) == ([], 0)
    env.insert([1, 2, 3])
    assert env.trie.find([]) == ([], 0)
    assert env.trie.find([9]) == ([], 0)


def test_find_branches_partial_and_inside_edge():
    env = Env()
    a = env.insert([10, 11, 12, 13, 14])
    path, m = env.trie.find([10, 11, 12, 13, 14, 15])
    assert path == [a] and m == 5
    # partial match: the node is included and matched ends inside its edge
    path, m = env.trie.find([10, 11, 99])
    assert path == [a] and m == 2 and a.start < m < a.end
    # query shorter than the edge
    path, m = env.trie.find(np.array([10, 11, 12]))
    assert path == [a] and m == 3
    b = env.insert([10, 11, 12, 99])
    upper = b.parent
    assert upper.tokens == [10, 11, 12] and set(upper.children.values()) == {a, b}
    # the full edge of the upper node matches, then the walk continues into the right branch
    path, m = env.trie.find([10, 11, 12, 99, 7])
    assert path == [upper, b] and m == 4
    path, m = env.trie.find([10, 11, 12, 13, 0])
    assert path == [upper, a] and m == 4
    path, m = env.trie.find([10, 11, 12, 50])
    assert path == [upper] and m == 3
    env.check()


def test_find_accepts_mx_arrays():
    import mlx.core as mx

    env = Env()
    a = env.insert([1, 2, 3])
    assert env.trie.find(mx.array([1, 2, 3, 4])) == ([a], 3)


# -- add_child -------------------------------------------------------------------------
def test_add_child_errors_take_nothing():
    env = Env()
    t = env.trie
    seq = [1, 2, 3]
    a = env.insert(seq)
    with pytest.raises(ValueError):
        t.add_child(t.root, [], [None] * 3)
    snaps = env.snaps([1, 5], 0, 2)
    with pytest.raises(ValueError):
        t.add_child(t.root, [1, 5], snaps)  # sibling shares first token 1
    with pytest.raises(ValueError):
        t.add_child(t.root, [2, 5], snaps[:2])  # wrong count
    with pytest.raises(ValueError):
        t.add_child(a, [7], env.snaps([1, 2, 3, 7], 0, 4))  # KV spans [0,4) not [3,4)
    assert not any(s.closed for s in snaps)
    for s in env.reg:
        if not any(s is x for n in t.nodes() for x in n.snapshots):
            s.close()
    env.check()
    c = t.add_child(a, [7], env.snaps([1, 2, 3, 7], 3, 4))
    assert (c.start, c.end, c.parent) == (3, 4, a)
    env.check()


# -- split -----------------------------------------------------------------------------
@pytest.mark.parametrize("at", range(3, 10))
def test_split_every_interior_point(at):
    env = Env()
    t = env.trie
    base = env.insert([1, 2])
    seq = [1, 2, 10, 11, 12, 13, 14, 15, 16, 17]
    node = env.insert(seq)
    assert node.parent is base and (node.start, node.end) == (2, 10)
    kid = env.insert(seq + [5, 6])
    t.touch(node)
    before, used = t.nbytes, node.last_used
    upper = t.split(node, at)
    env.check()
    assert t.nbytes == before  # fake KV split preserves bytes; state head dropped -> none
    assert upper.parent is base and base.children[10] is upper
    assert node.parent is upper and list(upper.children.values()) == [node]
    assert (upper.start, upper.end, node.start, node.end) == (2, at, at, 10)
    assert upper.tokens == seq[2:at] and node.tokens == seq[at:]
    assert upper.last_used == used and upper.in_use == 0
    assert upper.snapshots[0].content == seq[2:at] and node.snapshots[0].content == seq[at:]
    assert upper.snapshots[1] is None and node.snapshots[1].content == seq
    assert kid.parent is node
    assert t.find(seq[:at]) == ([base, upper], at)


def test_split_rejects_bad_points():
    env = Env()
    t = env.trie
    node = env.insert([1, 2, 3, 4])
    for at in (-1, 0, 4, 5):
        with pytest.raises(ValueError):
            t.split(node, at)
    with pytest.raises(ValueError):
        t.split(t.root, 0)
    env.check()


def test_split_of_split_and_branching():
    env = Env()
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 2, 7], [1, 8], [1, 2, 3, 4, 5, 0]]
    nodes = [env.insert(s) for s in seqs]
    env.check()
    for s, n in zip(seqs, nodes):
        path, m = env.trie.find(s)
        assert m == len(s) and path[-1] is n and path[-1].end == len(s)


# -- merge -----------------------------------------------------------------------------
def test_merge_with_child_keeps_child_object():
    env = Env()
    t = env.trie
    a = env.insert([1, 2, 3])
    b = t.add_child(a, [4, 5], env.snaps([1, 2, 3, 4, 5], 3, 5))
    g1 = env.insert([1, 2, 3, 4, 5, 6])
    g2 = env.insert([1, 2, 3, 4, 5, 7])
    a.last_used, b.last_used = 50, 7
    t._clock = 60
    a.in_use, b.in_use = 1, 0
    a_state = a.snapshots[1]
    out = t.merge_with_child(a)
    env.check()
    assert out is b and a.detached and a.parent is None
    assert t.root.children[1] is b and b.parent is t.root
    assert (b.tokens, b.start, b.end) == ([1, 2, 3, 4, 5], 0, 5)
    assert b.snapshots[0].content == [1, 2, 3, 4, 5]
    assert b.snapshots[1].content == [1, 2, 3, 4, 5] and a_state.closed
    assert b.last_used == 50 and b.in_use == 1
    assert g1.parent is b and g2.parent is b


def test_merge_errors():
    env = Env()
    t = env.trie
    a = env.insert([1, 2])
    with pytest.raises(ValueError):
        t.merge_with_child(a)  # leaf
    env.insert([1, 2, 3])
    env.insert([1, 2, 4])
    with pytest.raises(ValueError):
        t.merge_with_child(a)  # two children
    with pytest.raises(ValueError):
        t.merge_with_child(t.root)
    env.check()


def test_merge_with_missing_halves():
    env = Env()
    t = env.trie
    a = env.insert([1, 2], drop_state=True)  # state layer None on the parent
    b = t.add_child(a, [3], env.snaps([1, 2, 3], 2, 3))
    taken = t.take_snapshots(a)
    taken[2].close()  # the parent loses its layer-2 KV
    t.set_snapshots(a, [taken[0], None, None])
    out = t.merge_with_child(a)
    env.check()
    assert out is b
    assert b.snapshots[0].content == [1, 2, 3]
    assert b.snapshots[1].content == [1, 2, 3]  # whole state at the child's end survives
    assert b.snapshots[2] is None  # a KV half is missing: nothing valid spans [0,3)


def test_split_then_merge_round_trip():
    env = Env()
    t = env.trie
    seq = list(range(20, 30))
    node = env.insert(seq)
    bytes_before = t.nbytes
    upper = t.split(node, 4)
    out = t.merge_with_child(upper)
    env.check()
    assert out is node and node.tokens == seq and node.snapshots[0].content == seq
    assert t.nbytes == bytes_before


# -- remove / snapshots / clear -------------------------------------------------------
def test_remove():
    env = Env()
    t = env.trie
    a = env.insert([1, 2])
    b = env.insert([1, 2, 3])
    with pytest.raises(ValueError):
        t.remove(t.root)
    with pytest.raises(ValueError):
        t.remove(a)
    b.in_use = 1
    with pytest.raises(ValueError):
        t.remove(b)
    b.in_use = 0
    held = [s for s in b.snapshots if s is not None]
    t.remove(b)
    assert b.detached and all(s.closed for s in held) and not a.children
    env.check()
    t.remove(a)
    assert t.nbytes == 0 and not t.root.children
    env.check()
    with pytest.raises(ValueError):
        t.remove(a)


def test_set_and_take_snapshots_accounting():
    env = Env()
    t = env.trie
    seq = [1, 2, 3]
    a = env.insert(seq)
    old = list(a.snapshots)
    fresh = env.snaps(seq, 0, 3)
    t.set_snapshots(a, [old[0], fresh[1], None])  # reuse layer 0, replace 1, drop 2
    assert not old[0].closed and old[1].closed and old[2].closed
    fresh[0].close()
    fresh[2].close()
    env.check()
    taken = t.take_snapshots(a)
    assert t.nbytes == 0 and not any(s.closed for s in taken if s is not None)
    t.set_snapshots(a, taken)
    env.check()
    with pytest.raises(ValueError):
        t.set_snapshots(a, [FakeKV(env.reg, 1, [2, 3]), None, None])  # wrong span
    env.reg[-1].close()
    with pytest.raises(ValueError):
        t.set_snapshots(t.root, [None] * 3)
    env.check()


def test_clear_and_dump():
    env = Env()
    t = env.trie
    env.insert([1, 2, 3])
    env.insert([1, 2, 4])
    b = env.insert([5])
    b.in_use = 1
    text = t.dump()
    assert len(text.splitlines()) == 1 + len(list(t.nodes()))
    assert "[0,2) 2t" in text and "in_use=1" in text and "KSK" in text
    t.clear()
    assert t.nbytes == 0 and not list(t.nodes()) and all(s.closed for s in env.reg)
    env.check()


def test_check_invariants_catches_corruption():
    env = Env()
    t = env.trie
    a = env.insert([1, 2, 3])
    b = env.insert([1, 2, 3, 4])
    t.check_invariants()

    def broken(mutate, undo, match):
        mutate()
        with pytest.raises(AssertionError, match=match):
            t.check_invariants()
        undo()
        t.check_invariants()

    broken(lambda: setattr(b, "parent", t.root), lambda: setattr(b, "parent", a), "parent pointer")
    broken(lambda: setattr(b, "end", 5), lambda: setattr(b, "end", 4), "starts at")
    broken(lambda: a.children.update({9: a.children.pop(4)}),
           lambda: a.children.update({4: a.children.pop(9)}), "keyed under")
    broken(lambda: setattr(t, "_nbytes", t.nbytes + 1), lambda: setattr(t, "_nbytes", t.nbytes - 1),
           "nbytes counter")
    snaps = list(b.snapshots)
    broken(lambda: setattr(b, "snapshots", snaps[:2]), lambda: setattr(b, "snapshots", snaps),
           "snapshots for 3 layers")
    broken(lambda: setattr(b, "snapshots", [a.snapshots[0]] + snaps[1:]),
           lambda: setattr(b, "snapshots", snaps), "does not span")
    broken(lambda: setattr(b, "snapshots", [snaps[0], a.snapshots[1], snaps[2]]),
           lambda: setattr(b, "snapshots", snaps), "does not end")
    b.snapshots[0].close()
    with pytest.raises(AssertionError, match="closed"):
        t.check_invariants()


# -- eviction --------------------------------------------------------------------------
def test_evict_lru_order():
    env = Env()
    t = env.trie
    a, b, c = env.insert([1, 1, 1]), env.insert([2, 2, 2]), env.insert([3, 3, 3])
    for n in (c, a, b):
        t.touch(n)
    size = a.nbytes
    assert t.evict(t.nbytes) == 0
    freed = t.evict(t.nbytes - 1)
    assert freed == size and c.detached and not a.detached and not b.detached
    freed = t.evict(t.nbytes - 1)
    assert a.detached and not b.detached
    env.check()


def test_evict_ties_deeper_then_bigger():
    env = Env()
    t = env.trie
    shallow, deep = env.insert([1, 2]), env.insert([3, 4, 5, 6])
    small, big = env.insert([7]), env.insert([8, 8, 8])
    for n in (shallow, deep):
        n.last_used = 1
    small.last_used = big.last_used = 2
    t.evict(t.nbytes - 1)
    assert deep.detached and not shallow.detached
    t.evict(t.nbytes - 1)
    assert shallow.detached
    # same clock, big ends deeper too; make the ends equal by comparing same-depth leaves
    env2 = Env()
    s1, s2 = env2.insert([1, 2, 3]), env2.insert([4, 5, 6], drop_state=True)
    s1.last_used = s2.last_used = 1
    assert s1.end == s2.end and s1.nbytes > s2.nbytes
    env2.trie.evict(env2.trie.nbytes - 1)
    assert s1.detached and not s2.detached
    env.check()
    env2.check()


def test_evict_shared_prefix_survives():
    env = Env()
    t = env.trie
    sys_prompt = [9] * 6
    x = env.insert(sys_prompt + [1, 1])
    y = env.insert(sys_prompt + [2, 2])
    shared = x.parent
    assert shared is y.parent and shared.tokens == sys_prompt
    shared.last_used = 0  # oldest of all, but a branch point
    t.touch(x)
    t.touch(y)
    t.evict(t.nbytes - 1)  # one leaf goes (x, the older), the branch point does not
    assert x.detached and not shared.detached
    env.check()


def test_evict_skips_pinned_and_merges_chain_into_it():
    env = Env()
    t = env.trie
    seq = list(range(1, 13))
    for k in (3, 6, 9):
        env.insert(seq[:k])
    tip = env.insert(seq)
    other = env.insert([50, 51])
    t.touch(other)
    tip.in_use = 1
    t.evict(0)
    env.check()
    # everything unpinned was merged into the pinned tip or removed; its content survives
    assert other.detached and not tip.detached
    assert list(t.nodes()) == [tip]
    assert tip.tokens == seq and tip.snapshots[0].content == seq
    assert tip.snapshots[1].content == seq
    assert t.nbytes == tip.nbytes > 0  # no candidate left: ends over budget


def test_evict_to_zero_frees_everything():
    env = Env()
    t = env.trie
    for s in ([1, 2, 3], [1, 2, 4], [1, 5], [6], [6, 7, 8]):
        env.insert(s)
    total = t.nbytes
    assert t.evict(0) == total
    assert t.nbytes == 0 and not list(t.nodes())
    assert all(s.closed for s in env.reg)
    env.check()


def test_evict_many_nodes_is_fast():
    env = Env(kinds=("kv",))
    t = env.trie
    rng = np.random.default_rng(0)
    for _ in range(1500):
        env.insert(rng.integers(0, 4, size=int(rng.integers(1, 24))).tolist())
    t.check_invariants()
    budget = t.nbytes // 3
    t.evict(budget)
    assert t.nbytes <= budget  # nothing pinned, so the budget is always reachable
    t.check_invariants()
    t.evict(0)
    assert t.nbytes == 0


# -- random sequences ------------------------------------------------------------------
token_seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class TrieMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.env = Env()
        self.t = self.env.trie

    def _pick(self, data, pred):
        cands = sorted((n for n in self.t.nodes() if pred(n)), key=lambda n: (n.end, n.tokens))
        if not cands:
            return None
        return data.draw(st.sampled_from(cands))

    @rule(seq=token_seqs, drop=st.booleans())
    def insert(self, seq, drop):
        node = self.env.insert(seq, drop_state=drop)
        self.t.touch(node)
        path, m = self.t.find(seq)
        assert m == len(seq) and path[-1] is node and node.end == len(seq)
        assert self.t.tokens_to(node) == seq

    @rule(data=st.data())
    def split(self, data):
        node = self._pick(data, lambda n: len(n.tokens) >= 2)
        if node is None:
            return
        at = data.draw(st.integers(node.start + 1, node.end - 1))
        before = leaf_seqs(self.env)
        full = self.t.tokens_to(node)
        upper = self.t.split(node, at)
        assert self.t.tokens_to(upper) == full[:at] and self.t.tokens_to(node) == full
        assert leaf_seqs(self.env) == before

    @rule(data=st.data())
    def merge(self, data):
        node = self._pick(data, lambda n: len(n.children) == 1)
        if node is None:
            return
        (child,) = node.children.values()
        before = leaf_seqs(self.env)
        full = self.t.tokens_to(child)
        assert self.t.merge_with_child(node) is child
        assert node.detached and self.t.tokens_to(child) == full
        assert leaf_seqs(self.env) == before

    @rule(data=st.data())
    def remove(self, data):
        leaf = self._pick(data, lambda n: not n.children and not n.in_use)
        if leaf is None:
            return
        before = leaf_seqs(self.env)
        gone = tuple(self.t.tokens_to(leaf))
        self.t.remove(leaf)
        after = leaf_seqs(self.env)
        assert gone not in after and len(after) <= len(before)

    @rule(data=st.data())
    def pin(self, data):
        node = self._pick(data, lambda n: True)
        if node is not None:
            node.in_use += 1

    @rule(data=st.data())
    def unpin(self, data):
        node = self._pick(data, lambda n: n.in_use > 0)
        if node is not None:
            node.in_use -= 1

    @rule(data=st.data())
    def touch(self, data):
        node = self._pick(data, lambda n: True)
        if node is not None:
            self.t.touch(node)

    @rule(data=st.data())
    def replace_snapshots(self, data):
        node = self._pick(data, lambda n: True)
        if node is None:
            return
        for s in self.t.take_snapshots(node):
            if s is not None:
                s.close()
        drop = data.draw(st.booleans())
        full = self.t.tokens_to(node)
        self.t.set_snapshots(node, self.env.snaps(full, node.start, node.end, drop))

    @rule(data=st.data())
    def evict(self, data):
        t = self.t
        budget = data.draw(st.integers(0, t.nbytes))
        pinned = {id(n): (n, t.tokens_to(n)) for n in t.nodes() if n.in_use}
        before = t.nbytes
        freed = t.evict(budget)
        assert freed == before - t.nbytes >= 0
        if t.nbytes > budget:
            assert not any(n.in_use == 0 and len(n.children) <= 1 for n in t.nodes())
        for n, toks in pinned.values():
            assert not n.detached and t.tokens_to(n) == toks

    @invariant()
    def consistent(self):
        self.env.check()

    def teardown(self):
        self.t.clear()
        assert all(s.closed for s in self.env.reg)


TrieMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_trie_machine = TrieMachine.TestCase
