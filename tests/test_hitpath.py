"""The hit path's copies and counters: a restore makes one copy of the KV it brings back
(with room for the rest of the prompt) and none of a window or a recurrent state, the
server's fetch hands mlx-lm that buffer as it is, and the per-request statistics come
from counters. Memory is measured with ``mx.get_active_memory()`` / peak memory."""

from __future__ import annotations

import gc
import logging
import random
import types

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.caches import KVCache, RecurrentCache, RotatingKVCache, make_prompt_cache
from mlx_kvcache.prefix.manager import PrefixManager
from mlx_kvcache.serving import TriePromptCache
from models import V, build

KEY = ("model", None, None)
MiB = 1 << 20


def settled() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def provider(m):
    return types.SimpleNamespace(model=m, tokenizer=None, draft_model=None, model_key=KEY)


# -- what a restore copies ---------------------------------------------------------------------
def test_kv_restore_makes_room_for_the_rest_of_the_prompt():
    c = KVCache()
    c.update(rand((1, 2, 700, 8), 0), rand((1, 2, 700, 8), 1))
    s = c.snapshot(0)
    r = KVCache()
    assert r.restore_chain([s], 640, room=900)
    assert r.offset == 640 and r.keys.shape[2] >= 640 + 900 and r.keys.shape[2] % 256 == 0
    before = r.keys.shape[2]
    r.update(rand((1, 2, 900, 8), 2), rand((1, 2, 900, 8), 3))
    assert r.keys.shape[2] == before  # written in place: no second copy to grow
    assert np.array_equal(np.array(r.keys[..., :640, :]), np.array(c.keys[..., :640, :]))


def test_a_restored_kv_buffer_is_the_caches_own():
    """The restore's one buffer (built from 8-byte views of the snapshots) belongs to the
    cache alone: a decode step writes into it in place, no copy of the whole buffer."""
    for dtype in (mx.float32, mx.bfloat16):
        c = KVCache()
        k = rand((1, 4, 20000, 64), 0).astype(dtype)
        c.update(k, k)
        head, tail = KVCache().split(c.snapshot(0), 7000)
        r = KVCache()
        assert r.restore_chain([head, tail], 19000, room=10)
        mx.eval(r.keys, r.values)
        assert r.keys.dtype == dtype and r.keys.shape == (1, 4, 19200, 64)
        assert np.array_equal(np.array(r.keys[..., :19000, :].astype(mx.float32)),
                              np.array(k[..., :19000, :].astype(mx.float32)))
        x = rand((1, 4, 1, 64), 1).astype(dtype)
        mx.eval(x)
        settled()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        r.update(x, x)
        mx.eval(r.keys, r.values)
        assert mx.get_peak_memory() - base < r.keys.nbytes // 8, (mx.get_peak_memory() - base)


def test_checkout_restores_kv_with_room_for_the_whole_prompt():
    m = build("llama")
    mgr = PrefixManager(lambda: make_prompt_cache(m), max_bytes=1 << 30)
    seq = [random.Random(0).randrange(V) for _ in range(300)]
    caches = make_prompt_cache(m)
    m(mx.array(seq)[None], cache=caches)
    mgr.record(caches, seq)
    prompt = seq + list(range(1, 600))
    live, plan = mgr.checkout(np.asarray(prompt))
    assert plan.restored == 300
    for c in live.leaves:
        assert c.keys.shape[2] >= len(prompt) + 1  # the prefill of 599 tokens writes in place


def test_window_and_state_restores_copy_nothing():
    w = RotatingKVCache(2048)
    w.update(rand((1, 8, 3000, 64), 0), rand((1, 8, 3000, 64), 1))
    snap = w.snapshot(0)
    r = RecurrentCache(2)
    r[0] = rand((1, 3, 4096), 2)
    r[1] = rand((1, 16, 128, 128), 3)
    r.advance(5)
    rsnap = r.snapshot(0)
    mx.eval(snap.keys, rsnap.slots)
    base = settled()
    w2, r2 = RotatingKVCache(2048), RecurrentCache(2)
    assert w2.restore(snap, snap.to_offset) and r2.restore(rsnap, rsnap.to_offset)
    mx.eval(w2.keys, w2.values, *r2.cache)
    assert settled() - base < MiB // 4  # handles on the snapshots' buffers, not copies
    frozen = np.array(snap.keys), np.array(rsnap.slots[1])
    w2.update(rand((1, 8, 1, 64), 4), rand((1, 8, 1, 64), 5))  # in place: copies first
    r2[1] = r2[1] * 2
    mx.eval(w2.keys, r2.cache[1])
    assert np.array_equal(np.array(snap.keys), frozen[0])
    assert np.array_equal(np.array(rsnap.slots[1]), frozen[1])


# -- the server's fetch --------------------------------------------------------------------------
def served(m, prompt, cache, n=2):
    out = []
    for (t, lp), _ in zip(generate_step(mx.array(prompt), m, prompt_cache=cache, max_tokens=n), range(n)):
        out.append(int(t))
    return out


def test_fetch_hands_mlx_lm_a_buffer_it_writes_in_place():
    m = build("llama", num_key_value_heads=4, head_dim=64)
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    rng = random.Random(1)
    head = [rng.randrange(V) for _ in range(3000)]
    cache = mlc.make_prompt_cache(m)
    gen = served(m, head, cache)  # one step ahead: its cache holds every yielded token
    pc.insert_cache(KEY, head + gen, cache)
    del cache
    prompt = head + gen + [5, 6, 7]
    got, rest = pc.fetch_nearest_cache(KEY, prompt)
    assert rest == [5, 6, 7]
    kv = [c for c in got if isinstance(c, mlc.KVCache)]
    assert kv and all(c.keys.shape[2] >= len(prompt) + 1 for c in kv)
    mx.eval([(c.keys, c.values) for c in kv])
    held = sum(c.keys.nbytes + c.values.nbytes for c in kv)
    settled()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    served(m, rest, got)
    # Serving the rest adds its own few rows and activations, never a second buffer.
    assert mx.get_peak_memory() - base < held // 4, (mx.get_peak_memory() - base, held)


def test_request_log_line_finds_its_fetch_among_several(caplog):
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    a = list(range(1, 60))
    b = [7] + list(range(1, 40))
    caplog.set_level(logging.INFO, logger="mlx_kvcache")
    ca, _ = pc.fetch_nearest_cache(KEY, a)
    cb, _ = pc.fetch_nearest_cache(KEY, b)  # two requests in flight
    for prompt, fetched in ((b, cb), (a, ca)):
        cache = mlc.make_prompt_cache(m)
        gen = served(m, prompt, cache, 3)
        pc.insert_cache(KEY, prompt[:20], _prefix_cache(m, prompt[:20]), cache_type="user")
        pc.insert_cache(KEY, prompt + gen, cache)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[cache]")]
    assert len(lines) == 2  # the segment inserts log nothing
    assert lines[0].startswith(f"[cache] prompt {len(b)} tok") and "answer 3 tok" in lines[0]
    assert lines[1].startswith(f"[cache] prompt {len(a)} tok")
    assert not pc._log._pending


def test_request_token_log_has_each_requests_prompt_and_answer(tmp_path, monkeypatch):
    """``MLX_KVCACHE_REQUEST_LOG``: one JSON line per finished request, its prompt's and
    answer's ids (what the agents benchmark replays), none for a segment insert."""
    import json
    path = tmp_path / "requests.jsonl"
    monkeypatch.setenv("MLX_KVCACHE_REQUEST_LOG", str(path))
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    a = list(range(1, 30))
    for prompt in (a, a + [3, 4, 5, 9]):
        fetched, rest = pc.fetch_nearest_cache(KEY, prompt)
        cache = fetched if fetched is not None else mlc.make_prompt_cache(m)
        gen = served(m, rest, cache, 3)
        pc.insert_cache(KEY, prompt + gen, cache)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [a, a + [3, 4, 5, 9]]
    assert [len(r["answer"]) for r in rows] == [3, 3]
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] > 0


def _prefix_cache(m, tokens):
    cache = mlc.make_prompt_cache(m)
    m(mx.array(tokens)[None], cache=cache)
    return cache


# -- per-request statistics from counters ------------------------------------------------------
def test_stats_by_type_and_len_are_counters_equal_to_a_recount():
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=60_000)
    rng = random.Random(2)
    system = [rng.randrange(V) for _ in range(12)]
    for i in range(12):
        user = system + [rng.randrange(V) for _ in range(rng.randrange(3, 12))]
        pc.insert_cache(KEY, system, _prefix_cache(m, system), cache_type="system")
        pc.insert_cache(KEY, user, _prefix_cache(m, user), cache_type="user")
        full = user + [rng.randrange(V) for _ in range(4)]
        pc.insert_cache(KEY, full, _prefix_cache(m, full), cache_type="assistant")
        if i % 4 == 3:
            pc.trim_to(n_sequences=rng.randrange(2, 8))
        trie = pc._model.manager.trie
        trie.check_invariants()
        recount = {t: {"n_sequences": 0, "n_bytes": 0} for t in ("assistant", "user", "system")}
        for n in trie.nodes():
            row = recount[n.label or "assistant"]
            row["n_sequences"] += 1
            row["n_bytes"] += n.nbytes
        assert pc.stats_by_type() == recount
        assert len(pc) == sum(1 for _ in trie.nodes()) == pc.report()["nodes"]
    assert pc.stats_by_type()["system"]["n_sequences"] >= 1  # labels survive the evictions
