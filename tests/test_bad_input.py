"""Bad requests get a clear TypeError / ValueError naming the problem, before anything
changes: no state is computed, cached or saved from them."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvcache as mk
from models import V
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    TOK, assert_same, check_no_leaks, cold, model, new_cache, run, track_snapshots,
)


@pytest.fixture
def pc(tmp_path):
    c = new_cache(model("llama"), cache_dir=str(tmp_path))
    run(c, [1, 2, 3, 4, 5], 2)
    c.flush()
    return c


def unchanged(pc, before):
    pc.flush()
    assert (pc.stats.requests, pc.stats.snapshot_bytes) == before
    check_no_leaks(pc)


@pytest.mark.parametrize("bad, name", [
    ([1, 2, V], f"token id {V} at prompt position 2"),
    ([1, -1, 3], "token id -1 at prompt position 1"),
    ([5, 10**6], "token id 1000000"),
    ([2**40], "token id 1099511627776"),
    (mx.array([3, V + 5]), f"token id {V + 5}"),
])
def test_token_ids_outside_the_vocabulary(pc, bad, name):
    before = (pc.stats.requests, pc.stats.snapshot_bytes)
    with pytest.raises(ValueError, match=name) as e:
        pc.stream_generate(TOK, bad, 3)
    assert f"vocab size {V}" in str(e.value)
    unchanged(pc, before)
    got, _ = run(pc, [1, 2, 3, 4, 5, 6], 3)  # and the cache still serves right answers
    assert_same(cold(pc.model, [1, 2, 3, 4, 5, 6], 3), got)


@pytest.mark.parametrize("bad, exc, what", [
    ([1.0, 2.0], TypeError, "prompt element 0 is float"),
    ([1, 2.5], TypeError, "prompt element 1 is float"),
    ([True, 2], TypeError, "prompt element 0 is bool"),
    ({"a": 1}, TypeError, "got dict"),
    (b"\x01\x02", TypeError, "bytes"),
    (mx.array([[1, 2], [3, 4]]), ValueError, r"1-D token ids, got shape \(2, 2\)"),
    (np.array([[1, 2]]), ValueError, r"1-D token ids, got shape \(1, 2\)"),
    (mx.array([1.0, 2.0]), TypeError, "integer token ids"),
    (None, TypeError, "got NoneType"),
    ([], ValueError, "empty"),
])
def test_prompts_of_the_wrong_kind(pc, bad, exc, what):
    before = (pc.stats.requests, pc.stats.snapshot_bytes)
    with pytest.raises(exc, match=what):
        pc.stream_generate(TOK, bad, 3)
    unchanged(pc, before)


@pytest.mark.parametrize("bad, exc", [(2.5, TypeError), ("3", TypeError), (None, TypeError),
                                      (True, TypeError), (0, ValueError), (-2, ValueError)])
def test_max_tokens(pc, bad, exc):
    before = (pc.stats.requests, pc.stats.snapshot_bytes)
    with pytest.raises(exc, match="max_tokens"):
        pc.stream_generate(TOK, [1, 2, 3], bad)
    unchanged(pc, before)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (0, ValueError), (1.5, TypeError)])
def test_prefill_step_size(pc, bad, exc):
    with pytest.raises(exc, match="prefill_step_size"):
        pc.stream_generate(TOK, [1, 2, 3], 3, prefill_step_size=bad)
    with pytest.raises(exc, match="prefill_step_size"):
        mk.PrefixCache(model("llama"), prefill_step_size=bad)


def test_other_arguments(pc):
    with pytest.raises(TypeError, match="snapshot_at"):
        pc.stream_generate(TOK, [1, 2, 3], 3, snapshot_at=[1.5])
    with pytest.raises(TypeError, match="unsupported arguments"):
        pc.stream_generate(TOK, [1, 2, 3], 3, temperature=0.5)
    with pytest.raises(ValueError, match="cache_dir is empty"):
        mk.PrefixCache(model("llama"), cache_dir="")
    with pytest.raises(ValueError, match="cache_dir is empty"):
        mk.PrefixCache(model("llama"), cache_dir="  ")


def test_disk_arguments_are_checked(tmp_path):
    for bad in (-1, -(1 << 40)):
        with pytest.raises(ValueError, match="max_disk_bytes must be >= 0"):
            mk.PrefixCache(model("llama"), cache_dir=str(tmp_path), max_disk_bytes=bad)
    with pytest.raises(TypeError, match="max_disk_bytes"):
        mk.PrefixCache(model("llama"), cache_dir=str(tmp_path), max_disk_bytes="1G")
    with pytest.raises(ValueError, match="cold_bits.*cache_dir"):
        mk.PrefixCache(model("llama"), cold_bits=8)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_long_prompts_are_checked_in_vectorised_passes(monkeypatch):
    """A 100k-token prompt is checked in a few passes in C (types, range), never a Python
    step per token — and an id out of range is still named with its position."""
    from mlx_kvcache.generation import validation

    def per_token(_):
        raise AssertionError("a Python call per token")
    monkeypatch.setattr(validation, "is_int", per_token)
    n = 100_000
    ok = [i % V for i in range(n)]
    for prompt in (ok, tuple(ok), np.asarray(ok, dtype=np.int32), mx.array(ok)):
        ids = validation.prompt_token_ids(TOK, prompt, V)
        assert len(ids) == n and ids[-1] == ok[-1] and not ids.flags.writeable
    for prompt in (ok[:-1] + [V], np.asarray(ok[:-1] + [V])):
        with pytest.raises(ValueError, match=f"token id {V} at prompt position {n - 1} .*vocab size {V}"):
            validation.prompt_token_ids(TOK, prompt, V)
    with pytest.raises(ValueError, match=f"token id {2**64 - 1} at prompt position 1"):
        validation.prompt_token_ids(TOK, np.array([1, 2**64 - 1], dtype=np.uint64), V)
