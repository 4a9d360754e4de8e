"""The server's request path on one machine: mlx-lm's batch extraction as views, disk
captures that wait for an idle batch, a disk writer that waits while a request is in
flight, and the profile of the request's phases."""

from __future__ import annotations

import random
import time
import types

import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.serving.cache import extract, sequential
from mlx_kvcache.serving.cache.idle_writes import IdleWrites
from mlx_kvcache.serving.cache.profile import Profile
from mlx_kvcache.store.autosave import Autosaver
from models import V, build

KEY = ("model", None, None)


def provider(m):
    return types.SimpleNamespace(model=m, tokenizer=None, draft_model=None, model_key=KEY)


def prefilled(m, prompt):
    cache = mlc.make_prompt_cache(m)
    m(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def decode(m, prompt, cache=None, n=4):
    cache = cache if cache is not None else mlc.make_prompt_cache(m)
    return [(int(t), lp) for (t, lp), _ in zip(
        generate_step(mx.array(prompt), m, prompt_cache=cache, max_tokens=n), range(n))]


def batch_of(m, prompts):
    """Each layer's `BatchKVCache` holding ``prompts`` (left-padded), as mlx-lm merges them."""
    per_prompt = [prefilled(m, p) for p in prompts]
    return [mlc.BatchKVCache.merge([pc[i] for pc in per_prompt]) for i in range(len(per_prompt[0]))]


def test_extracted_views_hold_mlx_lm_rows_and_are_released():
    m = build("llama")
    a, b = [(3 * i + 1) % V for i in range(23)], [(5 * i + 2) % V for i in range(9)]
    batch = batch_of(m, [a, b])
    expected = [(c.keys[1:2, :, 23 - 9:], c.values[1:2, :, 23 - 9:]) for c in batch]
    extract.install()
    extract.install()  # once per process
    got = [c.extract(1) for c in batch]
    for c, (k, v) in zip(got, expected):
        assert type(c) is mlc.KVCache and c.offset == 9
        assert mx.array_equal(c.keys, k) and mx.array_equal(c.values, v)
    extract.release(got)
    assert all(c.keys is None and c.values is None for c in got)
    extract.release([mlc.KVCache()])  # not extracted: left alone


def test_an_insert_of_extracted_views_restores_to_cold_log_probs():
    m = build("llama")
    a, b = [(3 * i + 1) % V for i in range(23)], [(5 * i + 2) % V for i in range(17)]
    batch = batch_of(m, [a, b])
    extract.install()
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    for i, p in enumerate((a, b)):
        row = [c.extract(i) for c in batch]
        pc.insert_cache(KEY, p, row)
        assert all(c.keys is None for c in row)  # released once stored
    # the batch's arrays are untouched by the extraction and the release
    for c in batch:
        c.update_and_fetch(mx.zeros((2, c.keys.shape[1], 1, c.keys.shape[3])),
                           mx.zeros((2, c.values.shape[1], 1, c.values.shape[3])))
    got, rest = pc.fetch_nearest_cache(KEY, b + [4, 5])
    assert rest == [4, 5]
    out, cold = decode(m, rest, got), decode(m, b + [4, 5])
    assert [t for t, _ in out] == [t for t, _ in cold]
    assert max(mx.abs(x - y).max().item() for (_, x), (_, y) in zip(out, cold)) < 1e-4


def test_idle_writes_wait_for_idle_unless_too_many_or_too_old():
    w = IdleWrites(limit=3, max_age=3600)
    assert not w.changed() and not w.changed()
    assert w.changed()  # the third: due now, busy or not
    w.taken()
    assert w.pending == 0 and not w.changed()
    old = IdleWrites(limit=100, max_age=0.0)
    assert old.changed()


def test_disk_captures_wait_for_idle_and_the_profile_times_each_phase(tmp_path):
    m = build("llama")
    prof = Profile(timing=True)
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, cache_dir=str(tmp_path),
                         profile=prof)
    prompt = [(7 * i + 3) % V for i in range(30)]
    pc.fetch_nearest_cache(KEY, prompt)
    pc.insert_cache(KEY, prompt, prefilled(m, prompt))
    pc.flush(timeout=60)
    assert not list(tmp_path.rglob("*.safetensors"))  # nothing captured while busy
    assert pc.report()["disk_writes_pending"]
    pc.idle()  # the generation loop has no request in flight
    assert pc.flush(timeout=60)
    assert list(tmp_path.rglob("*.safetensors"))
    assert not pc.report()["disk_writes_pending"]
    got, rest = pc.fetch_nearest_cache(KEY, prompt + [1, 2])
    assert rest == [1, 2]
    seconds = prof.snapshot()["seconds"]
    for phase in ("restore", "record", "native", "explain", "lock", "persist.capture",
                  "bg.write", "bg.encode", "bg.file"):
        assert seconds.get(f"time.{phase}", 0) > 0, phase
        assert f"cpu.{phase}" in seconds, phase
    pc.close()


def test_the_disk_writer_waits_while_a_request_is_in_flight():
    written = []
    w = Autosaver(lambda *plan: written.append(plan) or 0, settle=0.05, max_delay=3600)
    w.busy()
    w.submit(("first",))
    time.sleep(0.3)
    assert written == []  # a request is in flight: nothing written yet
    w.submit(("second",))  # supersedes the first (it holds everything the first did)
    w.idle()
    assert w.flush(timeout=60) and written == [("second",)]
    # a flush writes at once, busy or not
    w.busy()
    w.submit(("third",))
    assert w.flush(timeout=60) and written[-1] == ("third",)
    # a server that never idles still persists, `max_delay` after the submit
    late = Autosaver(lambda *plan: written.append(plan) or 0, settle=0.05, max_delay=0.2)
    late.busy()
    late.submit(("late",))
    deadline = time.monotonic() + 60
    while written[-1] != ("late",) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert written[-1] == ("late",)
    # idle long enough: written after `settle`, with no flush
    w.idle()
    w.submit(("idle",))
    while written[-1] != ("idle",) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert written[-1] == ("idle",)
    # writes the owner calls pressing (a memory tier near its budget) go at once, busy or not
    pressed = [False]
    urgent = Autosaver(lambda *plan: written.append(plan) or 0, settle=0.05, max_delay=3600,
                       pressing=lambda: pressed[0])
    urgent.busy()
    urgent.submit(("urgent",))
    time.sleep(0.2)
    assert written[-1] != ("urgent",)
    pressed[0] = True
    while written[-1] != ("urgent",) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert written[-1] == ("urgent",)
    for x in (w, late, urgent):
        x.close()


def sequential_turn(pc, m, prompt, n=3):
    """One request on mlx-lm's sequential path (as `_serve_single`): fetch, prefill the
    rest and decode ``n`` tokens into the fetched caches, insert what they absorbed."""
    seq = sequential.SequentialRequest(prompt=list(prompt), prefill_step=64)
    with sequential.serving(seq):
        caches, rest = pc.fetch_nearest_cache(KEY, prompt)
        if caches is None:
            caches = mlc.make_prompt_cache(m)
        out = decode(m, rest, caches, n)
        fed = next(c.offset for c in caches if hasattr(c, "offset")) - len(prompt)  # a step ahead
        pc.insert_cache(KEY, list(prompt) + [t for t, _ in out][:fed], caches)
    return out, caches, len(prompt) - len(rest)


def close_to(out, cold):
    assert [t for t, _ in out] == [t for t, _ in cold]
    assert max(mx.abs(x - y).max().item() for (_, x), (_, y) in zip(out, cold)) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_a_sequential_request_continues_from_the_last_ones_caches_in_place(kind):
    m, rng = build(kind), random.Random(7)
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, checkpoint_interval=16)
    system = [rng.randrange(1, V) for _ in range(40)]
    a = system + [rng.randrange(1, V) for _ in range(9)]
    out, first, _ = sequential_turn(pc, m, a)
    close_to(out, decode(m, a, n=3))
    mgr = pc._model.manager
    assert mgr.idle_bytes > 0 and pc.nbytes == mgr.trie.nbytes + mgr.idle_bytes
    kept = [c.keys for c in first if isinstance(c, mlc.KVCache)]
    # the next turn of that conversation: its attention rows are the very arrays, not a copy
    b = a + [t for t, _ in out] + [rng.randrange(1, V) for _ in range(7)]
    out, second, cached = sequential_turn(pc, m, b)
    close_to(out, decode(m, b, n=3))
    assert cached >= len(a) + 2 - 1
    again = [c.keys for c in second if isinstance(c, mlc.KVCache)]
    assert kept and len(kept) == len(again) and all(x is y for x, y in zip(kept, again))
    # another session sharing the system prompt continues from the kept caches too, and
    # the turn before it stays restorable from the trie
    c = system + [rng.randrange(1, V) for _ in range(11)]
    out, _, cached = sequential_turn(pc, m, c)
    close_to(out, decode(m, c, n=3))
    assert cached >= len(system) - 16
    out, _, cached = sequential_turn(pc, m, b)
    close_to(out, decode(m, b, n=3))
    assert cached >= len(b) - 16
    # a ceiling below what is held drops the kept caches first (the trie holds their tokens)
    held = mgr.trie.nbytes
    pc.trim_to(n_bytes=held)
    assert mgr.idle_bytes == 0 and mgr.trie.nbytes == held
    out, _, _ = sequential_turn(pc, m, c)
    close_to(out, decode(m, c, n=3))


def test_with_kv_bits_the_sequential_fetch_prefills_all_but_the_last_token():
    """``--kv-bits``: the fetch prefills the prompt but its last token itself (its passes
    attend over the dequantized rows), and mlx-lm gets that one token; the first step
    equals a canonical cold run. Without kv-bits mlx-lm still prefills what follows the
    last stop."""
    from mlx_kvcache.caches import QuantizedKVCache

    m, rng = build("llama", head_dim=32), random.Random(11)
    prompt = [rng.randrange(1, V) for _ in range(150)]
    quant = types.SimpleNamespace(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    pc = TriePromptCache(types.SimpleNamespace(**vars(provider(m)), cli_args=quant),
                         max_bytes=1 << 30, checkpoint_interval=64)
    seq = sequential.SequentialRequest(prompt=list(prompt), prefill_step=64)
    with sequential.serving(seq):
        caches, rest = pc.fetch_nearest_cache(KEY, prompt)
    assert rest == prompt[-1:] and seq.handed == len(prompt) - 1
    assert all(type(c) is mlc.QuantizedKVCache and c.offset == len(prompt) - 1 for c in caches)
    got = m(mx.array([rest]), cache=caches)[0, -1]
    cold = [QuantizedKVCache(32, 8, 0) for _ in m.layers]
    m(mx.array([prompt[:-1]]), cache=cold)
    want = m(mx.array([prompt[-1:]]), cache=cold)[0, -1]
    assert mx.abs((got - mx.logsumexp(got)) - (want - mx.logsumexp(want))).max().item() < 1e-4
    pc.close()
    plain = TriePromptCache(provider(m), max_bytes=1 << 30, checkpoint_interval=64)
    seq = sequential.SequentialRequest(prompt=list(prompt), prefill_step=64)
    with sequential.serving(seq):
        _, rest = plain.fetch_nearest_cache(KEY, prompt)
    assert len(rest) > 1  # mlx-lm prefills past the last stop, as before
    plain.close()
