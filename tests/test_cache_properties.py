"""Property-based tests: random operation sequences on each cache class against a reference.

Every token written carries its absolute position and a unique write tag in its key and
value vectors, so the tests can read back exactly which tokens (and which *versions* of
them, after a restore onto another branch) a cache or a snapshot holds.

* `KVCache` is checked against a plain list of tags, one per position ``[0, offset)``.
* `RotatingKVCache` is checked against mlx-lm's own ``RotatingKVCache`` run in lock-step,
  rebuilt from scratch (replaying the token history the restored state stands for) after
  every restore, and against a closed-form description of the window.
* `RecurrentCache` is checked against a token history from which the slot arrays are
  recomputed (slot 0: the last three tokens, slot 1: float32 running sums).

Every restore must either match the reference or be refused (False, nothing changed) exactly
where the design's reachability table says; snapshots must never change after they are
taken; merge/split must close the inputs they consume and only those.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlc

import mlx_kvcache as K
from mlx_kvcache import CacheError

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)

_tags = itertools.count(1)

DK, DV = 2, 3


def make_tokens(pos: int, n: int, heads: int, tag: int) -> Tuple[mx.array, mx.array]:
    """Keys ``[1, H, n, 2]`` = (position, tag*10 + head); values ``[1, H, n, 3]`` = (position,
    -tag, head)."""
    p = np.arange(pos, pos + n, dtype=np.float32)
    k = np.zeros((1, heads, n, DK), np.float32)
    v = np.zeros((1, heads, n, DV), np.float32)
    for h in range(heads):
        k[0, h, :, 0] = p
        k[0, h, :, 1] = tag * 10 + h
        v[0, h, :, 0] = p
        v[0, h, :, 1] = -tag
        v[0, h, :, 2] = h
    return mx.array(k), mx.array(v)


def decode(k: mx.array, v: mx.array) -> List[Tuple[int, int]]:
    """The (position, tag) pairs held by keys/values, checking heads and values agree."""
    k, v = np.array(k), np.array(v)
    assert k.shape[0] == 1 and v.shape[:3] == k.shape[:3]
    out = []
    for i in range(k.shape[2]):
        p, t = int(k[0, 0, i, 0]), int(k[0, 0, i, 1]) // 10
        for h in range(k.shape[1]):
            assert k[0, h, i, 0] == p and k[0, h, i, 1] == t * 10 + h, (i, h, k[0, h, i])
            assert v[0, h, i, 0] == p and v[0, h, i, 1] == -t and v[0, h, i, 2] == h, (i, h, v[0, h, i])
        out.append((p, t))
    return out


def np_tree(x):
    if x is None:
        return None
    if isinstance(x, mx.array):
        return np.array(x).copy()
    if isinstance(x, (list, tuple)):
        return [np_tree(y) for y in x]
    return x


def same_tree(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def snap_arrays(s: K.Snapshot):
    arrays, meta = s.to_arrays()
    return {k: np.array(v).copy() for k, v in arrays.items()}, dict(meta)


class SnapPool:
    """Open snapshots with the frozen copy of their contents taken at creation."""

    def __init__(self):
        self.items: list = []  # [snapshot, frozen arrays, frozen meta, payload]
        self.closed: list = []

    def add(self, s, payload):
        arrays, meta = snap_arrays(s)
        self.items.append([s, arrays, meta, payload])

    def check(self):
        for s, arrays, meta, _ in self.items:
            assert not s.closed
            now, now_meta = snap_arrays(s)
            assert now_meta == meta
            assert now.keys() == arrays.keys()
            for name in arrays:
                assert np.array_equal(now[name], arrays[name]), f"snapshot {s!r} changed ({name})"
            assert s.nbytes == sum(a.nbytes for a in arrays.values())
        for s in self.closed:
            assert s.closed and s.nbytes == 0

    def drop(self, s):
        self.items = [it for it in self.items if it[0] is not s]
        if not any(c is s for c in self.closed):
            self.closed.append(s)

    def find(self, s):
        for it in self.items:
            if it[0] is s:
                return it
        raise AssertionError(f"{s!r} not in the pool")


def whole_state_merge_or_split(c, op, pool, data):
    """Whole-state kinds: merge keeps the child (closing the parent), split cannot cut."""
    if op == "merge":
        p = data.draw(st.sampled_from(pool.items), label="parent")[0]
        q = data.draw(st.sampled_from(pool.items), label="child")[0]
        m = c.merge(p, q)
        assert m is q and not q.closed
        if p is not q:
            assert p.closed
            pool.drop(p)
    else:
        s = data.draw(st.sampled_from(pool.items), label="snap")[0]
        at = data.draw(st.integers(0, s.to_offset + 1), label="at")
        assert c.split(s, at) == (None, s) and not s.closed


def check_closed_refused(cache, s, state_of):
    """A closed snapshot is refused with CacheError and changes nothing."""
    before = state_of(cache)
    with pytest.raises(CacheError, match="closed"):
        cache.restore(s, s.to_offset)
    assert same_tree(state_of(cache), before)


# ============================================================================ KVCache


def kv_state(c: K.KVCache):
    if c.keys is None:
        return [c.offset, None]
    k, v = c.keys_and_values()
    return [c.offset, np_tree(k), np_tree(v)]


def kv_check_live(c: K.KVCache, ref: List[int]):
    assert c.offset == len(ref)
    if c.keys is None:
        assert ref == []
        return
    k, v = c.keys_and_values()
    assert decode(k, v) == list(enumerate(ref))


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_kvcache_random_ops(data):
    heads = data.draw(st.sampled_from([1, 2]), label="heads")
    c = K.KVCache()
    ref: List[int] = []  # tag of each position [0, offset)
    pool = SnapPool()
    n_ops = data.draw(st.integers(1, 30), label="n_ops")
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(
            ["update", "update", "decode", "snapshot", "snapshot", "rewind", "restore", "restore",
             "merge", "split", "free", "close"]), label="op")
        if op in ("update", "decode"):
            n = 1 if op == "decode" else data.draw(st.integers(1, 6), label="L")
            tag = next(_tags)
            k, v = make_tokens(c.offset, n, heads, tag)
            ok, ov = c.update(k, v)
            ref.extend([tag] * n)
            assert decode(ok, ov) == list(enumerate(ref))
        elif op == "snapshot":
            a = data.draw(st.integers(0, c.offset), label="from")
            s = c.snapshot(a)
            if a == c.offset:
                assert s is None
            else:
                assert isinstance(s, K.KVSnapshot)
                assert (s.from_offset, s.to_offset) == (a, c.offset)
                assert decode(s.keys, s.values) == [(p, ref[p]) for p in range(a, c.offset)]
                assert s.nbytes == heads * (c.offset - a) * (DK + DV) * 4
                pool.add(s, ref[a:])
        elif op == "rewind":
            t = data.draw(st.integers(0, c.offset + 2), label="t")
            before = kv_state(c)
            got = c.restore(None, t)
            assert got == (t <= len(ref))
            if got:
                del ref[t:]
            else:
                assert same_tree(kv_state(c), before)
        elif op == "restore" and pool.items:
            s, _, _, tags = data.draw(st.sampled_from(pool.items), label="snap")
            t = data.draw(st.integers(0, s.to_offset + 2), label="t")
            before = kv_state(c)
            got = c.restore(s, t)
            expect = t <= s.to_offset and len(ref) >= s.from_offset
            assert got == expect, (got, expect, len(ref), s, t)
            if got:
                ref[:] = (ref[: s.from_offset] + list(tags))[:t]
            else:
                assert same_tree(kv_state(c), before)
        elif op == "merge" and len(pool.items) >= 2:
            adjacent = [(p, q) for p in pool.items for q in pool.items
                        if p[0] is not q[0] and p[0].to_offset == q[0].from_offset]
            if adjacent and data.draw(st.booleans(), label="adjacent"):
                p, q = data.draw(st.sampled_from(adjacent), label="pair")
            else:
                p, q = data.draw(st.permutations(pool.items), label="pair")[:2]
            sp, sq = p[0], q[0]
            if sp.to_offset == sq.from_offset:
                m = c.merge(sp, sq)
                assert sp.closed and sq.closed and not m.closed
                assert (m.from_offset, m.to_offset) == (sp.from_offset, sq.to_offset)
                tags = list(p[3]) + list(q[3])
                assert decode(m.keys, m.values) == [
                    (m.from_offset + i, t) for i, t in enumerate(tags)]
                assert m.nbytes == heads * (m.to_offset - m.from_offset) * (DK + DV) * 4
                pool.drop(sp)
                pool.drop(sq)
                pool.add(m, tags)
            else:
                with pytest.raises(CacheError, match="non-adjacent"):
                    c.merge(sp, sq)
                assert not sp.closed and not sq.closed
        elif op == "split" and pool.items:
            s, _, _, tags = data.draw(st.sampled_from(pool.items), label="snap")
            a, b = s.from_offset, s.to_offset
            at = data.draw(st.integers(max(0, a - 1), b + 1), label="at")
            head, tail = c.split(s, at)
            if at <= a:
                assert head is None and tail is s and not s.closed
            elif at >= b:
                assert tail is None and head is s and not s.closed
            else:
                assert s.closed
                assert (head.from_offset, head.to_offset, tail.from_offset, tail.to_offset) == (a, at, at, b)
                assert decode(head.keys, head.values) == [(a + i, t) for i, t in enumerate(tags[: at - a])]
                assert decode(tail.keys, tail.values) == [(at + i, t) for i, t in enumerate(tags[at - a:])]
                assert head.nbytes + tail.nbytes == heads * (b - a) * (DK + DV) * 4
                pool.drop(s)
                pool.add(head, tags[: at - a])
                pool.add(tail, tags[at - a:])
        elif op == "free":
            c.free()
            ref = []
        elif op == "close" and pool.items:
            s = data.draw(st.sampled_from(pool.items), label="snap")[0]
            s.close()
            s.close()  # idempotent
            pool.drop(s)
            check_closed_refused(c, s, kv_state)
        kv_check_live(c, ref)
        pool.check()
    # Final probe: the cache continues correctly from wherever it is.
    tag = next(_tags)
    k, v = make_tokens(c.offset, 2, heads, tag)
    ok, ov = c.update(k, v)
    assert decode(ok, ov) == list(enumerate(ref + [tag, tag]))
    pool.check()


# ============================================================================ RotatingKVCache


def truncate(hist: list, t: int) -> list:
    """The chunk history cut to its first ``t`` tokens."""
    out, n = [], 0
    for k, v in hist:
        L = k.shape[2]
        if n + L <= t:
            out.append((k, v))
            n += L
        else:
            if t > n:
                out.append((k[..., : t - n, :], v[..., : t - n, :]))
            break
    return out


def replay(hist: list, max_size: int, keep: int) -> mlc.RotatingKVCache:
    ref = mlc.RotatingKVCache(max_size, keep=keep)
    for k, v in hist:
        # mlx-lm's class keeps (and may later write into) the arrays of a first chunk:
        # give it its own wrappers so the history stays intact.
        ref.update_and_fetch(mx.array(k), mx.array(v))
    return ref


def expected_window(o: int, L: int, max_size: int, keep: int) -> List[int]:
    """Positions returned by an update of ``L`` tokens at offset ``o`` (mlx-lm semantics)."""
    if L > 1:
        old = list(range(o)) if o <= max_size - 1 else (
            list(range(keep)) + list(range(o - (max_size - 1 - keep), o)))
        return old + list(range(o, o + L))
    if o < max_size:
        return list(range(o + 1))
    return list(range(keep)) + list(range(o + 1 - (max_size - keep), o + 1))


def rot_state(c: K.RotatingKVCache):
    return np_tree(list(c.state))


def same_mask(a, b) -> bool:
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return (isinstance(a, mx.array) and isinstance(b, mx.array)
                and a.shape == b.shape and bool(mx.all(a == b).item()))
    return a == b


def rot_probe(c: K.RotatingKVCache, oracle_hist: list, heads: int):
    """Non-destructive check: a copy of the cache continues like mlx-lm's replayed cache."""
    for L in (1, 3):
        probe = K.RotatingKVCache.from_state(
            tuple(mx.array(x) if isinstance(x, mx.array) else x for x in c.state))
        oracle = replay(oracle_hist, c.max_size, c.keep)
        assert probe.offset == oracle.offset
        k, v = make_tokens(c.offset, L, heads, next(_tags))
        a = decode(*probe.update(k, v))
        b = decode(*oracle.update_and_fetch(k, v))
        if c.offset == 0 and oracle_hist == []:
            assert a == b
        assert sorted(a) == sorted(b)


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_rotating_random_ops(data):
    heads = data.draw(st.sampled_from([1, 2]), label="heads")
    max_size = data.draw(st.integers(4, 9), label="max_size")
    keep = data.draw(st.sampled_from([0, 1, 2]), label="keep")
    c = K.RotatingKVCache(max_size, keep=keep)
    hist: list = []  # (keys, values) chunks the current state stands for
    oracle = replay(hist, max_size, keep)
    pool = SnapPool()
    n_ops = data.draw(st.integers(1, 30), label="n_ops")
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(
            ["update", "update", "decode", "decode", "snapshot", "snapshot", "rewind", "restore",
             "restore", "merge", "split", "free", "close"]), label="op")
        offset = c.offset
        if op in ("update", "decode"):
            n = 1 if op == "decode" else data.draw(st.integers(2, 6), label="L")
            for N in sorted({n, 1, 3}):
                assert same_mask(c.make_mask(N), oracle.make_mask(N)), (N, c, oracle.offset)
                w = max(2, max_size - 2)
                if N > 1:
                    assert same_mask(c.make_mask(N, window_size=w), oracle.make_mask(N, window_size=w))
            k, v = make_tokens(offset, n, heads, next(_tags))
            mine = decode(*c.update(k, v))
            theirs = decode(*oracle.update_and_fetch(mx.array(k), mx.array(v)))
            hist.append((k, v))
            if n > 1:
                # Multi-token writes return the window in temporal order (the causal mask needs it).
                assert mine == theirs
                assert [p for p, _ in mine] == sorted(p for p, _ in mine)
            else:
                assert sorted(mine) == sorted(theirs)
            assert sorted(p for p, _ in mine) == expected_window(offset, n, max_size, keep)
            assert c.offset == oracle.offset == offset + n
            # the tag of every returned position is the one the history gave it
            tags = {}
            for hk, _ in hist:
                a = np.array(hk)
                for p, t in zip(a[0, 0, :, 0], a[0, 0, :, 1]):
                    tags[int(p)] = int(t) // 10
            assert all(tags[p] == t for p, t in mine)
        elif op == "snapshot":
            a = data.draw(st.integers(0, offset), label="from")
            s = c.snapshot(a)
            if a == offset:
                assert s is None
            else:
                assert isinstance(s, K.RotatingSnapshot)
                assert (s.from_offset, s.to_offset) == (a, offset)
                assert s.wrapped == (offset > max_size)
                assert (s.max_size, s.keep) == (max_size, keep)
                # The snapshot holds no padding: at most the window's rows.
                assert s.keys.shape[2] <= max(max_size, min(offset, max_size))
                held = sorted(decode(s.keys, s.values))
                if not s.wrapped:
                    assert [p for p, _ in held] == list(range(offset))
                pool.add(s, list(hist))
        elif op == "rewind":
            t = data.draw(st.one_of(st.just(offset), st.integers(0, offset + 2)), label="t")
            before = rot_state(c)
            got = c.restore(None, t)
            expect = t == offset or (t < offset and offset <= max_size)
            assert got == expect, (t, offset, max_size)
            if got:
                if t != offset:
                    hist = truncate(hist, t)
                    oracle = replay(hist, max_size, keep)
            else:
                assert same_tree(rot_state(c), before)
        elif op == "restore" and pool.items:
            s, _, _, shist = data.draw(st.sampled_from(pool.items), label="snap")
            t = data.draw(st.one_of(st.just(s.to_offset), st.integers(0, s.to_offset + 2)), label="t")
            before = rot_state(c)
            got = c.restore(s, t)
            expect = t == s.to_offset or (t < s.to_offset and s.to_offset <= max_size)
            assert got == expect, (t, s)
            if got:
                assert c.offset == t
                hist = truncate(shist, t)
                oracle = replay(hist, max_size, keep)
                rot_probe(c, hist, heads)
            else:
                assert same_tree(rot_state(c), before)
        elif op in ("merge", "split") and pool.items:
            whole_state_merge_or_split(c, op, pool, data)
        elif op == "free":
            c.free()
            assert c.offset == 0
            hist = []
            oracle = replay(hist, max_size, keep)
        elif op == "close" and pool.items:
            s = data.draw(st.sampled_from(pool.items), label="snap")[0]
            s.close()
            pool.drop(s)
            check_closed_refused(c, s, rot_state)
        assert c.offset == oracle.offset == sum(k.shape[2] for k, _ in hist)
        # update() never writes into the caller's arrays: every chunk fed so far still
        # holds consecutive positions under a single tag.
        pos = 0
        for hk, hv in hist:
            got = decode(hk, hv)
            assert got == [(pos + i, got[0][1]) for i in range(len(got))], got
            pos += len(got)
        assert c.size() == oracle.size()
        assert c.is_trimmable() == oracle.is_trimmable()
        pool.check()
    rot_probe(c, hist, heads)
    pool.check()


# ============================================================================ RecurrentCache


def rec_slots(hist: List[Tuple[int, int]]):
    """Expected slots for a token history: last three tokens; float32 running sums."""
    last = np.full((1, 3, 2), -1.0, np.float32)
    tail = hist[-3:]
    for i, (p, t) in enumerate(tail):
        last[0, 3 - len(tail) + i] = (p, t)
    sums = np.array([[sum(p for p, _ in hist), sum(t for _, t in hist)]], np.float32)
    return last, sums


def rec_state(c: K.RecurrentCache):
    return [c.offset, np_tree(list(c.cache))]


def rec_check_live(c: K.RecurrentCache, hist, written: bool):
    assert c.offset == len(hist)
    if not written:
        assert all(s is None for s in c.cache)
        return
    s0, s1 = rec_slots(hist)
    assert np.array_equal(np.array(c[0]), s0)
    assert c[1].dtype == mx.float32
    assert np.array_equal(np.array(c[1]), s1)
    for extra in c.cache[2:]:
        assert extra is None


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_recurrent_random_ops(data):
    size = data.draw(st.sampled_from([2, 3]), label="size")
    c = K.RecurrentCache(size)
    hist: List[Tuple[int, int]] = []
    written = False  # slots hold state (False after free / at start)
    pool = SnapPool()
    n_ops = data.draw(st.integers(1, 30), label="n_ops")
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(
            ["update", "update", "decode", "snapshot", "snapshot", "rewind", "restore", "restore",
             "merge", "split", "free", "close"]), label="op")
        offset = c.offset
        if op in ("update", "decode"):
            n = 1 if op == "decode" else data.draw(st.integers(2, 6), label="L")
            tag = next(_tags)
            hist = hist + [(offset + i, tag) for i in range(n)]
            s0, s1 = rec_slots(hist)
            c[0] = mx.array(s0)
            # The recurrent slot is kept in float32 whatever the model writes.
            c[1] = mx.array(s1).astype(mx.float16) if data.draw(st.booleans(), label="fp16") and \
                np.all(np.abs(s1) < 2048) else mx.array(s1)
            if data.draw(st.booleans(), label="settle"):
                K.settle([c], n)  # a model that does not call advance (Mamba-1)
                K.settle([c], n)  # idempotent: nothing was written since
            else:
                c.advance(n)
            written = True
        elif op == "snapshot":
            a = data.draw(st.integers(0, offset), label="from")
            s = c.snapshot(a)
            if a == offset or not written:
                assert s is None
            else:
                assert isinstance(s, K.RecurrentSnapshot)
                assert (s.from_offset, s.to_offset) == (a, offset)
                s0, s1 = rec_slots(hist)
                assert np.array_equal(np.array(s.slots[0]), s0)
                assert np.array_equal(np.array(s.slots[1]), s1)
                assert s.nbytes == s0.nbytes + s1.nbytes
                pool.add(s, list(hist))
        elif op == "rewind":
            t = data.draw(st.one_of(st.just(offset), st.integers(0, offset + 2)), label="t")
            before = rec_state(c)
            assert c.restore(None, t) == (t == offset)
            assert same_tree(rec_state(c), before)
        elif op == "restore" and pool.items:
            s, _, _, shist = data.draw(st.sampled_from(pool.items), label="snap")
            t = data.draw(st.one_of(st.just(s.to_offset), st.integers(0, s.to_offset + 2)), label="t")
            before = rec_state(c)
            got = c.restore(s, t)
            assert got == (t == s.to_offset)
            if got:
                hist = list(shist)
                written = True
            else:
                assert same_tree(rec_state(c), before)
        elif op in ("merge", "split") and pool.items:
            whole_state_merge_or_split(c, op, pool, data)
        elif op == "free":
            c.free()
            hist, written = [], False
        elif op == "close" and pool.items:
            s = data.draw(st.sampled_from(pool.items), label="snap")[0]
            s.close()
            pool.drop(s)
            check_closed_refused(c, s, rec_state)
        rec_check_live(c, hist, written)
        pool.check()


# ============================================================================ regressions


def test_rotating_restore_then_decode_leaves_snapshot_intact():
    """A wrapped window restored from a snapshot and then written in place (L == 1) must
    not write into the snapshot's arrays (they must not share the array wrapper)."""
    c = K.RotatingKVCache(4)
    for p in range(6):
        c.update(*make_tokens(p, 1, 1, 1))
    s = c.snapshot(0)
    frozen = np.array(s.keys).copy()
    c.update(*make_tokens(6, 1, 1, 2))
    assert c.restore(s, 6)
    c.update(*make_tokens(6, 1, 1, 3))
    assert np.array_equal(np.array(s.keys), frozen)
    # and the same snapshot still restores the original window
    assert c.restore(s, 6)
    assert sorted(decode(*c.update(*make_tokens(6, 1, 1, 4)))) == [(3, 1), (4, 1), (5, 1), (6, 4)]


@pytest.mark.parametrize("first", [2, 4])
def test_rotating_update_never_writes_into_callers_arrays(first):
    """The first multi-token update must not adopt the caller's array wrapper: a later
    in-place decode (after a rewind, or after a first chunk of exactly max_size) would
    otherwise write into the caller's keys/values."""
    c = K.RotatingKVCache(4)
    k, v = make_tokens(0, first, 1, 1)
    frozen = np.array(k).copy(), np.array(v).copy()
    c.update(k, v)
    if first < 4:
        assert c.restore(None, 0)
    c.update(*make_tokens(c.offset, 1, 1, 2))
    assert np.array_equal(np.array(k), frozen[0]) and np.array_equal(np.array(v), frozen[1])
