"""Every miss explained: `RequestStats.reuse` says where reuse stopped, the text on both
sides of the first token that differs from the cache, and the rule that cost tokens; the
server's sequential fetch with images stores only text and never restores into an image."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc

import mlx_kvcache as mk
from mlx_kvcache.prefix.explain import Explainer, excerpt
from mlx_kvcache.serving.cache import sequential
from mlx_kvcache.serving.cache.prompt_cache import TriePromptCache
from models import V, build
from reference import new_cache, run, track_snapshots  # noqa: F401

_MODELS = {}


def model(name):
    if name not in _MODELS:
        _MODELS[name] = build(name)
    return _MODELS[name]


def ask(pc, prompt, n=2):
    return run(pc, prompt, n)[1].reuse


def test_each_kind_of_miss_on_a_kv_model():
    m, rng = model("llama"), random.Random(1)
    pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=16)
    p = [rng.randrange(V) for _ in range(30)]
    first = ask(pc, p)
    assert first.kind == "empty" and first.offset == 0 and first.diverged_at is None
    again = ask(pc, p)
    assert again.kind == "hit" and again.offset == 29 and "full hit" in again.line()
    longer = ask(pc, p + [1, 2, 3])  # the trie holds p and one answer token
    assert longer.kind in ("extends", "diverged") and longer.offset >= 30
    q = p[:12] + [(p[12] + 1) % V] + p[13:]
    div = ask(pc, q)
    assert (div.kind, div.diverged_at, div.offset) == ("diverged", 12, 12)
    # no tokenizer text: token ids on both sides of the first differing token
    assert div.before.endswith(f"{p[11]}]") and div.cached.startswith(f"[{p[12]} ")
    assert div.prompt.startswith(f"[{q[12]} ")
    assert "differs from every cached prompt at token 12" in div.rule
    pc.clear()
    gone = ask(pc, p)
    assert gone.kind == "evicted" and "cleared" in gone.rule


def test_a_prefix_the_budget_evicted_is_named():
    m, rng = model("llama"), random.Random(2)
    p = [rng.randrange(V) for _ in range(40)]
    probe = new_cache(m, max_bytes=1 << 30, prefill_step_size=64)
    run(probe, p, 2)
    one = probe.stats.snapshot_bytes
    pc = new_cache(m, max_bytes=int(one * 1.5), prefill_step_size=64)  # room for one prompt
    run(pc, p, 2)
    run(pc, [rng.randrange(V) for _ in range(40)], 2)  # evicts p
    st = run(pc, p, 2)[1]
    assert st.restored_tokens == 0
    assert st.reuse.kind == "evicted" and "byte budget evicted" in st.reuse.rule, st.reuse


def test_recurrent_layers_name_the_tokens_they_cost():
    m, rng = model("qwen3_next"), random.Random(3)
    pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=64, snapshot_interval=16)
    p = [rng.randrange(V) for _ in range(60)]
    run(pc, p, 2)
    q = p[:41] + [(p[41] + 1) % V] + [rng.randrange(V) for _ in range(10)]
    st = run(pc, q, 2)[1]
    assert (st.matched_tokens, st.restored_tokens) == (41, 32)
    r = st.reuse
    assert r.kind == "diverged" and r.diverged_at == 41 and r.offset == 32
    assert ("recurrent layers restore only at checkpoints: landed 9 tokens before the "
            "divergence") in r.rule


def test_each_cache_kind_says_its_own_restore_rule_and_mlx_lm_classes_say_their_kinds():
    """The words for a restore that landed short are the layer class's own
    (``restore_rule``, caches/), mlx-lm's class of a kind we have says that kind's, and
    any other class is named as one restored whole."""
    from mlx_kvcache.caches import (
        ChunkedKVCache, GenericCache, KVCache, QuantizedKVCache, RecurrentCache,
        RotatingKVCache, restore_rule_of,
    )

    class Odd:  # a model's own cache class
        offset = 0
        state = ()

    ours = [KVCache(), QuantizedKVCache(), RotatingKVCache(8), RecurrentCache(2), ChunkedKVCache(4)]
    words = {type(c): restore_rule_of(c) for c in ours}
    assert words[RecurrentCache] == "recurrent layers restore only at checkpoints"
    assert "window wrapped" in words[RotatingKVCache] and "chunk" in words[ChunkedKVCache]
    assert words[KVCache] == words[QuantizedKVCache] and "kv_bits" in words[KVCache]
    mlx = [mlc.KVCache(), mlc.QuantizedKVCache(), mlc.RotatingKVCache(8), mlc.ArraysCache(2),
           mlc.ChunkedKVCache(4)]
    assert [restore_rule_of(c) for c in mlx] == [words[type(c)] for c in ours]
    assert restore_rule_of(Odd()) == restore_rule_of(GenericCache(Odd())) == (
        "Odd layers (a cache class restored whole) restore only at checkpoints")


def test_excerpts_decode_escape_and_mark_images():
    def decode(ids):  # one character per id
        return "".join(map(chr, ids))

    def codes(text):
        return [ord(c) for c in text]
    assert excerpt(codes('ab\ncd"e'), decode) == 'ab\\ncd\\"e'
    assert excerpt([5, 6, -3, -3, 7], lambda ids: "".join(f"<{i}>" for i in ids)) == \
        "<5><6><image><7>"
    assert excerpt([1, 2], None) == "[1 2]"
    assert len(excerpt(codes("x" * 200), decode)) == 48
    assert excerpt(codes("abcdefgh" * 10), decode, left=True).endswith("fgh")


# -- images on the sequential path ---------------------------------------------------------------
IMG = 7  # the id the (stand-in) processor puts at every patch


def provider(m):
    return SimpleNamespace(model=m, tokenizer=None, draft_model=None, is_batchable=False,
                           cli_args=argparse.Namespace(kv_bits=None))


def serve(cache, key, prompt, vision=True):
    """A sequential fetch of ``key`` (images as negative ids, mlx-lm's image-aware key),
    then what mlx-lm would do: compute the rest (here from plain ids) and insert."""
    m = cache.provider.model
    seq = sequential.SequentialRequest(prompt=list(prompt), vision=object() if vision else None,
                                       prefill_step=64)
    with sequential.serving(seq):
        caches, rest = cache.fetch_nearest_cache("m", key)
        if caches is None:
            caches = mlc.make_prompt_cache(m)
        m(mx.array(prompt[len(prompt) - len(rest):])[None], cache=caches)
        cache.insert_cache("m", key, caches)
    return seq, len(prompt) - len(rest)


def keyed(text_a, image_id, n_img, text_b):
    key = text_a + [image_id] * n_img + text_b
    prompt = text_a + [IMG] * n_img + text_b
    return key, prompt


def test_images_store_text_only_and_never_match_other_images():
    m, rng = model("qwen3_next"), random.Random(4)
    cache = TriePromptCache(provider(m), max_bytes=1 << 30, checkpoint_interval=8)
    head = [rng.randrange(8, V) for _ in range(20)]
    tail = [rng.randrange(8, V) for _ in range(10)]
    key, prompt = keyed(head, -11, 6, tail)
    seq, handed = serve(cache, key, prompt)
    # checkpoints only on the text before the first image (8 and 16; never at 24 or n - 1)
    assert seq.restored == 0 and handed == 16
    ends = sorted(n.end for n in cache._model.manager.trie.nodes())
    assert all(e <= 20 or e == len(key) for e in ends), ends
    # the same text with another image: reuse stops before that image, and says why
    key2, prompt2 = keyed(head, -12, 6, tail)
    seq2, _ = serve(cache, key2, prompt2)
    assert seq2.restored <= 20
    last = cache.report()["recent"][-1]["reuse"]
    assert last["kind"] == "image" and last["diverged_at"] == 20, last
    assert "<image>" in last["cached"] and "other images" in last["rule"]
    # the same image again: recurrent states exist only at text checkpoints (the rows of
    # an image are computed by mlx-lm's prefill, past the fetch): the last one before it
    seq3, _ = serve(cache, key, prompt)
    assert seq3.restored == 20


def test_a_restore_inside_an_image_moves_to_its_start():
    m = model("llama")
    live_kv = mk.prefix.live.LiveSet(mk.make_prompt_cache(m))
    m(mx.arange(30)[None], cache=live_kv.caches)
    runs = sequential.image_runs([1] * 10 + [-4] * 8 + [2] * 12)
    assert runs == [(10, 18)]
    # runs at either end, several, none
    assert sequential.image_runs([-1, -1, 3, -2, 5, -7]) == [(0, 2), (3, 4), (5, 6)]
    assert sequential.image_runs([1, 2, 3]) == [] and sequential.image_runs([]) == []
    assert sequential.outside_images(live_kv, 14, runs) == 10
    assert all(c.offset == 10 for c in live_kv.leaves)
    assert sequential.outside_images(live_kv, 10, runs) == 10  # at its start: fine
    h = model("qwen3_next")
    live_h = mk.prefix.live.LiveSet(mk.make_prompt_cache(h))
    h(mx.arange(14)[None], cache=live_h.caches)
    mk.settle(live_h.caches, 14)
    assert sequential.outside_images(live_h, 14, runs) == 0  # a recurrent state cannot rewind
    assert all(c.offset == 0 for c in live_h.leaves)


def test_explainer_remembers_a_bounded_number_of_prompts():
    ex = Explainer(ring=3)
    for i in range(10):
        ex.remember([i] * 5)
    assert len(ex._recent) == 3


def test_image_keys_are_stored_as_they_are():
    # The trie takes negative ids (mlx-lm's image key) like any other token.
    m = model("llama")
    cache = TriePromptCache(provider(m), max_bytes=1 << 30)
    key, prompt = keyed([9] * 12, -3, 4, [10] * 6)
    serve(cache, key, prompt)
    _, matched = cache._model.manager.trie.find(key)
    assert matched == len(key)
    seq, _ = serve(cache, key, prompt)  # attention rows reach any token: past the image
    assert seq.restored == len(key) - 1


pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
