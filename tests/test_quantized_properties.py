"""Property tests of `QuantizedKVCache` and `QuantizedSnapshot` against a never-snapshotted
cache fed the same rows.

The reference is mlx-lm's own ``QuantizedKVCache`` fed, in one update, the float rows the
state stands for (quantization groups run along the head dimension, so every row is
quantized on its own and the chunking does not matter). After every random operation —
updates, decode steps, snapshots, rewinds, restores (from quantized snapshots and from
unquantized `KVSnapshot` rows), merges, splits, trims, frees, closes — our cache must hold
exactly the reference's packed data, scales and biases; every snapshot must hold exactly
the quantized rows it covers and never change; restores the schedule forbids must be
refused (False, nothing changed); no array a caller passed in is ever written.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlc

import mlx_kvcache as K
from mlx_kvcache import CacheError
from mlx_kvcache.caches.quantized import quantize_rows
from reference import FLOAT_TOL

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
D, G = 32, 32


def rows(n, heads, seed):
    """Random float keys/values ``[1, heads, n, D]`` (their own numpy copies kept)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, heads, n, D)).astype(np.float32)
    v = rng.standard_normal((1, heads, n, D)).astype(np.float32)
    return mx.array(k), mx.array(v)


def reference(hist, heads, bits):
    """mlx-lm's QuantizedKVCache fed ``hist`` (a list of float row pairs) at once."""
    ref = mlc.QuantizedKVCache(group_size=G, bits=bits)
    if not hist:
        return None
    k = mx.concatenate([r[0] for r in hist], axis=2)
    v = mx.concatenate([r[1] for r in hist], axis=2)
    kq, vq = ref.update_and_fetch(k, v)
    return [np.array(x) for x in tuple(kq) + tuple(vq)]


def held(c):
    if c.keys is None or c.offset == 0:
        return None
    kq, vq = c.keys_and_values()
    return [np.array(x) for x in tuple(kq) + tuple(vq)]


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and np.array_equal(x, y) for x, y in zip(a, b))


def split_rows(k, v):
    return [(k[..., i : i + 1, :], v[..., i : i + 1, :]) for i in range(k.shape[2])]


def quantized_of(payload, bits):
    k = mx.concatenate([r[0] for r in payload], axis=2)
    v = mx.concatenate([r[1] for r in payload], axis=2)
    return [np.array(x) for x in quantize_rows(k, G, bits) + quantize_rows(v, G, bits)]


class Pool:
    """Open snapshots, their frozen arrays, and the float rows they stand for."""

    def __init__(self):
        self.items = []

    def add(self, s, payload):
        arrays, meta = s.to_arrays()
        self.items.append([s, {n: np.array(a).copy() for n, a in arrays.items()}, dict(meta), payload])

    def drop(self, s):
        self.items = [it for it in self.items if it[0] is not s]

    def check(self):
        for s, arrays, meta, _ in self.items:
            assert not s.closed
            now, now_meta = s.to_arrays()
            assert now_meta == meta and now.keys() == arrays.keys()
            for n in arrays:
                assert np.array_equal(np.array(now[n]), arrays[n]), f"{s!r} changed ({n})"
            assert s.nbytes == sum(a.nbytes for a in arrays.values())


@settings(max_examples=120, **SETTINGS)
@given(st.data())
def test_quantized_cache_random_ops(data):
    heads = data.draw(st.sampled_from([1, 2]), label="heads")
    bits = data.draw(st.sampled_from([4, 8]), label="bits")
    start = data.draw(st.sampled_from([-1, 0, 5, 12]), label="start")
    c = K.QuantizedKVCache(group_size=G, bits=bits, quantized_kv_start=start)
    hist = []  # float rows of positions [0, offset)
    inputs = []  # (array passed in, its numpy copy)
    pool = Pool()
    seed = data.draw(st.integers(0, 10**6), label="seed")
    for step in range(data.draw(st.integers(1, 25), label="n_ops")):
        op = data.draw(st.sampled_from(
            ["update", "update", "decode", "snapshot", "snapshot", "kvsnap", "qsnap", "rewind", "restore",
             "restore", "merge", "split", "trim", "free", "close"]), label="op")
        if op in ("update", "decode"):
            n = 1 if op == "decode" else data.draw(st.integers(1, 6), label="L")
            k, v = rows(n, heads, seed + step)
            inputs.append((k, np.array(k).copy()))
            inputs.append((v, np.array(v).copy()))
            kq, vq = c.update(k, v)
            hist.extend(split_rows(k, v))
            assert same([np.array(x) for x in tuple(kq) + tuple(vq)], reference(hist, heads, bits))
        elif op == "snapshot":
            a = data.draw(st.integers(0, c.offset), label="from")
            s = c.snapshot(a)
            if a == c.offset:
                assert s is None
            else:
                assert isinstance(s, K.QuantizedSnapshot) and (s.from_offset, s.to_offset) == (a, c.offset)
                assert (s.bits, s.group_size, s.start) == (bits, G, start)
                assert same([np.array(x) for x in s.keys + s.values], quantized_of(hist[a:], bits))
                per_row = heads * 2 * (D * bits // 8 + 2 * (D // G) * 4)
                assert s.nbytes == (c.offset - a) * per_row
                pool.add(s, hist[a:])
        elif op == "kvsnap":  # unquantized rows, as a KV layer's trie node holds them
            a = data.draw(st.integers(0, 8), label="from")
            n = data.draw(st.integers(1, 6), label="n")
            k, v = rows(n, heads, seed + 1000 + step)
            pool.add(K.KVSnapshot(a, a + n, {"keys": k, "values": v}), split_rows(k, v))
        elif op == "qsnap":  # quantized rows of another cache, maybe under another schedule
            a = data.draw(st.integers(0, 8), label="from")
            n = data.draw(st.integers(1, 6), label="n")
            other = K.QuantizedKVCache(group_size=G, bits=bits,
                                       quantized_kv_start=data.draw(st.sampled_from([-1, 0, 5, 12])))
            k, v = rows(a + n, heads, seed + 2000 + step)
            other.update(k, v)
            pool.add(other.snapshot(a), split_rows(k, v)[a:])
        elif op == "rewind":
            t = data.draw(st.integers(0, c.offset + 2), label="t")
            before = held(c)
            ok = c.restore(None, t)
            assert ok == (t <= len(hist))
            if ok:
                del hist[t:]
            else:
                assert same(held(c), before)
        elif op == "restore" and pool.items:
            s, _, _, payload = data.draw(st.sampled_from(pool.items), label="snap")
            t = data.draw(st.integers(0, s.to_offset + 2), label="t")
            before, off = held(c), c.offset
            ok = c.restore(s, t)
            allowed = (s.start == start) if isinstance(s, K.QuantizedSnapshot) else (
                start < 0 or s.to_offset <= start)
            reach = t <= s.to_offset and len(hist) >= s.from_offset
            assert ok == (reach and (allowed or t <= s.from_offset)), (ok, reach, allowed, s, t)
            if ok:
                hist[:] = (hist[: s.from_offset] + list(payload))[:t]
            else:
                assert same(held(c), before) and c.offset == off
        elif op == "merge" and len(pool.items) >= 2:
            adjacent = [(p, q) for p in pool.items for q in pool.items
                        if p[0] is not q[0] and p[0].to_offset == q[0].from_offset]
            if not adjacent:
                continue
            p, q = data.draw(st.sampled_from(adjacent), label="pair")
            sp, sq = p[0], q[0]
            kinds = (type(sp), type(sq))
            if kinds == (K.KVSnapshot, K.KVSnapshot):
                continue  # KVCache's business (test_cache_properties)
            m = c.merge(sp, sq)
            assert sp.closed and sq.closed
            pool.drop(sp)
            pool.drop(sq)
            if kinds == (K.QuantizedSnapshot, K.QuantizedSnapshot):
                expect = m is not None
            elif kinds == (K.KVSnapshot, K.QuantizedSnapshot):
                expect = 0 <= sq.start and sp.to_offset <= sq.start
            else:
                expect = False  # quantized rows followed by unquantized ones: no valid form
            assert (m is not None) == expect
            if m is not None:
                assert isinstance(m, K.QuantizedSnapshot)
                assert (m.from_offset, m.to_offset) == (sp.from_offset, sq.to_offset)
                assert same([np.array(x) for x in m.keys + m.values],
                             quantized_of(list(p[3]) + list(q[3]), bits))
                pool.add(m, list(p[3]) + list(q[3]))
        elif op == "split" and pool.items:
            s, _, _, payload = data.draw(st.sampled_from(pool.items), label="snap")
            if not isinstance(s, K.QuantizedSnapshot):
                continue
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
                assert same([np.array(x) for x in head.keys + head.values], quantized_of(payload[: at - a], bits))
                assert same([np.array(x) for x in tail.keys + tail.values], quantized_of(payload[at - a:], bits))
                assert head.nbytes + tail.nbytes == s_bytes(payload, heads, bits)
                pool.drop(s)
                pool.add(head, payload[: at - a])
                pool.add(tail, payload[at - a:])
        elif op == "trim":
            n = data.draw(st.integers(0, c.offset + 2), label="n")
            assert c.trim(n) == min(n, len(hist))
            del hist[len(hist) - min(n, len(hist)):]
        elif op == "free":
            c.free()
            hist = []
        elif op == "close" and pool.items:
            s = data.draw(st.sampled_from(pool.items), label="snap")[0]
            s.close()
            s.close()
            pool.drop(s)
            before = held(c)
            with pytest.raises(CacheError, match="closed"):
                c.restore(s, s.to_offset)
            assert same(held(c), before)
        assert c.offset == len(hist)
        assert same(held(c), reference(hist, heads, bits))
        pool.check()
    # The cache continues correctly from wherever it is, and no input was ever written.
    k, v = rows(2, heads, seed + 99)
    c.update(k, v)
    hist.extend(split_rows(k, v))
    assert same(held(c), reference(hist, heads, bits))
    for a, copy in inputs:
        assert np.array_equal(np.array(a), copy)


def s_bytes(payload, heads, bits):
    return len(payload) * heads * 2 * (D * bits // 8 + 2 * (D // G) * 4)


def test_to_quantized_and_state_round_trip():
    """``KVCache.to_quantized`` returns ours (what mlx-lm's ``maybe_quantize_kv_cache``
    calls), equal to mlx-lm's conversion; state / from_state round-trip through mlx-lm's
    own ``save_prompt_cache`` layout."""
    k, v = rows(300, 2, 1)
    ours, theirs = K.KVCache(), mlc.KVCache()
    ours.update(k, v)
    theirs.update_and_fetch(mx.array(k), mx.array(v))
    q, ref = ours.to_quantized(group_size=G, bits=4), theirs.to_quantized(group_size=G, bits=4)
    assert type(q) is K.QuantizedKVCache and hasattr(q, "bits") and q.offset == 300
    kr, vr = ref.keys, ref.values
    assert same(held(q), [np.array(x[..., :300, :]) for x in tuple(kr) + tuple(vr)])
    q2 = K.QuantizedKVCache.from_state(q.state)
    assert same(held(q2), held(q)) and (q2.bits, q2.group_size) == (4, G)
    conv = K.convert(ref)  # mlx-lm's class becomes ours, sharing the arrays
    assert type(conv) is K.QuantizedKVCache and same(held(conv), held(q))
    with pytest.raises(CacheError, match="multiple of the kv group size"):
        K.QuantizedKVCache(group_size=64, bits=4).update(*rows(1, 1, 0))
    with pytest.raises(CacheError, match="kv bits"):
        K.QuantizedKVCache(bits=7)


def test_snapshot_owns_exactly_its_bytes():
    """Measured with mx.get_active_memory: a snapshot of the last 100 rows of a 6000-row
    cache holds exactly its own compact copy (no live buffer, no padding kept alive)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    c = K.QuantizedKVCache(group_size=G, bits=8)
    c.update(*rows(6000, 16, 2))
    mx.eval(list(c.keys + c.values))
    live = c.nbytes
    s = c.snapshot(5900)
    per_row = 16 * 2 * (D * 8 // 8 + 2 * (D // G) * 4)  # packed bytes + float32 scales, biases
    assert s.nbytes == 100 * per_row and live >= 6000 * per_row
    c.free()
    gc.collect()
    mx.clear_cache()
    held_now = mx.get_active_memory() - base
    assert s.nbytes <= held_now <= s.nbytes + (1 << 16), (held_now, s.nbytes, live)
    s.close()
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() - base <= 1 << 16


def test_mlx_lm_generate_step_quantizes_our_caches_into_ours():
    """mlx-lm's ``maybe_quantize_kv_cache`` calls ``to_quantized`` on our `KVCache`: the list
    then holds our `QuantizedKVCache`, and the answer equals mlx-lm's own caches'."""
    from mlx_lm.generate import generate_step

    from models import build

    m = build("llama", head_dim=32)
    prompt = mx.array(list(range(3, 40)))
    kw = dict(max_tokens=4, kv_bits=4, kv_group_size=G, quantized_kv_start=10, prefill_step_size=16)
    ours = K.make_prompt_cache(m)
    got = [lp for (_, lp), _ in zip(generate_step(prompt, m, prompt_cache=ours, **kw), range(4))]
    ref = [lp for (_, lp), _ in zip(generate_step(prompt, m, prompt_cache=mlc.make_prompt_cache(m), **kw),
                                    range(4))]
    assert all(type(c) is K.QuantizedKVCache for c in ours)
    assert max(mx.abs(a - b).max().item() for a, b in zip(got, ref)) < FLOAT_TOL
