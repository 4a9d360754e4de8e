"""The server's prompt-cache seam, in process: what fetch hands out, what insert stores,
segment splitting and the mlx-lm version guard."""

from __future__ import annotations

import inspect
import types

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.serving import app, seam
from mlx_kvcache.serving.generator import split_segments
from models import V, build

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
    assert pc.fetch_nearest_cache(KEY, prompt) == (None, prompt)  # a miss
    ref, cache = served(m, prompt)
    # mlx-lm's generate_step is one step ahead: its cache holds every yielded token.
    full = prompt + [t for t, _ in ref]
    pc.insert_cache(KEY, full, cache)
    before = pc.nbytes
    for _ in range(2):  # the second fetch proves the first one's writes left the trie alone
        got, rest = pc.fetch_nearest_cache(KEY, full + [5, 6])
        assert rest == [5, 6]
        assert all(type(c) in (mlc.KVCache, mlc.RotatingKVCache, mlc.ArraysCache) for c in got)
        out, _ = served(m, rest, got)  # writes into the fetched arrays
        cold, _ = served(m, full + [5, 6])
        assert [t for t, _ in out] == [t for t, _ in cold]
        assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(out, cold)) < 1e-4
    assert pc.nbytes == before
    # An exact repeat never returns an empty rest.
    got, rest = pc.fetch_nearest_cache(KEY, prompt)
    assert len(rest) >= 1


def test_insert_refuses_a_cache_that_does_not_hold_the_tokens():
    m = build("llama")
    pc = TriePromptCache(provider(m), max_bytes=1 << 30)
    prompt = list(range(1, 20))
    _, cache = served(m, prompt)
    pc.insert_cache(KEY, prompt, cache)  # holds prompt + 4 generated: not these 19 tokens
    assert len(pc) == 0 and pc.nbytes == 0
    pc.insert_cache(KEY, prompt, [mlc.QuantizedKVCache() for _ in m.layers])
    assert len(pc) == 0


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
    assert hybrid.checkpoints(KEY, list(range(1, 70))) == [16, 32, 48, 64, 65, 68]
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
    assert a.checkpoint_interval == 64 and a.no_persist and a.max_disk_bytes == 2e9
    with pytest.raises(SystemExit):
        p.parse_args(["--checkpoint-interval", "0"])
    assert "DEFAULT_CHECKPOINT_INTERVAL" in inspect.getsource(app)
