"""mlx-lm interop: save/load_prompt_cache on our caches, stream_generate with our caches,
and every kind of layer cache accepted (converted, or adapted as the model's own object)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

import mlx_kvcache as K
from mlx_kvcache.caches import layer_signature

from models import MODELS, V, build

_MODELS = {}


def model(name):
    if name not in _MODELS:
        _MODELS[name] = build(name)
    return _MODELS[name]


def tokens(n, seed):
    mx.random.seed(seed)
    return mx.random.randint(0, V, (1, n))


def run(m, toks, caches):
    out = m(toks, cache=caches)
    K.settle(caches, toks.shape[1])
    mx.eval(out)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_save_load_prompt_cache_continues_identically(name, tmp_path):
    m = model(name)
    prompt = tokens(21, 0)  # longer than gemma3's window of 8: its rotating layers wrap
    caches = K.make_prompt_cache(m)
    run(m, prompt, caches)
    assert all(isinstance(c, K.convert.__globals__["LEAF_TYPES"]) for c in K.leaf_caches(caches))
    if name == "gemma3_text":
        assert any(isinstance(c, K.RotatingKVCache) and c.wrapped for c in caches)
    if name in ("qwen3_next", "mamba"):
        rec = [c for c in caches if isinstance(c, K.RecurrentCache)]
        assert rec and all(c.offset == 21 for c in rec)

    path = str(tmp_path / "cache.safetensors")
    mlc.save_prompt_cache(path, caches, metadata={"model": name})
    loaded, meta = mlc.load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": name}
    assert len(loaded) == len(caches)
    for a, b in zip(caches, loaded):
        assert a.offset == b.offset
        assert type(a).__name__ == type(b).__name__

    nxt = tokens(5, 1)
    step = tokens(1, 2)
    a1, b1 = run(m, nxt, caches), run(m, nxt, loaded)
    assert mx.abs(a1 - b1).max().item() <= 1e-5
    a2, b2 = run(m, step, caches), run(m, step, loaded)
    assert mx.abs(a2 - b2).max().item() <= 1e-5

    # and both agree with mlx-lm's own caches over the whole sequence in one pass
    full = m(mx.concatenate([prompt, nxt, step], axis=1), cache=mlc.make_prompt_cache(m))
    assert mx.abs(full[:, 21:26] - a1).max().item() <= 1e-4
    assert mx.abs(full[:, 26:] - a2).max().item() <= 1e-4

    # a loaded cache is still snapshot-capable through convert()
    conv = [K.convert(c) for c in loaded]
    snaps = [c.snapshot(0) for c in K.leaf_caches(conv)]
    assert all(s is not None and s.to_offset == c.offset for s, c in zip(snaps, K.leaf_caches(conv))
               if not isinstance(c, K.RecurrentCache) or c.offset > 0)


# -- stream_generate --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(i) for i in range(32, 127)] + ["\n"])}
    assert len(vocab) <= V
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", additional_special_tokens=specials[3:])
    return TokenizerWrapper(hf)


def generate(m, tokenizer, prompt, cache, n):
    from mlx_lm import stream_generate

    toks, lps, texts = [], [], []
    for r in stream_generate(m, tokenizer, prompt, prompt_cache=cache, max_tokens=n):
        toks.append(r.token)
        lps.append(np.array(r.logprobs))
        texts.append(r.text)
    return toks, lps, "".join(texts)


@pytest.mark.parametrize("name", MODELS)
def test_stream_generate_with_our_caches(name, tokenizer):
    m = model(name)
    prompt = tokenizer.encode("hello there, cache!")
    assert len(prompt) > 8 and max(prompt) < V
    ours = K.make_prompt_cache(m)
    a = generate(m, tokenizer, prompt, ours, 12)
    b = generate(m, tokenizer, prompt, mlc.make_prompt_cache(m), 12)
    assert a[0] == b[0]
    assert a[2] == b[2]
    assert len(a[1]) == len(b[1]) > 0
    for x, y in zip(a[1], b[1]):
        assert np.abs(x - y).max() <= 1e-5
    # a second turn on the same caches (as mlx_lm.chat does) also agrees
    prompt2 = tokenizer.encode(" and again")
    theirs = mlc.make_prompt_cache(m)
    generate(m, tokenizer, prompt, theirs, 12)
    c = generate(m, tokenizer, prompt2, ours, 6)
    d = generate(m, tokenizer, prompt2, theirs, 6)
    assert c[0] == d[0]
    for x, y in zip(c[1], d[1]):
        assert np.abs(x - y).max() <= 1e-5


# -- layer caches of every kind -----------------------------------------------------------


def test_make_prompt_cache_converts_or_adapts_every_kind(monkeypatch):
    """No cache kind is refused: mlx-lm's quantized and chunked caches become ours (sharing
    arrays); a class without a kind of its own stays the model's object, and the trie sees
    it through a `GenericCache` adapter."""
    m = build("llama")
    other = mlc.ConcatenateKVCache()
    monkeypatch.setattr(m, "make_cache", lambda: [
        mlc.QuantizedKVCache(group_size=32, bits=4), mlc.CacheList(mlc.KVCache(), mlc.ChunkedKVCache(8)),
        other], raising=False)
    caches = K.make_prompt_cache(m)
    assert type(caches[0]) is K.QuantizedKVCache and (caches[0].bits, caches[0].group_size) == (4, 32)
    assert [type(c) for c in caches[1].caches] == [K.KVCache, K.ChunkedKVCache]
    assert caches[2] is other  # the model keeps its own object
    with pytest.warns(RuntimeWarning, match="ConcatenateKVCache"):
        leaves = K.leaf_caches(caches)
    assert isinstance(leaves[3], K.GenericCache) and leaves[3].obj is other
    assert K.leaf_caches(caches)[3] is leaves[3]  # one adapter per object
    sig = layer_signature(leaves)
    assert sig[0][0] == "quantized" and sig[2] == ["chunked", 8] and sig[3][0] == "generic"
    assert "ConcatenateKVCache" in sig[3][1]


def test_make_prompt_cache_mirrors_model_kinds():
    kinds = {name: [type(c).__name__ for c in K.make_prompt_cache(model(name))] for name in MODELS}
    assert kinds["llama"] == ["KVCache"] * 2
    assert kinds["gemma3_text"] == ["RotatingKVCache", "KVCache"] * 2
    assert kinds["qwen3_next"] == ["RecurrentCache"] * 3 + ["KVCache"]
    assert kinds["mamba"] == ["RecurrentCache"] * 2
    g = K.make_prompt_cache(model("gemma3_text"))
    assert (g[0].max_size, g[0].keep) == (8, 0)
