"""The server's prompt-cache seam (`serving/cache/`), in process: what fetch hands out,
what insert stores, checkpoints, the budget, the disk tier's captures, padded batch rows
and what the explanations show."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.serving import TriePromptCache
from models import OpaqueStateCache, V, build

KEY = ("model", None, None)


@dataclass
class Provider:
    """mlx-lm's ``ModelProvider`` as the prompt cache reads it: the loaded model, its
    tokenizer (None: explanations show ids) and draft, its key, whether mlx-lm batches it."""

    model: Any
    tokenizer: Any = None
    draft_model: Any = None
    model_key: Any = KEY
    is_batchable: bool = False


def provider(m) -> Provider:
    return Provider(m)


def served(m, prompt, cache=None, n=4):
    """What the server's sequential path does: generate on ``cache`` (mlx-lm's classes),
    returning the tokens, log-probs and the cache (now holding prompt + generated)."""
    cache = cache if cache is not None else mlc.make_prompt_cache(m)
    out = []
    for (t, lp), _ in zip(generate_step(mx.array(prompt), m, prompt_cache=cache, max_tokens=n), range(n)):
        out.append((int(t), lp))
    return out, cache


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_fetch_insert_round_trip_never_aliases(name):
    m = build(name)
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, checkpoint_interval=8)
    prompt = [(7 * i + 3) % V for i in range(30)]
    miss, rest = pc.fetch_nearest_cache(KEY, prompt)
    assert rest == prompt and (miss is None or all(
        getattr(c, "offset", 0) == 0 and getattr(c, "keys", None) is None for c in miss))
    ref, cache = served(m, prompt)
    # mlx-lm's generate_step is one step ahead: its cache holds every yielded token.
    full = prompt + [t for t, _ in ref]
    pc.insert_cache(KEY, full, cache)
    before = pc.nbytes
    for _ in range(2):  # the second fetch proves the first one's writes left the trie alone
        got, rest = pc.fetch_nearest_cache(KEY, full + [5, 6])
        assert rest == [5, 6]
        assert all(isinstance(c, (mlc.KVCache, mlc.RotatingKVCache, mlc.ArraysCache)) for c in got)
        out, _ = served(m, rest, got)  # writes into the fetched arrays
        cold, _ = served(m, full + [5, 6])
        assert [t for t, _ in out] == [t for t, _ in cold]
        assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(out, cold)) < 1e-4
    assert pc.nbytes == before
    # An exact repeat never returns an empty rest.
    got, rest = pc.fetch_nearest_cache(KEY, prompt)
    assert len(rest) >= 1


def test_caching_off_stores_nothing_and_says_why(tmp_path):
    """A model whose caches cannot be snapshotted: mlx-lm computes every prompt whole, the
    cache reports zeros and why (``GET /v1/cache``), and every verb of the seam still
    answers (the null manager: `prefix.null`)."""
    m = build("llama")
    m.make_cache = lambda: [OpaqueStateCache() for _ in m.layers]
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, checkpoint_interval=8,
                         cache_dir=str(tmp_path / "c"))
    prompt = [(7 * i + 3) % V for i in range(20)]
    for _ in range(2):
        assert pc.checkpoints(KEY, prompt) == []
        assert pc.fetch_nearest_cache(KEY, prompt) == (None, prompt)
        ref, cache = served(m, prompt)
        pc.insert_cache(KEY, prompt + [t for t, _ in ref], cache)
        pc.trim_to(n_sequences=1, n_bytes=0)
        pc.end_turn(pc.turn_flags())
        pc.idle()
    assert not pc.stores_prompts() and pc.nbytes == 0 and len(pc) == 0
    pc.idle_work.foresee("s", prompt + [1, 2])  # nothing is computed ahead where nothing is stored
    pc.ahead(lambda: False, 8)
    assert pc.report()["foresight"]["queued"] == 0 and len(pc) == 0
    assert pc.turn_flags() == [0, 0]
    assert all(r == {"n_sequences": 0, "n_bytes": 0} for r in pc.stats_by_type().values())
    rep = pc.report()
    assert rep["enabled"] is False and "OpaqueStateCache" in rep["disabled_because"]
    assert (rep["bytes_held"], rep["nodes"], rep["layers"], rep["disk_bytes"]) == (0, 0, 0, 0)
    assert rep["cache_dir"] is None and rep["kv_bits"] is None and "disk_nodes" not in rep
    assert rep["requests"] == 0 and rep["cached_tokens"] == 0
    assert rep["recent"] == []  # a request is listed at its final insert: none is stored
    assert pc.clear()["cleared"] is True
    pc.close()
    assert not (tmp_path / "c").exists()


def test_a_batch_fetch_is_merged_from_the_tries_arrays_like_mlx_lm_merges_copies(monkeypatch):
    """On the batch path a restored attention layer reaches mlx-lm's merge as the arrays
    the restore would have concatenated (one copy of each reused row, not two); the batch
    cache is mlx-lm's own, value for value, whatever else is in the batch."""
    from mlx_kvcache.caches import KVCache
    from mlx_kvcache.serving.cache.restored_merge import RestoredKVCache
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    base = [(5 * i + 1) % V for i in range(40)]
    for tail in ([3, 4, 5, 6], [9, 8, 7, 6, 5, 4]):  # two branches: a path of two nodes
        _, cache = served(m, base + tail)
        pc.insert_cache(KEY, base + tail + [0] * 4, cache)
    fetched = [pc.fetch_nearest_cache(KEY, base + [3, 4, 5, 6, 1, 2])[0],
               pc.fetch_nearest_cache(KEY, base[:25] + [2, 2])[0]]
    assert all(type(c) is RestoredKVCache for f in fetched for c in f)
    assert len(fetched[0][0].parts[0]) == 2 and len(fetched[1][0].parts[0]) == 1
    _, plain = served(m, [4] * 7)  # a cache that is not ours in the same batch, and an empty one
    miss, rest = pc.fetch_nearest_cache(KEY, [V - 1] * 5)
    assert rest == [V - 1] * 5 and all(type(c) is RestoredKVCache and c.offset == 0 for c in miss)
    rows = fetched + [plain, mlc.make_prompt_cache(m)]

    def copied(c):  # what a fetch handed over before: evaluated buffers, mlx-lm's class
        n = mlc.KVCache()
        if c.keys is not None:
            n.keys, n.values, n.offset = mx.array(c.keys), mx.array(c.values), c.offset
        return n
    for layer in range(len(rows[0])):
        layer_rows = [r[layer] for r in rows]
        ours = layer_rows[0].merge(layer_rows)
        ref = mlc.BatchKVCache.merge([copied(c) for c in layer_rows])
        assert type(ours) is type(ref)
        for a, b in ((ours.keys, ref.keys), (ours.values, ref.values), (ours.offset, ref.offset),
                     (ours.left_padding, ref.left_padding)):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
        assert ours._idx == ref._idx
        # A batch led by a miss (an empty cache of ours) merges the same way.
        led = miss[layer].merge([miss[layer]] + layer_rows)
        ref = mlc.BatchKVCache.merge([copied(c) for c in [miss[layer]] + layer_rows])
        for a, b in ((led.keys, ref.keys), (led.values, ref.values), (led.offset, ref.offset),
                     (led.left_padding, ref.left_padding)):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
    # A batch cache laid out otherwise (another mlx-lm) keeps mlx-lm's own copy.
    real = mlc.BatchKVCache.merge
    layer_rows = [r[0] for r in rows]
    want = real([copied(c) for c in layer_rows])
    built = []

    def other_layout(caches):
        out = real(caches)
        out.left_padding = out.left_padding[::-1]
        built.append(out.keys)
        return out
    monkeypatch.setattr(mlc.BatchKVCache, "merge", staticmethod(other_layout))
    kept = layer_rows[0].merge(layer_rows)
    assert kept.keys is built[0] and mx.array_equal(kept.keys, want.keys).item()
    monkeypatch.undo()
    # A layer written after its restore no longer offers the restore's arrays.
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    snap = c.snapshot()
    d = KVCache()
    assert d.restore_chain([snap], 3) and d.restored_parts() is not None
    d.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert d.restored_parts() is None
    assert d.restore_chain([snap], 2) and d.trim(1) == 1 and d.restored_parts() is None


def test_eviction_writes_what_the_idle_batch_would_have_before_dropping_it(tmp_path):
    """The server captures for the disk only while its batch is idle; a budget that
    evicts before then (a queue that never idles) captures and writes those inserts
    first, so their nodes are parked, not dropped, and the next request reads them back."""
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, cache_dir=str(tmp_path / "cache"))
    pc.prepare(KEY)
    prompt = [(3 * i + 2) % V for i in range(40)]
    out, cache = served(m, prompt)
    full = prompt + [t for t, _ in out]
    pc.insert_cache(KEY, full, cache)
    before = pc.report()
    assert before["disk_writes_pending"] and before["nodes"] > 0 and before["disk_nodes"] == 0
    pc.trim_to(n_bytes=0)  # (no idle moment came)
    after = pc.report()
    assert after["nodes"] == after["disk_nodes"] == before["nodes"], after
    assert after["bytes_held"] == 0 and not after["disk_writes_pending"]
    got, rest = pc.fetch_nearest_cache(KEY, full + [5, 6])
    assert rest == [5, 6] and pc.report()["disk_tokens"] == len(full)
    ref, _ = served(m, full + [5, 6])
    mine, _ = served(m, rest, got)
    assert [t for t, _ in mine] == [t for t, _ in ref]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(mine, ref)) < 1e-4
    pc.close()


def test_insert_refuses_a_cache_that_does_not_hold_the_tokens(caplog):
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    prompt = list(range(1, 20))
    _, cache = served(m, prompt)
    with caplog.at_level("INFO", logger="mlx_kvcache"):
        pc.insert_cache(KEY, prompt, cache)  # holds prompt + 4 generated: not these 19 tokens
        assert len(pc) == 0 and pc.nbytes == 0
        pc.insert_cache(KEY, prompt, [mlc.QuantizedKVCache() for _ in m.layers])
        assert len(pc) == 0
    # refused with the one warning, never by an exception inside the insert
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert any("not caching" in r.getMessage() for r in caplog.records)


def test_budget_trim_and_stats():
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=20_000)
    for k in range(6):
        prompt = [k + 1] + list(range(10, 40))
        out, cache = served(m, prompt)
        pc.insert_cache(KEY, prompt + [t for t, _ in out], cache, cache_type="assistant")
        assert pc.nbytes <= 20_000
    st = pc.stats_by_type()
    assert set(st) >= {"assistant", "user", "system"}
    assert st["assistant"]["n_bytes"] == pc.nbytes
    rep = pc.report()
    assert rep["evicted_bytes"] > 0 and rep["bytes_held"] == pc.nbytes
    pc.trim_to(n_bytes=0)
    assert pc.nbytes == 0
    assert bool(pc) and len(pc) == 0


def test_checkpoints_only_for_models_that_need_them():
    hybrid = TriePromptCache(provider(build("qwen3_next")), max_bytes=1 << 30, checkpoint_interval=16)
    # every interval, the last token; not the stop before the end (65), one token above
    # the interval's 64 (`planner.guess_spacing`)
    assert hybrid.checkpoints(KEY, list(range(1, 70))) == [16, 32, 48, 64, 68]
    assert hybrid.checkpoints(KEY, list(range(1, 78))) == [16, 32, 48, 64, 73, 76]
    # a chat whose next request goes on past the answer (`templates`): no guess at 73
    assert hybrid.checkpoints(KEY, list(range(1, 78)), guess_end=False) == [16, 32, 48, 64, 76]
    plain = TriePromptCache(provider(build("llama")), max_bytes=1 << 30, checkpoint_interval=16)
    assert plain.checkpoints(KEY, list(range(1, 70))) == []


def test_excerpts_off_leave_no_prompt_text(caplog):
    m = build("llama")
    texts = {t: chr(65 + t % 26) for t in range(V)}
    prov = provider(m)
    prov.tokenizer = types.SimpleNamespace(decode=lambda ids, **k: "".join(texts[i] for i in ids))
    for shown in (True, False):
        pc = TriePromptCache(prov, max_bytes=1 << 30, excerpts=shown)
        a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        b = [1, 2, 3, 4, 5, 20, 21, 22, 23]
        for p in (a, b):
            cache, rest = pc.fetch_nearest_cache(KEY, p)
            _, cache = served(m, rest, cache, n=2)
            pc.insert_cache(KEY, p + [0, 0], cache)
        reuse = pc.report()["recent"][-1]["reuse"]
        assert reuse["diverged_at"] == 5 and reuse["excerpts"] is shown
        assert ("GHIJ" in reuse["cached"]) is shown and ("UVW" in reuse["prompt"]) is shown


def test_tracked_arrays_cache_remembers_padded_rows():
    from mlx_kvcache.serving.cache.padding import TrackedArraysCache, was_padded

    rows = [TrackedArraysCache(2) for _ in range(3)]
    b = TrackedArraysCache.merge(rows)
    assert isinstance(b, TrackedArraysCache) and b.padded == [False] * 3
    b.prepare(lengths=[4, 2, 4], right_padding=[0, 2, 0])
    b[0], b[1] = mx.zeros((3, 4)), mx.zeros((3, 2))
    assert b.padded == [False, True, False]
    b.filter([1, 2])
    assert b.padded == [True, False]
    other = TrackedArraysCache.merge([TrackedArraysCache(2)])
    other[0], other[1] = mx.zeros((1, 4)), mx.zeros((1, 2))
    b.extend(other)
    assert b.padded == [True, False, False]
    assert was_padded([b.extract(0)]) and not was_padded([b.extract(2)])


@pytest.mark.parametrize("name,exact", [("mamba", False), ("qwen3_next", True), ("llama", True)])
def test_a_padded_batch_row_is_stored_only_where_exact(name, exact):
    """mlx-lm's batch path with two prompts of different lengths, through the server's
    seam: the longer row is never padded and is stored; the shorter one is padded, and its
    state is stored only where the check at load found padded rows exact."""
    from mlx_lm.generate import BatchGenerator

    from mlx_kvcache.serving.cache.padding import padded_rows_exact

    m = build(name)
    assert all(padded_rows_exact(m, V).values()) == exact
    pc = TriePromptCache(Provider(m, is_batchable=True),
                         max_bytes=1 << 30, checkpoint_interval=1 << 20)
    long, short = [(5 * i + 1) % V for i in range(40)], [(3 * i + 2) % V for i in range(12)]
    fetched = [pc.fetch_nearest_cache(KEY, p) for p in (long, short)]
    bg = BatchGenerator(m, completion_batch_size=4, prefill_batch_size=4)
    bg.insert([long, short], max_tokens=[2, 2], caches=[c for c, _ in fetched],
              all_tokens=[[], []])
    done = {}
    while len(done) < 2:
        for r in bg.next()[1]:
            if r.finish_reason is not None:
                done[r.uid] = r
    for r in done.values():
        pc.insert_cache(KEY, r.all_tokens, r.prompt_cache)
    tokens = [done[u].all_tokens for u in sorted(done)]
    assert len(pc.fetch_nearest_cache(KEY, tokens[0] + [7])[1]) == 1  # the long row: a hit
    restored = len(tokens[1]) + 1 - len(pc.fetch_nearest_cache(KEY, tokens[1] + [7])[1])
    assert (restored == len(tokens[1])) == exact, restored


def test_one_reading_of_the_counters_is_what_get_v1_cache_shows():
    from mlx_kvcache.serving.guards.counters import GuardCounters, Refusal

    m = build("llama")
    counted = GuardCounters()
    pc = TriePromptCache(provider(m), max_bytes=1 << 30, guard_counters=counted)
    prompt = [(11 * i + 4) % V for i in range(30)]
    for _ in range(2):  # the same prompt twice: the second restores all but its last token
        cache, rest = pc.fetch_nearest_cache(KEY, prompt)
        out, cache = served(m, rest, cache)
        pc.insert_cache(KEY, prompt + [t for t, _ in out], cache)
    counted.refused(Refusal.MEMORY)
    counted.waited(0.2)
    now = pc.counters_now()
    assert (now.requests, now.prompt_tokens, now.restored_tokens, now.computed_tokens) == \
        (2, 60, 29, 31)
    assert (now.ram_bytes, now.nodes, now.disk_bytes, now.disk_tokens) == (pc.nbytes, len(pc), 0, 0)
    assert now.refusals == {"memory": 1, "memory_never_fits": 0, "stopping": 0,
                            "context": 0, "bad_input": 0}
    assert now.queue_wait.count == 1 and now.queue_wait.seconds == 0.2
    rep = pc.report()
    assert rep["counters"] == now.as_dict()
    assert (rep["requests"], rep["prompt_tokens"], rep["cached_tokens"], rep["bytes_held"],
            rep["nodes"]) == (2, 60, 29, now.ram_bytes, now.nodes)
    assert rep["counters"]["queue_wait"]["buckets"][-1] == [300.0, 1]
    pc.clear()
    assert pc.counters_now().clears == 1 and pc.counters_now().requests == 2  # totals stay
