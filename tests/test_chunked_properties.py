"""Property tests of `ChunkedKVCache` / `ChunkedSnapshot` against a token history.

Every row carries its position and a write tag (test_cache_properties' encoding). After
every random operation the cache must hold exactly the rows ``[start_position, offset)``
of the history; a restore must succeed exactly when the rows of the target's chunk
``[t - t % C, t)`` are available (from the cache's own rows below the snapshot and the
snapshot's rows) and then hold exactly those rows; snapshots never change; split / merge
keep what each piece can still serve.
"""

from __future__ import annotations

import itertools
from typing import List

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_kvcache as K
from test_cache_properties import SnapPool, decode, make_tokens

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_tags = itertools.count(1)


def held(c) -> List[tuple]:
    if c.keys is None or c.offset == c.start_position:
        return []
    k, v = c.keys_and_values()
    return decode(k, v)


def rows_of(s) -> List[tuple]:
    return decode(s.keys, s.values)


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_chunked_random_ops(data):
    C = data.draw(st.sampled_from([3, 4, 8]), label="chunk")
    heads = data.draw(st.sampled_from([1, 2]), label="heads")
    c = K.ChunkedKVCache(C)
    hist: List[int] = []  # tag per position [0, offset) (positions below start_position unheld)
    pool = SnapPool()
    for _ in range(data.draw(st.integers(1, 30), label="n_ops")):
        op = data.draw(st.sampled_from(["update", "update", "decode", "trim_front", "snapshot",
                                        "snapshot", "rewind", "restore", "restore", "merge",
                                        "split", "free"]), label="op")
        if op in ("update", "decode"):
            n = 1 if op == "decode" else data.draw(st.integers(1, 6), label="L")
            tag = next(_tags)
            c.update(*make_tokens(c.offset, n, heads, tag))
            hist.extend([tag] * n)
        elif op == "trim_front":
            sp = c.start_position
            c.maybe_trim_front()
            if c.keys is not None:
                assert c.start_position == max(sp, c.offset - C)
        elif op == "snapshot":
            a = data.draw(st.integers(0, c.offset), label="from")
            s = c.snapshot(a)
            lo = max(a, c.start_position)
            if c.keys is None or lo >= c.offset:
                assert s is None
            else:
                assert (s.from_offset, s.to_offset, s.rows_from) == (a, c.offset, lo)
                assert rows_of(s) == [(p, hist[p]) for p in range(lo, c.offset)]
                pool.add(s, {p: hist[p] for p in range(lo, c.offset)})
        elif op == "rewind":
            t = data.draw(st.integers(0, c.offset + 2), label="t")
            lo = t - t % C
            expect = t <= c.offset and (lo == t or (c.keys is not None and c.start_position <= lo))
            before = (c.offset, c.start_position, held(c))
            assert c.restore(None, t) == expect
            if expect:
                del hist[t:]
            else:
                assert (c.offset, c.start_position, held(c)) == before
        elif op == "restore" and pool.items:
            s, _, _, rows = data.draw(st.sampled_from(pool.items), label="snap")
            t = data.draw(st.integers(0, s.to_offset + 2), label="t")
            own = {p: hist[p] for p in range(c.start_position, min(c.offset, s.from_offset))
                   if c.keys is not None}
            avail = {**own, **rows}
            lo = t - t % C
            expect = t <= max(s.to_offset, min(c.offset, s.from_offset)) and all(
                p in avail for p in range(lo, t))
            before = (c.offset, c.start_position, held(c))
            assert c.restore(s, t) == expect, (s, t, sorted(avail), c)
            if expect:
                hist = [avail.get(p, -1) for p in range(t)]
            else:
                assert (c.offset, c.start_position, held(c)) == before
        elif op == "merge" and len(pool.items) >= 2:
            pairs = [(p, q) for p in pool.items for q in pool.items
                     if p[0] is not q[0] and p[0].to_offset == q[0].from_offset]
            if not pairs:
                continue
            p, q = data.draw(st.sampled_from(pairs), label="pair")
            m = c.merge(p[0], q[0])
            assert p[0].closed and q[0].closed
            assert (m.from_offset, m.to_offset) == (p[0].from_offset, q[0].to_offset)
            whole = q[0].rows_from == q[0].from_offset
            rows = {**p[3], **q[3]} if whole else dict(q[3])
            assert m.rows_from == (p[0].rows_from if whole else q[0].rows_from)
            assert rows_of(m) == sorted(rows.items())
            pool.drop(p[0])
            pool.drop(q[0])
            pool.add(m, rows)
        elif op == "split" and pool.items:
            s, _, _, rows = data.draw(st.sampled_from(pool.items), label="snap")
            a, b = s.from_offset, s.to_offset
            at = data.draw(st.integers(max(0, a - 1), b + 1), label="at")
            head, tail = c.split(s, at)
            if at <= a or at >= b:
                assert (head, tail) == ((None, s) if at <= a else (s, None)) and not s.closed
                continue
            assert s.closed
            pool.drop(s)
            hr = {p: t for p, t in rows.items() if p < at}
            tr = {p: t for p, t in rows.items() if p >= at}
            assert (head is None) == (not hr)
            if head is not None:
                assert (head.from_offset, head.to_offset) == (a, at) and rows_of(head) == sorted(hr.items())
                pool.add(head, hr)
            assert (tail.from_offset, tail.to_offset) == (at, b) and rows_of(tail) == sorted(tr.items())
            pool.add(tail, tr)
        elif op == "free":
            c.free()
            hist = []
        assert c.offset == len(hist)
        assert held(c) == [(p, hist[p]) for p in range(c.start_position, c.offset)] or c.keys is None
        pool.check()
    # It continues correctly: an update returns exactly the rows held plus the new ones.
    tag = next(_tags)
    sp = c.start_position
    k, v = c.update(*make_tokens(c.offset, 2, heads, tag))
    hist.extend([tag, tag])
    assert decode(k, v) == [(p, hist[p]) for p in range(sp, c.offset)]
    mx.eval(k)
