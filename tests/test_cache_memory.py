"""Snapshots are compact and independent of the live cache.

* `nbytes` is exactly the bytes of what the snapshot covers (no 256-step padding).
* Holding a snapshot keeps neither the live buffer nor its padding alive.
* Later writes to the live cache never change a snapshot.
* `to_arrays` / `Snapshot.from_arrays` round-trips every kind.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvcache as K
from mlx_kvcache import CacheError, Snapshot

MiB = 1 << 20


def settle_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def rand(shape, seed):
    mx.random.seed(seed)
    a = mx.random.normal(shape)
    mx.eval(a)
    return a


def frozen(s: Snapshot):
    arrays, meta = s.to_arrays()
    return {k: np.array(v).copy() for k, v in arrays.items()}, meta


def unchanged(s: Snapshot, ref) -> bool:
    arrays, meta = s.to_arrays()
    return meta == ref[1] and arrays.keys() == ref[0].keys() and all(
        np.array_equal(np.array(arrays[k]), ref[0][k]) for k in arrays)


@pytest.mark.parametrize("heads", [8, 1])
def test_kv_snapshot_keeps_no_live_buffer_alive(heads):
    B, L, D = 1, 3000, 64
    base = settle_memory()
    c = K.KVCache()
    k, v = rand((B, heads, L, D), 1), rand((B, heads, L, D), 2)
    c.update(k, v)
    mx.eval(c.state)
    del k, v
    live = c.nbytes
    assert live == 2 * B * heads * 3072 * D * 4  # padded to a multiple of 256
    s = c.snapshot(1000)
    s0 = c.snapshot(2900)
    assert s.nbytes == B * heads * (L - 1000) * (D + D) * 4
    assert s0.nbytes == B * heads * 100 * (D + D) * 4
    del s
    c.free()
    held = settle_memory() - base
    assert held <= s0.nbytes + MiB, (held, s0.nbytes, live)
    assert held >= s0.nbytes  # it really holds its own copy
    # splitting keeps only the pieces
    head, tail = K.KVCache().split(s0, 2950)
    assert s0.closed and head.nbytes + tail.nbytes == B * heads * 100 * 2 * D * 4
    del s0
    assert settle_memory() - base <= head.nbytes + tail.nbytes + MiB
    del head
    assert settle_memory() - base <= tail.nbytes + MiB
    tail.close()
    assert settle_memory() - base <= MiB


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("rows", [40, 200, 250])
def test_small_snapshots_own_exactly_their_bytes(heads, rows):
    """A slice of one 256-row buffer is row-contiguous with one KV head; ``mx.contiguous``
    alone hands back the same buffer when it is at most 16 KiB bigger, so a snapshot
    counted at its rows would pin the whole buffer. Measured, not inferred."""
    base = settle_memory()
    c = K.KVCache()
    c.update(rand((1, heads, rows, 16), 1), rand((1, heads, rows, 16), 2))
    mx.eval(c.state)
    s = c.snapshot(0)
    c.free()
    held = settle_memory() - base
    assert s.nbytes == 2 * heads * rows * 16 * 4
    assert s.nbytes <= held <= s.nbytes + 64, (held, s.nbytes)


def test_kv_snapshot_nbytes_is_exact():
    c = K.KVCache()
    c.update(rand((1, 3, 23, 16), 0), rand((1, 3, 23, 8), 1))
    assert c.nbytes == 3 * 256 * (16 + 8) * 4
    s = c.snapshot(5)
    assert s.nbytes == 1 * 3 * 18 * (16 + 8) * 4
    assert s.keys.shape == (1, 3, 18, 16) and s.values.shape == (1, 3, 18, 8)
    c16 = K.KVCache()
    c16.update(rand((1, 2, 300, 8), 0).astype(mx.float16), rand((1, 2, 300, 8), 1).astype(mx.float16))
    assert c16.snapshot(0).nbytes == 2 * 300 * 16 * 2


def test_kv_later_writes_never_change_snapshot():
    c = K.KVCache()
    c.update(rand((1, 2, 40, 4), 0), rand((1, 2, 40, 4), 1))
    s = c.snapshot(10)
    ref = frozen(s)
    # rewind inside the snapshot's range and overwrite, one token and a chunk at a time
    assert c.restore(None, 20)
    for i in range(5):
        c.update(rand((1, 2, 1, 4), 10 + i), rand((1, 2, 1, 4), 20 + i))
        assert unchanged(s, ref)
    c.update(rand((1, 2, 300, 4), 3), rand((1, 2, 300, 4), 4))  # grows the buffer
    assert unchanged(s, ref)
    # restore the snapshot, then overwrite again
    assert c.restore(s, 30)
    c.update(rand((1, 2, 1, 4), 7), rand((1, 2, 1, 4), 8))
    c.update(rand((1, 2, 5, 4), 9), rand((1, 2, 5, 4), 10))
    assert unchanged(s, ref)
    c.free()
    assert unchanged(s, ref)


def test_rotating_snapshot_memory():
    H, D, M = 8, 64, 1024
    base = settle_memory()
    c = K.RotatingKVCache(M)
    c.update(rand((1, H, 3000, D), 1), rand((1, H, 3000, D), 2))  # wraps; buffer M + 2999 rows
    mx.eval(c.state)
    live = c.nbytes
    assert live == 2 * H * 3000 * D * 4
    s = c.snapshot(2000)
    assert s.wrapped and s.keys.shape[2] == M
    assert s.nbytes == 2 * H * M * D * 4
    c.free()
    held = settle_memory() - base
    assert s.nbytes <= held <= s.nbytes + MiB, (held, s.nbytes, live)
    s.close()
    assert settle_memory() - base <= MiB


def test_rotating_unwrapped_snapshot_has_no_padding():
    c = K.RotatingKVCache(512)
    for i in range(10):
        c.update(rand((1, 2, 1, 8), i), rand((1, 2, 1, 8), 100 + i))
    assert c.keys.shape[2] == 256  # the live buffer grew in a 256 step
    s = c.snapshot(0)
    assert not s.wrapped and s.keys.shape[2] == 10
    assert s.nbytes == 2 * 10 * 16 * 4


@pytest.mark.parametrize("wrap", [False, True])
def test_rotating_later_writes_never_change_snapshot(wrap):
    c = K.RotatingKVCache(8, keep=1)
    c.update(rand((1, 2, 12 if wrap else 5, 4), 0), rand((1, 2, 12 if wrap else 5, 4), 1))
    for i in range(3):
        c.update(rand((1, 2, 1, 4), 10 + i), rand((1, 2, 1, 4), 20 + i))
    s = c.snapshot(0)
    ref = frozen(s)
    t = s.to_offset
    for rnd in range(3):
        assert c.restore(s, t if wrap or rnd == 0 else t - 2)
        for i in range(10):  # decode in place, wrapping
            c.update(rand((1, 2, 1, 4), 50 + i), rand((1, 2, 1, 4), 60 + i))
            assert unchanged(s, ref)
        c.update(rand((1, 2, 3, 4), 5), rand((1, 2, 3, 4), 6))
        assert unchanged(s, ref)
    c.free()
    assert unchanged(s, ref)


def rec(size_conv=(1, 3, 256), size_state=(1, 8, 64, 64)):
    c = K.RecurrentCache(2)
    big = rand((1, 16, size_conv[2]), 0)
    c[0] = big[:, 5:8, :]  # a view into a larger array, as a conv layer's concat would give
    c[1] = rand(size_state, 1)
    c.advance(7)
    return c, big


def test_recurrent_snapshot_memory():
    base = settle_memory()
    c, big = rec()
    s = c.snapshot(0)
    expect = 1 * 3 * 256 * 4 + 8 * 64 * 64 * 4
    assert s.nbytes == expect
    del big
    c.free()
    held = settle_memory() - base
    assert expect <= held <= expect + MiB // 4, held
    s.close()
    assert settle_memory() - base <= MiB // 4


def test_recurrent_later_writes_never_change_snapshot():
    c, _ = rec((1, 3, 4), (1, 2, 4, 4))
    s = c.snapshot(3)
    ref = frozen(s)
    for rnd in range(3):
        for i in range(4):
            c[0] = c[0] + 1
            c[1] = c[1] * 2
            c.advance(1)
            assert unchanged(s, ref)
        assert c.restore(s, 7)
        assert np.array_equal(np.array(c[1]), ref[0]["1"])
    c.free()
    assert unchanged(s, ref)


# -- serialisation ------------------------------------------------------------------------


def roundtrip(s: Snapshot) -> Snapshot:
    arrays, meta = s.to_arrays()
    # as persistence would store them: plain numpy round trip, ints as ints
    arrays = {k: mx.array(np.array(v)) for k, v in arrays.items()}
    meta = {k: int(v) for k, v in meta.items()}
    out = Snapshot.from_arrays(s.kind, arrays, meta)
    assert type(out) is type(s)
    assert (out.from_offset, out.to_offset, out.nbytes) == (s.from_offset, s.to_offset, s.nbytes)
    assert out.meta() == s.meta()
    ref = frozen(s)
    assert unchanged(out, ref)
    return out


def test_roundtrip_kv():
    c = K.KVCache()
    c.update(rand((1, 2, 30, 4), 0), rand((1, 2, 30, 6), 1))
    s = c.snapshot(10)
    out = roundtrip(s)
    c2 = K.KVCache()
    c2.update(*(x[..., :10, :] for x in c.keys_and_values()))
    assert c2.restore(out, 30)
    for a, b in zip(c2.keys_and_values(), c.keys_and_values()):
        assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("n", [5, 13])
def test_roundtrip_rotating(n):
    c = K.RotatingKVCache(8, keep=2)
    c.update(rand((1, 2, n, 4), 0), rand((1, 2, n, 4), 1))
    c.update(rand((1, 2, 1, 4), 2), rand((1, 2, 1, 4), 3))
    s = c.snapshot(3)
    out = roundtrip(s)
    assert (out.idx, out.max_size, out.keep, out.wrapped) == (s.idx, s.max_size, s.keep, s.wrapped)
    a, b = K.RotatingKVCache(8, keep=2), K.RotatingKVCache(8, keep=2)
    assert a.restore(s, s.to_offset) and b.restore(out, out.to_offset)
    k, v = rand((1, 2, 1, 4), 9), rand((1, 2, 1, 4), 10)
    for x, y in zip(a.update(k, v), b.update(k, v)):
        assert np.array_equal(np.array(x), np.array(y))


def test_roundtrip_recurrent():
    c = K.RecurrentCache(3)
    c[0] = rand((1, 3, 8), 0)
    c[1] = rand((1, 2, 4, 4), 1)
    c.advance(5)
    s = c.snapshot(0)
    out = roundtrip(s)
    c2 = K.RecurrentCache(3)
    assert c2.restore(out, 5) and c2.offset == 5
    assert np.array_equal(np.array(c2[0]), np.array(c[0]))
    assert np.array_equal(np.array(c2[1]), np.array(c[1]))
    assert c2[2] is None


def test_from_arrays_rejects_bad_input():
    with pytest.raises(CacheError, match="unknown snapshot kind"):
        Snapshot.from_arrays("no-such-kind", {}, {"from_offset": 0, "to_offset": 1})
    k = mx.zeros((1, 2, 3, 4))
    with pytest.raises(CacheError, match="do not cover"):
        Snapshot.from_arrays("kv", {"keys": k, "values": k}, {"from_offset": 0, "to_offset": 5})
    with pytest.raises(CacheError, match="missing"):
        Snapshot.from_arrays("kv", {"keys": k}, {"from_offset": 0, "to_offset": 3})
    with pytest.raises(CacheError, match="missing"):
        Snapshot.from_arrays("rotating", {"keys": k, "values": k}, {"from_offset": 0, "to_offset": 3})
    with pytest.raises(CacheError, match="missing"):
        Snapshot.from_arrays("recurrent", {"0": k}, {"from_offset": 0})


def test_restore_chain_is_one_copy_of_adjacent_snapshots():
    c = K.KVCache()
    k, v = rand((1, 2, 700, 8), 3), rand((1, 2, 700, 8), 4)
    c.update(k, v)
    snaps = [c.snapshot(0)]
    snaps[0], b = K.KVCache().split(snaps[0], 300)
    mid, tail = K.KVCache().split(b, 550)
    chain = [snaps[0], mid, tail]
    before = [np.array(s.keys) for s in chain]
    r = K.KVCache()
    assert r.restore_chain(chain, 640)
    assert r.offset == 640 and r.keys.shape[2] % 256 == 0 and r.keys.shape[2] > 640
    assert np.array_equal(np.array(r.keys[..., :640, :]), np.array(k[..., :640, :]))
    r.update(rand((1, 2, 5, 8), 5), rand((1, 2, 5, 8), 6))  # writes in place, never into a snapshot
    assert all(np.array_equal(np.array(s.keys), b) for s, b in zip(chain, before))
    # a live prefix below the first snapshot is kept
    r2 = K.KVCache()
    r2.update(k[..., :300, :], v[..., :300, :])
    assert r2.restore_chain([mid, tail], 700)
    assert np.array_equal(np.array(r2.keys[..., :700, :]), np.array(k))
    # unreachable: beyond the last snapshot, or a gap below the first; nothing changes
    r3 = K.KVCache()
    assert not r3.restore_chain([mid, tail], 700) and r3.offset == 0 and r3.keys is None
    assert not r.restore_chain(chain, 701) and r.offset == 645
    with pytest.raises(CacheError, match="not adjacent"):
        K.KVCache().restore_chain([snaps[0], tail], 700)
