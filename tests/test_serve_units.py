"""The server's prompt-cache seam, in process: what fetch hands out, what insert stores,
segment splitting and the mlx-lm version guard."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import types

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.serving import app, seam
from mlx_kvcache.serving.engine.generator import split_segments
from models import OpaqueStateCache, V, build

KEY = ("model", None, None)


def provider(m):
    return types.SimpleNamespace(model=m, tokenizer=None, draft_model=None, model_key=KEY)


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
    pc.foresee("s", prompt + [1, 2])  # nothing is computed ahead where nothing is stored
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


def test_split_segments():
    segs, kinds = split_segments([[1, 2, 3], [4, 5, 6, 7, 8], [9]], ["system", "user", "assistant"],
                                 [2, 3, 5, 7, 9, 20])
    assert segs == [[1, 2], [3], [4, 5], [6, 7], [8], [9]]
    assert kinds == ["system", "system", "user", "user", "user", "assistant"]
    assert split_segments([[1, 2]], ["user"], []) == ([[1, 2]], ["user"])


def test_seam_probe_and_one_line_exit(monkeypatch, capsys):
    from mlx_lm import server as S

    assert seam.check() is None  # the installed mlx-lm is a supported one
    monkeypatch.setattr("mlx_lm.__version__", "0.40.0")
    assert "outside the tested range" in seam.check()

    def changed(self, tokenizer, request):  # a future signature
        pass
    monkeypatch.setattr(S.ResponseGenerator, "_tokenize", changed)
    with pytest.raises(seam.SeamError, match="_tokenize changed"):
        seam.check()
    assert app.main(["--model", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: mlx-kvcache serve cannot run")


def test_serve_options_join_mlx_lm_parser():
    import argparse

    p = argparse.ArgumentParser()
    app.add_options(p)
    a = p.parse_args(["--checkpoint-interval", "64", "--no-persist", "--max-disk-bytes", "2G"])
    # sizes read as in the chat command: G is a power of 1024, GB of 1000
    assert a.checkpoint_interval == 64 and a.no_persist and a.max_disk_bytes == 2 << 30
    assert p.parse_args(["--max-disk-bytes", "2GB"]).max_disk_bytes == 2 * 10**9
    assert a.shutdown_grace == 30 and a.admin_token is None
    a = p.parse_args(["--shutdown-grace", "2.5", "--admin-token", "t", "--max-disk-bytes", "1.5G"])
    assert a.shutdown_grace == 2.5 and a.admin_token == "t" and a.max_disk_bytes == int(1.5 * 2**30)
    for bad in (["--shutdown-grace", "-1"], ["--shutdown-grace", "nan"],
                ["--shutdown-grace", "inf"], ["--max-disk-bytes", "-1"],
                ["--max-disk-bytes", "lots"], ["--max-disk-bytes", "4X"],
                ["--max-disk-bytes", ""], ["--max-disk-bytes", "1.2.3G"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--checkpoint-interval", "0"])
    assert "DEFAULT_CHECKPOINT_INTERVAL" in inspect.getsource(app)
    text = p.format_help()  # every help string formats (a bare % would raise)
    assert "--memory-limit" in text and "--prompt-excerpts" in text
    a = p.parse_args(["--memory-limit", "8G", "--memory-wait", "5"])
    assert a.memory_limit == 8 << 30 and a.memory_wait == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--memory-limit", "-1"])


# -- hardening: request checks, the admin route, the stop, padded batch rows -----------------
def test_request_fields_that_would_end_the_generation_thread():
    from mlx_kvcache.serving.guards.validation import body_problem, generation_problem

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert body_problem("chat", chat) is None
    assert body_problem("text", {"prompt": "hi", "stop": ["a", "b"], "seed": 3}) is None
    bad = [("text", {"prompt": "hi", "stop": 123}, "stop"),
           ("text", {"prompt": "hi", "stop": [1]}, "stop"),
           ("chat", dict(chat, stop=["\ud800"]), "stop"),
           ("text", {"prompt": ""}, "prompt"), ("text", {"prompt": ["a", "b"]}, "prompt"),
           ("text", {}, "prompt"), ("chat", {"messages": []}, "messages"),
           ("chat", dict(chat, seed=-1), "seed"), ("chat", dict(chat, seed=1 << 64), "seed"),
           ("chat", dict(chat, logit_bias={"5": 1.0}), None),
           ("chat", dict(chat, logit_bias={"500": 1.0}), "logit_bias"),
           ("chat", dict(chat, logit_bias={"-1": 1.0}), "logit_bias"),
           ("chat", dict(chat, logit_bias={"x": 1.0}), "logit_bias"),
           ("chat", dict(chat, tools=5), "tools"),
           ("chat", dict(chat, chat_template_kwargs=[]), "chat_template_kwargs"),
           ("chat", dict(chat, stream_options={"include_usage": "yes"}), "include_usage")]
    for route, body, field in bad:
        problem = body_problem(route, body, vocab=100)
        assert (problem is None) if field is None else (field in problem), (body, problem)
    m = build("llama")
    args = types.SimpleNamespace(seed=None, logits=types.SimpleNamespace(logit_bias={V: 1.0}))
    assert "logit_bias" in generation_problem([1, 2], args, m)  # V is one past the last id
    args.logits.logit_bias = {V - 1: 1.0}
    assert generation_problem([1, 2], args, m) is None
    assert "empty" in generation_problem([], args, m)


def test_admin_policy():
    from mlx_kvcache.serving.guards.admin import AdminPolicy

    open_ = AdminPolicy.make(None, "127.0.0.1")
    ok = {"Host": "127.0.0.1:8080"}
    assert open_.refusal("GET", ok) is None
    assert open_.refusal("DELETE", {}) is None  # curl over HTTP/1.0: no Host, no Origin
    assert open_.refusal("GET", {"Host": "localhost:8080"}) is None
    assert open_.refusal("GET", {"Host": "[::1]:8080"}) is None
    assert open_.refusal("GET", {**ok, "Origin": "http://127.0.0.1:8080"}) is None
    for headers in ({**ok, "Origin": "http://evil.example"}, {**ok, "Origin": "null"},
                    {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"},
                    {"Host": "evil.example:8080"}):
        assert open_.refusal("DELETE", headers)[0] == 403, headers
    assert open_.refusal("OPTIONS", ok)[0] == 403
    locked = AdminPolicy.make("t0ken", "0.0.0.0")
    assert locked.refusal("GET", ok)[0] == 401
    assert locked.refusal("GET", {**ok, "Authorization": "Bearer nope"})[0] == 401
    assert locked.refusal("GET", {**ok, "Authorization": "Basic t0ken"})[0] == 401
    assert locked.refusal("GET", {"Host": "proxy.example", "Authorization": "Bearer t0ken"}) is None
    assert locked.refusal("GET", {"Host": "proxy.example", "Origin": "http://evil.example",
                                  "Authorization": "Bearer t0ken"})[0] == 403


def test_admin_policy_decides_by_the_peer_address():
    from mlx_kvcache.serving.guards.admin import AdminPolicy, is_loopback, listens_beyond_loopback

    open_ = AdminPolicy.make(None, "0.0.0.0")
    for peer in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(peer) and open_.refusal("GET", {"Host": "127.0.0.1"}, peer) is None
    for peer in ("192.168.1.7", "10.0.0.2", "::ffff:192.168.1.7", "fe80::1%eth0", "", "x"):
        assert not is_loopback(peer)
        for host in ("127.0.0.1:8080", "8.8.8.8", "localhost"):
            assert open_.refusal("GET", {"Host": host}, peer)[0] == 403, (peer, host)
    locked = AdminPolicy.make("t0ken", "0.0.0.0")
    ok = {"Authorization": "Bearer t0ken"}
    assert locked.refusal("GET", ok, "192.168.1.7") is None
    assert locked.refusal("GET", {}, "127.0.0.1")[0] == 401
    for host, beyond in (("127.0.0.1", False), ("::1", False), ("localhost", False),
                         ("0.0.0.0", True), ("::", True), ("", True), ("192.168.1.7", True)):
        assert listens_beyond_loopback(host) is beyond, host
    assert app.excerpts_shown("auto", "127.0.0.1", None)
    assert not app.excerpts_shown("auto", "0.0.0.0", None)
    assert app.excerpts_shown("auto", "0.0.0.0", "t0ken")
    assert not app.excerpts_shown("off", "127.0.0.1", None)
    assert app.excerpts_shown("on", "0.0.0.0", None)


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


def _guard_and_queue(limit, sizes, kv_per_token=1.0, wait=3600.0, active=lambda: 0):
    from mlx_kvcache.serving.guards.memory import AdmissionQueue, Footprint, MemoryGuard

    g = MemoryGuard(limit=limit, wait=wait, active_memory=active)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=kv_per_token,
                            act_per_token=0.0, step=8)
    q = AdmissionQueue(g, lambda item: sizes[item[1]], lambda item: item[1] == "cmd")

    def req(kind):
        from queue import Queue

        out = Queue()
        q.put((out, kind, None))
        return out
    return g, q, req


def _answered_in_line(q, out):
    """What the admission line ``q`` put on the answer queue ``out`` while it handed the
    generation thread nothing (a refusal, or a `DecodeJob`'s result)."""
    from queue import Empty

    with pytest.raises(Empty):
        q.get_nowait()
    return out.get_nowait()


def test_admission_passes_a_waiting_request_lets_commands_pass_and_refuses_clearly():
    from queue import Empty, Queue

    from mlx_kvcache.serving.guards.memory import MemoryNeverFits, MemoryRefused

    # 1 B per token, twice, rounded to 256 tokens, every row as long as the longest: a
    # "mid" reserves its prompt and the first 256 answer tokens (1280 tokens: 2560 B), not
    # its max_tokens; a "small" beside it as much (padded); a "big" 6144 B and the rows it
    # pads. The limit leaves 7780 B beside the weights.
    sizes = {"mid": (1000, 32_000), "big": (3000, 1), "small": (100, 100),
             "huge": (100_000, 1)}
    g, q, req = _guard_and_queue(8780, sizes)
    req("mid"), req("mid")
    q.put((Queue(), "cmd", None))
    assert q.get(timeout=0)[1] == "cmd"  # a command passes the line
    running = [q.get(timeout=0)]  # mlx-lm's loop waits (blocks) only with an empty batch ...
    running.append(q.get_nowait())  # ... then takes without waiting
    assert [r[1] for r in running] == ["mid", "mid"]
    req("big")
    with pytest.raises(Empty):  # the big one does not fit while two run: it waits ...
        q.get_nowait()
    req("small")
    running.append(q.get_nowait())  # ... and a small one behind it goes first
    assert running[-1][1] == "small"
    m = g.report()
    assert m["admitted_past_waiting"] == 1 and m["waiting_requests"] == 1, m
    # Never fits: refused at once with 400 while others run, never queued.
    refused = _answered_in_line(q, req("huge"))
    assert isinstance(refused, MemoryNeverFits) and refused.status == 400
    assert "100000 prompt tokens" in str(refused) and "--memory-limit" in str(refused)
    m = g.report()
    assert m["never_fit"] == 1 and m["refused"] == 0 and q.qsize() == 1, m
    for r in running:  # the answers end: their memory is released
        r[0].put(None)
    assert q.get_nowait()[1] == "big"  # the waiting one goes as soon as it fits
    assert g.report()["admitted_after_waiting"] == 1
    assert not isinstance(MemoryRefused("x"), MemoryNeverFits) and MemoryRefused.status == 503


def test_admission_fairness_is_bounded():
    from queue import Empty

    from mlx_kvcache.serving.guards.memory import PASS_LIMIT

    sizes = {"small": (100, 100), "big": (4000, 1), "huge": (100_000, 1)}
    g, q, req = _guard_and_queue(10_000, sizes)
    smalls = [req("small")]
    held = [q.get(timeout=0)]  # one runs: the big one cannot fit beside it
    req("big")
    for _ in range(PASS_LIMIT):
        req("small")
        held.append(q.get_nowait())
        assert held[-1][1] == "small"
    assert g.report()["admitted_past_waiting"] == PASS_LIMIT
    req("small")
    huge = req("huge")
    with pytest.raises(Empty):  # passed enough: nothing behind it goes first ...
        q.get_nowait()
    assert huge.get_nowait().status == 400  # ... but what can never fit is still told at once
    for h in held:
        h[0].put(None)
    assert q.get_nowait()[1] == "big"  # it goes first once it fits


def test_images_are_decoded_only_where_the_guard_admits_their_decoding():
    from queue import Queue

    from mlx_kvcache.serving.guards.memory import (AdmissionQueue, DecodeJob, Footprint,
                                                   MemoryGuard, MemoryNeverFits, MemoryRefused)

    # Rule 6: a request's images (bytes to decode, read from their headers) are admitted
    # before anything decodes them (`size` stands for mlx-lm's tokenizing, which decodes).
    g = MemoryGuard(limit=10_000, wait=3600.0, active_memory=lambda: 0)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0,
                            step=8)
    images = {"text": 0, "photo": 5_000, "poster": 8_000, "mural": 9_001}
    decoded = []

    def size(item):
        decoded.append(item[1])
        return (100, 100)
    q = AdmissionQueue(g, size, lambda item: False, images=lambda item: images[item[1]])

    def put(kind) -> Queue:
        out: Queue = Queue()
        q.put((out, kind, None))
        return out
    # Decoding that can never fit beside the weights: 400 at once, nothing decoded.
    refused = _answered_in_line(q, put("mural"))
    assert isinstance(refused, MemoryNeverFits) and refused.status == 400
    assert "never be decoded" in str(refused) and "--memory-limit" in str(refused)
    assert decoded == [] and g.report()["never_fit"] == 1
    # Fits: decoded once, then admitted as a request.
    put("photo")
    running = q.get(timeout=0)
    assert running[1] == "photo" and decoded == ["photo"]
    # While it runs, images that do not fit beside it wait undecoded; a text request
    # behind them goes first, and a count (`DecodeJob`) that fits runs in the line.
    g.reserve(4_000, 1000, 0)  # (what a long answer beside it holds)
    poster = put("poster")
    put("text")
    assert q.get_nowait()[1] == "text" and decoded == ["photo", "text"]
    counted = Queue()
    q.put((counted, DecodeJob(lambda: 42, 1_000), None))
    assert _answered_in_line(q, counted) == 42 and poster.qsize() == 0
    failing = Queue()
    q.put((failing, DecodeJob(lambda: 1 / 0, 100), None))
    # the asker's error, not the loop's
    assert isinstance(_answered_in_line(q, failing), ZeroDivisionError)
    g.idle()  # the answers ended
    assert q.get_nowait()[1] == "poster" and decoded[-1] == "poster"
    # Waited too long (here: nothing runs that could free what is in use): 503, undecoded.
    g2 = MemoryGuard(limit=10_000, wait=0.0, active_memory=lambda: 7_000)
    g2.footprint = g.footprint
    q2 = AdmissionQueue(g2, size, lambda item: False, images=lambda item: images[item[1]])
    out = Queue()
    q2.put((out, "photo", None))
    refused = _answered_in_line(q2, out)
    assert type(refused) is MemoryRefused and "cannot decode this request's images" in str(refused)
    assert decoded[-1] == "poster"
    # No limit: a job runs as it comes.
    free = AdmissionQueue(MemoryGuard(limit=None), size, lambda item: False)
    out = Queue()
    free.put((out, DecodeJob(lambda: "ran", 10**12), None))
    assert _answered_in_line(free, out) == "ran"


def test_an_image_s_encoding_is_measured_and_reserved_until_the_prefill_ends():
    from queue import Queue

    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.memory import (AdmissionQueue, Footprint, MemoryGuard,
                                                   MemoryNeverFits, measure_encoding)

    # A stand-in image encoder whose attention holds an n x n float32 score matrix: the
    # measured line grows with n² at 4 bytes (and a little per token: its output rows).
    class Tower:
        def embed_inputs(self, ids, pixel_values):
            scores = mx.outer(pixel_values, pixel_values)
            return mx.repeat(scores.sum(axis=1, keepdims=True), 8, axis=1)

    def probe(n):
        return [0] * (n + 2), mx.ones((n,)), n
    linear, square = measure_encoding(Tower(), probe)
    assert 3.9 <= square <= 4.5 and linear <= 200, (linear, square)
    assert measure_encoding(Tower(), lambda n: None) == (0.0, 0.0)  # the processor made none
    # A processor that gives every image the same tokens: one size, linear only.
    linear, square = measure_encoding(Tower(), lambda n: ([0] * 66, mx.ones((64,)), 64))
    assert square == 0.0 and linear >= 4 * 64

    # The guard: an image of 100 tokens takes 10 x 100 + 1 x 100² = 11,000 B to encode.
    fp = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0, step=8,
                   image_linear=10.0, image_square=1.0)
    assert fp.encoding([100, 100]) == 22_000 and fp.encoding([]) == 0
    g = MemoryGuard(limit=20_000, wait=3600.0, active_memory=lambda: 0)
    g.footprint = fp
    sizes = {"one": (200, 10, (100,)), "two": (200, 10, (100, 100))}
    q = AdmissionQueue(g, lambda item: sizes[item[1]], lambda item: False)
    two: Queue = Queue()
    q.put((two, "two", None))
    q.put((Queue(), "one", None))
    admitted = q.get(timeout=0)
    refused = two.get_nowait()  # 22,000 B of encoding beside 1,000 B of weights: never
    assert isinstance(refused, MemoryNeverFits) and "2 images of 100+100 tokens" in str(refused)
    assert "send fewer or smaller images" in str(refused)
    assert admitted[1] == "one" and g.reserved() == 2 * 256 + 11_000
    admitted[0].put(Response("a", 1, 0.0, None, ()))
    assert g.reserved() == 2 * 256  # prefilled: the encoding is gone


def test_the_reservation_follows_the_decoded_tokens():
    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.memory import DECODE_HEADROOM

    # 10 B per token (twice): a 100-token prompt with max_tokens 32,000 reserves 2 x 512
    # tokens at admission (prompt + 256 rounded), not 32,100 — which would never fit.
    sizes = {"long": (100, 32_000), "late": (100, 32_000)}
    active = {"n": 0}
    g, q, req = _guard_and_queue(35_000, sizes, kv_per_token=10.0, active=lambda: active["n"])
    out = req("long")
    first = q.get(timeout=0)
    assert g.report()["reserved_bytes"] == 2 * 10 * 512
    tok = Response("a", 1, 0.0, None, ())
    for _ in range(DECODE_HEADROOM - 1):  # within its reservation: no growth
        first[0].put(tok)
    assert g.report()["reserved_bytes"] == 2 * 10 * 512
    first[0].put(tok)  # its answer reached the reservation: 256 more tokens
    assert g.report()["reserved_bytes"] == 2 * 10 * 768
    # MLX's active memory counts beside the reservations: what is in use is the larger.
    active["n"] = 25_000
    assert g.in_use() == 25_000 and g.room() == 10_000
    active["n"] = 0
    late_out = req("late")
    late = q.get_nowait()
    late[0].put(tok)  # the second decodes too
    for _ in range(DECODE_HEADROOM * 2):
        first[0].put(tok)
    # The reservations would pass the limit: the newest decoding request ends there,
    # with finish_reason length and its end, and the first goes on.
    assert g.report()["ended_at_limit"] == 1
    late[0].put(tok)
    got = [late_out.get_nowait() for _ in range(late_out.qsize())]
    assert got[-1] is None and got[-2].finish_reason == "length"
    assert all(r.finish_reason is None for r in got[:-2])
    late[0].put(tok)  # mlx-lm's last step for it: dropped
    assert late_out.qsize() == 0 and g.running() == 1
    assert out.qsize() == DECODE_HEADROOM * 3 and g.report()["reserved_bytes"] > 2 * 10 * 768


def test_a_prefill_s_activations_are_reserved_until_the_first_token():
    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.memory import AdmissionQueue, Footprint, MemoryGuard

    g = MemoryGuard(limit=1 << 30, active_memory=lambda: 0)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=100.0,
                            step=64)
    q = AdmissionQueue(g, lambda item: (1000, 10), lambda item: False)
    from queue import Queue

    q.put((Queue(), "r", None))
    admitted = q.get(timeout=0)
    assert g.reserved() == 2 * 1024 + 100 * 64  # caches, and one prefill step (64 tokens)
    admitted[0].put(Response("a", 1, 0.0, None, ()))
    assert g.reserved() == 2 * 1024  # prefilled: the activations are gone


def test_an_empty_admin_token_is_refused_at_start(monkeypatch, capsys):
    import argparse
    import subprocess
    import sys

    from mlx_kvcache.serving.guards.admin import TOKEN_ENV, AdminPolicy

    def parser():
        p = argparse.ArgumentParser()
        app.add_options(p)
        return p
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for bad in ("", "  "):
        with pytest.raises(SystemExit):
            parser().parse_args(["--admin-token", bad])
        assert "admin token is empty" in capsys.readouterr().err
        monkeypatch.setenv(TOKEN_ENV, bad)  # the variable, as the flag's default
        with pytest.raises(SystemExit):
            parser().parse_args([])
        assert "admin token is empty" in capsys.readouterr().err
        with pytest.raises(ValueError, match="empty"):
            AdminPolicy.make(None, "127.0.0.1")
        with pytest.raises(ValueError, match="empty"):
            AdminPolicy.make(bad, "127.0.0.1")
        monkeypatch.delenv(TOKEN_ENV)
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert parser().parse_args([]).admin_token == "s3cret"
    assert parser().parse_args(["--admin-token", "x"]).admin_token == "x"
    # The whole command: one line, exit 2, before any model is loaded.
    r = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model",
                        "/nonexistent", "--admin-token", ""], capture_output=True, text=True)
    assert r.returncode == 2 and "admin token is empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_lifecycle_admits_until_stopping():
    import time

    from mlx_kvcache.serving.guards.lifecycle import Lifecycle

    life = Lifecycle(grace=5)
    assert life.admit() and life.inflight == 1
    assert life.admit(counted=False) and life.inflight == 1  # a read of the state: not open
    life.on_signal()
    assert life.asked and life.signals == 1 and not life.cut.is_set()
    life.stopping.set()
    assert not life.admit() and life.inflight == 1
    assert not life.admit(counted=False)
    assert not life.wait_idle(time.monotonic() + 0.05)
    assert not life.wait_idle(time.monotonic() + 60, interrupt=lambda: True)
    life.done()
    assert life.wait_idle(time.monotonic() + 0.05) and life.inflight == 0


def test_a_stream_whose_client_left_while_it_waited_ends_once_it_starts():
    from queue import Queue

    from mlx_kvcache.serving.engine.generator import ServerResponseGenerator
    from mlx_kvcache.serving.guards.lifecycle import (Lifecycle, Ticket, set_client_watch,
                                                      set_stream_waiting, set_ticket)

    # Its stream opened while it waited to be taken; the next keep-alive finds the client
    # gone. The wait goes on (the request is in the line: raising would leave it to run
    # unwatched), and once it starts, its answer ends at once, as for a client that
    # leaves later.
    g = ServerResponseGenerator.__new__(ServerResponseGenerator)
    g.lifecycle = Lifecycle()
    g.generation_available = lambda: True
    left, writes = threading.Event(), []

    def gone():
        writes.append(1)
        raise BrokenPipeError("the client left")
    set_client_watch(left)
    set_stream_waiting(gone)
    try:
        ticket = Ticket()
    finally:
        set_client_watch(None)
        set_stream_waiting(None)
    q: Queue = Queue()
    set_ticket(ticket)
    try:
        timer = threading.Timer(0.5, q.put, ("ctx",))  # taken after some 0.1 s waits
        timer.start()
        assert g._await_response(q) == "ctx"
        assert writes == [1] and left.is_set() and ticket.keepalive is None
        ticket.started = True
        q.put("a token")
        assert g._await_response(q) is None  # its answer ends here
    finally:
        set_ticket(None)


class _HeldProvider:
    """A model provider with no model, for mlx-lm's generation loop alone: ``reset``, which
    the loop calls on its thread once it has left (after the turn it took the stop in),
    holds the thread until `leave` is set, as the rest of that turn would."""

    def __init__(self, hold: bool) -> None:
        self.cli_args = types.SimpleNamespace(prefill_step_size=64)
        self.model = self.tokenizer = self.processor = self.model_key = None
        self.leaving = threading.Event()
        self.leave = threading.Event()
        if not hold:
            self.leave.set()

    def load_default(self) -> None:
        pass

    def reset(self) -> None:
        self.leaving.set()
        self.leave.wait(timeout=120)  # (a cap against a stuck test only)


def test_a_stop_answers_once_the_generation_thread_has_ended():
    """mlx-lm's loop finishes the turn it takes the stop in before it ends — on a sharded
    model a round of the batch, the model's collectives, which every rank runs. Rank 0
    exited at the stop's answer and left the other ranks inside one of them for good
    (test_distributed's stop): the stop answers once the generation thread has ended, and
    a thread that does not end in time is a `TimeoutError` (rank 0 exits 1)."""
    from mlx_kvcache.serving.engine.generator import ServerResponseGenerator

    held = _HeldProvider(hold=True)
    gen = ServerResponseGenerator(held, TriePromptCache(held))
    try:
        with pytest.raises(TimeoutError):  # (the thread holds until `leave`)
            gen.command("stop", timeout=1)
        assert held.leaving.wait(timeout=120)  # the loop took the stop and left
        assert gen.lifecycle.stopped.is_set() and gen.generation_available()
    finally:
        held.leave.set()
    gen.join()
    free = _HeldProvider(hold=False)
    gen = ServerResponseGenerator(free, TriePromptCache(free))
    assert gen.command("stop") is None
    assert free.leaving.is_set() and not gen.generation_available()


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
    pc = TriePromptCache(types.SimpleNamespace(model=m, tokenizer=None, draft_model=None,
                                               model_key=KEY, is_batchable=True),
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


def test_model_names_are_read_from_their_spelling_alone(tmp_path, monkeypatch):
    import huggingface_hub

    from mlx_kvcache.serving.routes import model_names as mn

    # No name a client sends is looked up: neither the file system nor the Hub's cache.
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda *a, **k: pytest.fail("a client's name probed the Hub cache"))
    d = tmp_path / "exported"
    d.mkdir()
    args = types.SimpleNamespace(model=str(d), served_model_name="SmolLM2-135M-Instruct")
    mn.served_id(args)  # (the operator's own --model is read once, here)
    real_exists = os.path.exists
    probed = []
    monkeypatch.setattr(os.path, "exists", lambda p: probed.append(p) or real_exists(p))
    for name in ("default_model", "SmolLM2-135M-Instruct", str(d), "claude-sonnet-5", "gpt-4o",
                 "default"):
        assert mn.resolve(args, name) == mn.DEFAULT, name
        assert mn.refusal(args, name) is None, name
    other = tmp_path / "other"
    other.mkdir()
    # A model reference (a path, a repo id) is refused alike whether it exists or not.
    refusals = {n: mn.refusal(args, n) for n in (str(other), str(tmp_path / "nope"),
                                                 "mlx-community/Qwen3-4B-4bit", "~/m", "./m")}
    for name, r in refusals.items():
        assert r is not None and r.field == "model", name
        assert "--allow-model-switch" in r.message and "SmolLM2-135M-Instruct" in r.message
        assert r.message.replace(repr(name), "X") == \
            refusals[str(other)].message.replace(repr(str(other)), "X")
    assert mn.refusal(args, "gpt-4o", draft=str(other)).field == "draft_model"
    assert mn.refusal(args, 7) is None  # not a string: mlx-lm's own 400
    assert probed == []
    # With --allow-model-switch a reference loads as mlx-lm loads it; listed models too.
    switching = types.SimpleNamespace(**vars(args), allow_model_switch=True)
    assert mn.resolve(switching, str(other)) == str(other)
    assert mn.refusal(switching, str(other)) is None
    listed = types.SimpleNamespace(**vars(args), switch_model=["org/listed"])
    assert mn.resolve(listed, "org/listed") == "org/listed" and not mn.refusal(listed, "org/listed")
    assert mn.refusal(listed, "org/other") is not None
    assert [m["id"] for m in mn.models_listing(listed, 1)["data"]] == \
        ["SmolLM2-135M-Instruct", "org/listed"]
    listing = mn.models_listing(args, 123)
    assert [m["id"] for m in listing["data"]] == ["SmolLM2-135M-Instruct"]
    assert mn.model_entry(args, 123, "claude-sonnet-5")["id"] == "claude-sonnet-5"
    assert mn.model_entry(args, 123, "mlx-community/Qwen3-4B-4bit") is None
    # without --served-model-name: the repo id, or the directory's absolute path
    assert mn.served_id(types.SimpleNamespace(model="org/m")) == "org/m"
    assert mn.served_id(types.SimpleNamespace(model=str(d))) == str(d.resolve())
    # no served model: mlx-lm's behaviour, and an empty (valid) listing
    none = types.SimpleNamespace(model=None)
    assert mn.resolve(none, "claude-sonnet-5") == "claude-sonnet-5"
    assert mn.models_listing(none, 1) == {"object": "list", "data": []}


def test_only_the_operators_models_are_trusted():
    from mlx_kvcache.serving.routes import model_names as mn

    args = types.SimpleNamespace(model="/m", draft_model="/d", switch_model=["/s"],
                                 trust_remote_code=True)
    assert [mn.trusted(args, p) for p in ("/m", "/d", "/s", "/tmp/x", "org/x", None)] == \
        [True, True, True, False, False, False]
    args.trust_remote_code = False
    assert not any(mn.trusted(args, p) for p in ("/m", "/d", "/s"))


def test_model_names_installed_on_the_provider_load():
    from mlx_kvcache.serving.routes import model_names as mn

    calls = []
    prov = types.SimpleNamespace(cli_args=types.SimpleNamespace(model="org/m"),
                                 load=lambda *a: calls.append(a) or ("model", "tok"))
    mn.install(prov)
    assert prov.load("claude-sonnet-5", None, "default_model") == ("model", "tok")
    with pytest.raises(ValueError, match="--allow-model-switch"):
        prov.load("org/other")  # a route that did not refuse it: the load does
    with pytest.raises(ValueError, match="draft model"):
        prov.load("default_model", None, "/tmp/draft")
    prov.cli_args.allow_model_switch = True
    assert prov.load("org/other") == ("model", "tok")
    assert calls == [("default_model", None, "default_model"), ("org/other", None, None)]


def test_the_seam_loads_a_requested_model_without_remote_code(monkeypatch):
    from mlx_lm import server as S

    from mlx_kvcache.serving import seam

    seen = []

    def stock(path, *args, **kwargs):
        seen.append((path, kwargs.get("trust_remote_code"),
                     (kwargs.get("tokenizer_config") or {}).get("trust_remote_code")))
        return "model", "tok"
    monkeypatch.setattr(S, "load", stock)
    monkeypatch.setattr(S, "sharded_load", stock)

    def options(parser):
        for flag in ("--model", "--draft-model", "--switch-model"):
            parser.add_argument(flag)
        parser.add_argument("--trust-remote-code", action="store_true")
    with seam.patched(options, lambda *a: None,
                      ["x", "--model", "/m", "--draft-model", "/d", "--trust-remote-code"]):
        S.argparse.ArgumentParser().parse_args(sys.argv[1:])  # (our Parser: as mlx-lm's main)
        for path in ("/m", "/tmp/evil"):  # the provider's own call: every option by name
            S.load(path, adapter_path=None, tokenizer_config={"trust_remote_code": True},
                   return_config=True, trust_remote_code=True)
        S.load("/d")  # the draft: no options
        S.load("/tmp/evil")
        S.sharded_load("/tmp/evil", tokenizer_config={"trust_remote_code": True},
                       trust_remote_code=True)
    assert seen == [("/m", True, True), ("/tmp/evil", False, False), ("/d", True, True),
                    ("/tmp/evil", False, False), ("/tmp/evil", False, False)]


class _Provider:
    """mlx-lm's ``ModelProvider`` as `draft_use` sees it: ``load`` (re)loads the target and
    the draft only when the key changes."""

    def __init__(self, target, drafts):
        self.model, self.draft_model, self.model_key = None, None, None
        self._target, self._drafts = target, drafts

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        key = (model_path, adapter_path, draft_model_path)
        if key != self.model_key:
            self.model_key, self.model = key, self._target
            self.draft_model = self._drafts.get(draft_model_path)
        return self.model, "tok"


def test_a_draft_that_could_never_pay_is_set_aside_when_it_loads(monkeypatch, caplog):
    from mlx_kvcache.serving.engine import draft_use

    weighed = []
    real = draft_use.draft_set_aside
    monkeypatch.setattr(draft_use, "draft_set_aside",
                        lambda *a: weighed.append(a[2]) or real(*a))
    target, small = build("llama"), build("llama", hidden_size=32, intermediate_size=64)
    same = build("llama")
    prov = _Provider(target, {"same": same, "small": small})
    draft_use.install(prov, "adaptive")
    with caplog.at_level("WARNING", logger="mlx_kvcache"):
        for _ in range(3):  # every request goes through load
            assert prov.load("m", None, "same") == (target, "tok")
            assert prov.draft_model is None
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert said == ["mlx_kvcache: the draft model same is not used: a step of the draft model "
                    "costs 1.00 of a step of the model (their weight bytes), so drafting can "
                    "never pay for itself; requests are served by the model alone, one at a "
                    "time (--draft-policy fixed drafts with it anyway)"]
    # a draft that may pay is kept, and weighed once, not every request
    for _ in range(3):
        prov.load("m", None, "small")
        assert prov.draft_model is small
    assert weighed == [same, small]
    # fixed keeps whatever it is given
    fixed = _Provider(target, {"same": same})
    draft_use.install(fixed, "fixed")
    fixed.load("m", None, "same")
    assert fixed.draft_model is same
