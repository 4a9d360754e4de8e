"""Bad input raises `CacheError` (a ValueError) naming the problem and changes nothing;
merely unreachable restores return False and change nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvcache as K
from mlx_kvcache import CacheError


def toks(pos, n, heads=2, dk=4, dv=4, dtype=mx.float32, batch=1):
    k = mx.broadcast_to(mx.arange(pos, pos + n, dtype=mx.float32)[None, None, :, None], (batch, heads, n, dk))
    v = -mx.broadcast_to(mx.arange(pos, pos + n, dtype=mx.float32)[None, None, :, None], (batch, heads, n, dv))
    return k.astype(dtype), v.astype(dtype)


def snap_state(c):
    """Offset and contents, as numpy, for an unchanged-check."""
    if isinstance(c, K.RecurrentCache):
        return c.offset, [None if s is None else np.array(s).copy() for s in c.cache]
    st = c.state
    return tuple(np.array(x).copy() if isinstance(x, mx.array) else x for x in st)


def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def kv_cache(n=5, **kw):
    c = K.KVCache()
    c.update(*toks(0, n, **kw))
    return c


def rot_cache(n=5, max_size=8, keep=0, **kw):
    c = K.RotatingKVCache(max_size, keep=keep)
    c.update(*toks(0, n, **kw))
    return c


def rec_cache(n=3):
    c = K.RecurrentCache(2)
    c[0] = mx.ones((1, 3, 4))
    c[1] = mx.full((1, 2, 4, 4), float(n))
    c.advance(n)
    return c


def expect_error(c, fn, match):
    before = snap_state(c)
    with pytest.raises(CacheError, match=match) as ei:
        fn()
    assert isinstance(ei.value, ValueError)
    assert same(snap_state(c), before), "a rejected call changed the cache"
    return ei.value


ATTN = [kv_cache, rot_cache]


def test_cache_error_is_value_error():
    assert issubclass(CacheError, ValueError)


# -- update -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", ATTN)
def test_wrong_rank(make):
    c = make()
    k, v = toks(5, 2)
    expect_error(c, lambda: c.update(k[0], v[0]), "rank 4")
    expect_error(c, lambda: c.update(k, v[0]), "rank 4")


@pytest.mark.parametrize("make", ATTN)
def test_wrong_rank_on_empty_cache(make):
    c = K.KVCache() if make is kv_cache else K.RotatingKVCache(8)
    k, v = toks(0, 2)
    expect_error(c, lambda: c.update(k[0], v[0]), "rank 4")
    assert c.offset == 0 and c.empty()


@pytest.mark.parametrize("make", ATTN)
def test_batch_mismatch(make):
    c = make()
    expect_error(c, lambda: c.update(*toks(5, 1, batch=2)), "batch size 2")


@pytest.mark.parametrize("make", ATTN)
def test_head_count_mismatch(make):
    c = make()
    expect_error(c, lambda: c.update(*toks(5, 1, heads=3)), "head count 3")


@pytest.mark.parametrize("make", ATTN)
def test_head_dim_mismatch(make):
    c = make()
    expect_error(c, lambda: c.update(*toks(5, 1, dk=8)), "head dims")
    expect_error(c, lambda: c.update(*toks(5, 1, dv=8)), "head dims")


@pytest.mark.parametrize("make", ATTN)
def test_keys_values_length_mismatch(make):
    c = make()
    k, _ = toks(5, 3)
    _, v = toks(5, 2)
    expect_error(c, lambda: c.update(k, v), "disagree")


@pytest.mark.parametrize("make", ATTN)
def test_dtype_change_mid_sequence(make):
    c = make()
    expect_error(c, lambda: c.update(*toks(5, 1, dtype=mx.float16)), "dtype")
    expect_error(c, lambda: c.update(*toks(5, 2, dtype=mx.bfloat16)), "dtype")


@pytest.mark.parametrize("make", ATTN)
def test_zero_length_update(make):
    c = make()
    k, v = toks(5, 1)
    expect_error(c, lambda: c.update(k[..., :0, :], v[..., :0, :]), "zero tokens")


@pytest.mark.parametrize("make", ATTN)
def test_not_arrays(make):
    c = make()
    k, v = toks(5, 1)
    expect_error(c, lambda: c.update(np.array(k), v), "mx.array")


# -- snapshot / restore arguments ---------------------------------------------------------


@pytest.mark.parametrize("make", [kv_cache, rot_cache, rec_cache])
def test_snapshot_from_offset_out_of_range(make):
    c = make()
    expect_error(c, lambda: c.snapshot(-1), "from_offset must be >= 0")
    expect_error(c, lambda: c.snapshot(c.offset + 1), "beyond the cache offset")
    expect_error(c, lambda: c.snapshot("3"), "must be an int")


@pytest.mark.parametrize("make", [kv_cache, rot_cache, rec_cache])
def test_negative_restore_target(make):
    """The seed interface: Restore returns false when the target is unreachable, e.g. negative."""
    c = make()
    s = c.snapshot(0)
    before = snap_state(c)
    assert c.restore(None, -1) is False
    assert c.restore(s, -1) is False
    assert same(snap_state(c), before), "a refused restore changed the cache"
    expect_error(c, lambda: c.restore(None, 1.5), "target must be an int")
    expect_error(c, lambda: c.restore(s, "3"), "target must be an int")


def test_snapshot_of_another_kind():
    kv, rot, rec = kv_cache(), rot_cache(), rec_cache()
    ks, rs, cs = kv.snapshot(0), rot.snapshot(0), rec.snapshot(0)
    e = expect_error(kv, lambda: kv.restore(rs, rs.to_offset), "RotatingSnapshot")
    assert "KVSnapshot" in str(e)
    expect_error(kv, lambda: kv.restore(cs, cs.to_offset), "RecurrentSnapshot")
    expect_error(rot, lambda: rot.restore(ks, ks.to_offset), "KVSnapshot")
    expect_error(rot, lambda: rot.restore(cs, cs.to_offset), "RecurrentSnapshot")
    expect_error(rec, lambda: rec.restore(ks, ks.to_offset), "KVSnapshot")
    expect_error(rec, lambda: rec.restore(rs, rs.to_offset), "RotatingSnapshot")
    expect_error(kv, lambda: kv.merge(ks, rs), "RotatingSnapshot")
    expect_error(rot, lambda: rot.merge(rs, cs), "RecurrentSnapshot")
    expect_error(rec, lambda: rec.merge(ks, cs), "KVSnapshot")
    expect_error(kv, lambda: kv.split(rs, 2), "RotatingSnapshot")
    expect_error(rec, lambda: rec.split(ks, 1), "KVSnapshot")
    for s in (ks, rs, cs):
        assert not s.closed


@pytest.mark.parametrize("kw, match", [
    (dict(heads=1), "head count"),
    (dict(dk=8), "head dims"),
    (dict(dv=2), "head dims"),
    (dict(dtype=mx.float16), "dtype"),
    (dict(batch=2), "batch size"),
])
@pytest.mark.parametrize("make", ATTN)
def test_snapshot_of_another_shape(make, kw, match):
    other = make(**kw)
    s = other.snapshot(0)
    c = make()
    expect_error(c, lambda: c.restore(s, s.to_offset), match)
    assert not s.closed


def test_kv_merge_of_another_shape():
    c = K.KVCache()
    a = kv_cache(3).snapshot(0)
    o = K.KVCache()
    o.update(*toks(0, 5, heads=1))
    b = o.snapshot(3)
    expect_error(c, lambda: c.merge(a, b), "head count")
    assert not a.closed and not b.closed


def test_recurrent_snapshot_of_another_shape():
    c = rec_cache()
    o = K.RecurrentCache(2)
    o[0] = mx.ones((1, 3, 8))
    o[1] = mx.ones((1, 2, 4, 4))
    o.advance(3)
    s = o.snapshot(0)
    expect_error(c, lambda: c.restore(s, 3), r"slot 0")
    o3 = K.RecurrentCache(3)
    o3[0], o3[1], o3[2] = mx.ones((1, 3, 4)), mx.ones((1, 2, 4, 4)), mx.ones((1,))
    o3.advance(3)
    s3 = o3.snapshot(0)
    expect_error(c, lambda: c.restore(s3, 3), "3 slots")


@pytest.mark.parametrize("make", [kv_cache, rot_cache, rec_cache])
def test_closed_snapshot(make):
    c = make()
    s = c.snapshot(0)
    s.close()
    s.close()
    assert s.closed and s.nbytes == 0
    expect_error(c, lambda: c.restore(s, s.to_offset), "closed")
    expect_error(c, lambda: c.split(s, 1), "closed")
    expect_error(c, lambda: c.merge(s, s), "closed")
    with pytest.raises(CacheError, match="closed"):
        s.to_arrays()


def test_kv_merge_non_adjacent():
    c = kv_cache(10)
    a = c.snapshot(0)  # [0, 10)
    c.update(*toks(10, 4))
    b = c.snapshot(12)  # [12, 14)
    e = expect_error(c, lambda: c.merge(a, b), "non-adjacent")
    assert "[0, 10)" in str(e) and "[12, 14)" in str(e)
    expect_error(c, lambda: c.merge(b, a), "non-adjacent")
    assert not a.closed and not b.closed


def test_rotating_snapshot_with_other_window():
    s = rot_cache(max_size=8).snapshot(0)
    c = rot_cache(max_size=6)
    e = expect_error(c, lambda: c.restore(s, s.to_offset), "max_size=8")
    assert "max_size=6" in str(e)
    s2 = rot_cache(max_size=8, keep=2).snapshot(0)
    c2 = rot_cache(max_size=8, keep=0)
    expect_error(c2, lambda: c2.restore(s2, s2.to_offset), "keep=2")


def test_rotating_bad_construction():
    with pytest.raises(CacheError, match="max_size"):
        K.RotatingKVCache(0)
    with pytest.raises(CacheError, match="keep"):
        K.RotatingKVCache(4, keep=4)


def test_recurrent_slot_change_mid_sequence():
    c = rec_cache()
    expect_error(c, lambda: c.__setitem__(0, mx.ones((1, 3, 5))), "slot 0 changed")
    expect_error(c, lambda: c.__setitem__(0, mx.ones((1, 3, 4), dtype=mx.float16)), "slot 0 changed")
    expect_error(c, lambda: c.__setitem__(1, mx.ones((2, 2, 4, 4))), "slot 1 changed")
    expect_error(c, lambda: c.__setitem__(1, np.ones((1, 2, 4, 4))), "mx.array")


def test_recurrent_fp32_slot():
    c = K.RecurrentCache(2)
    c[1] = mx.ones((1, 2, 2), dtype=mx.bfloat16)
    assert c[1].dtype == mx.float32
    c[1] = mx.ones((1, 2, 2), dtype=mx.float16)  # converted, so not a dtype change
    assert c[1].dtype == mx.float32


# -- unreachable restores: False, nothing changed ------------------------------------------


def expect_false(c, fn):
    before = snap_state(c)
    assert fn() is False
    assert same(snap_state(c), before)


def test_kv_snapshot_without_its_base():
    c = kv_cache(10)
    s = c.snapshot(6)  # [6, 10)
    c.restore(None, 4)
    expect_false(c, lambda: c.restore(s, 10))
    expect_false(c, lambda: c.restore(s, 8))
    c.free()
    expect_false(c, lambda: c.restore(s, 10))
    # beyond the snapshot's end
    c2 = kv_cache(10)
    s2 = c2.snapshot(0)
    c2.update(*toks(10, 2))
    expect_false(c2, lambda: c2.restore(s2, 11))
    expect_false(c2, lambda: c2.restore(None, 13))
    assert not s.closed and not s2.closed


def test_rotating_restore_inside_wrapped_window():
    c = rot_cache(12, max_size=8)  # wrapped
    s = c.snapshot(0)
    expect_false(c, lambda: c.restore(None, 11))
    expect_false(c, lambda: c.restore(None, 13))
    expect_false(c, lambda: c.restore(s, 10))
    expect_false(c, lambda: c.restore(s, 13))
    c.update(*toks(12, 1))
    expect_false(c, lambda: c.restore(s, 5))
    assert c.restore(s, 12) is True and c.offset == 12
    # unwrapped snapshot: any lower target works, but not past its end
    u = rot_cache(6, max_size=8)
    us = u.snapshot(0)
    expect_false(u, lambda: u.restore(us, 7))
    assert u.restore(us, 3) is True and u.offset == 3


def test_recurrent_restore_to_another_offset():
    c = rec_cache(3)
    s = c.snapshot(0)
    c[1] = mx.full((1, 2, 4, 4), 5.0)
    c.advance(2)
    expect_false(c, lambda: c.restore(None, 3))
    expect_false(c, lambda: c.restore(None, 6))
    expect_false(c, lambda: c.restore(s, 2))
    expect_false(c, lambda: c.restore(s, 5))
    assert c.restore(None, 5) is True
    assert c.restore(s, 3) is True and c.offset == 3
    assert float(c[1][0, 0, 0, 0]) == 3.0
