"""Our caches in mlx-lm's batch API: ``batch_generate(prompt_caches=...)``, ``BatchGenerator``
(given caches, or a model whose ``make_cache`` returns ours), ``merge`` of empty caches,
``extend`` / ``filter`` / ``extract``; and the two meanings of ``merge``.

The bar: the answers mlx-lm's own caches give (full log-prob rows to 1e-4), and what
``extract`` hands back is our class holding what mlx-lm's would (continuing from it gives
the same logits). Quantized layers have no mlx-lm batch form: there the reference is
mlx-lm's one-sequence decoding on its own ``QuantizedKVCache``.
"""

from typing import List

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models import cache as mlc

import mlx_kvcache.caches as K
from models import model
from reference import FLOAT_TOL

TOL = FLOAT_TOL  # float32 summation-order noise: see reference.FLOAT_TOL
# Prompts, and the tokens already in each prompt cache (some caches empty). gemma3_text's
# window is 8: the long ones wrap while prefilling and decoding inside the batch.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [5]]
PREFIX = [[10, 11], [], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], []]
N = 6
class Tok:
    """What ``batch_generate`` needs of a tokenizer."""

    eos_token_ids: List[int] = []

    def decode(self, ids):
        return " ".join(map(str, ids))


def filled(m, make, prefix):
    """``make()``'s caches for ``m`` holding ``prefix`` (fed as mlx-lm's decoding would)."""
    c = make()
    if prefix:
        m(mx.array([prefix]), cache=c)
        K.settle(c, len(prefix))
        mx.eval([x.state for x in c])
    return c


def ours(m):
    return lambda: K.make_prompt_cache(m)


def theirs(m):
    return lambda: mlc.make_prompt_cache(m)


def generate(m, caches, prompts=PROMPTS, n=N, **kw):
    """Every response's full log-prob row, per prompt, and each finished prompt's cache."""
    gen = BatchGenerator(m, max_tokens=n, prefill_batch_size=2, completion_batch_size=4, **kw)
    uids = gen.insert(prompts, caches=caches)
    rows = {u: [] for u in uids}
    back = {}
    while responses := gen.next_generated():
        for r in responses:
            rows[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                back[r.uid] = r.prompt_cache
    gen.close()
    return [mx.stack(rows[u]) for u in uids], [back[u] for u in uids]


def assert_rows(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert float(mx.abs(x - y).max()) < TOL


def next_logits(m, caches, token=7):
    out = m(mx.array([[token]]), cache=caches)[0, -1]
    return out - mx.logsumexp(out)


def leaf_types(caches):
    return [type(c) for c in caches]


# -- BatchGenerator / batch_generate with our caches: mlx-lm's answers -------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_batch_generator_with_our_caches_answers_as_mlx_lm(name):
    m = model(name)
    ref, ref_back = generate(m, [filled(m, theirs(m), p) for p in PREFIX])
    got, back = generate(m, [filled(m, ours(m), p) for p in PREFIX])
    assert_rows(got, ref)
    mine = {K.KVCache, K.RotatingKVCache, K.RecurrentCache}
    for b, rb in zip(back, ref_back):
        # extract gives our classes, holding what mlx-lm's extract holds.
        assert set(leaf_types(b)) <= mine and len(b) == len(rb)
        assert [c.offset for c in b if not isinstance(c, K.RecurrentCache)] == \
            [c.offset for c in rb if not isinstance(c, mlc.ArraysCache)]
        assert float(mx.abs(next_logits(m, b) - next_logits(m, rb)).max()) < TOL
    if name == "gemma3_text":  # the window wrapped inside the batch
        assert any(c.offset > c.max_size for b in back for c in b if isinstance(c, K.RotatingKVCache))
    if name == "qwen3_next":  # each row's recurrent offset is its token count
        for b in back:
            kv = [c.offset for c in b if isinstance(c, K.KVCache)]
            assert {c.offset for c in b if isinstance(c, K.RecurrentCache)} == set(kv[:1])
            assert all(c.snapshot() is not None for c in b)  # usable as ours


def test_batch_generate_takes_our_prompt_caches():
    m = model("gemma3_text")
    kw = dict(max_tokens=N, return_logprobs=True, return_prompt_caches=True,
              prefill_batch_size=4)
    ref = batch_generate(m, Tok(), PROMPTS, prompt_caches=[filled(m, theirs(m), p) for p in PREFIX], **kw)
    got = batch_generate(m, Tok(), PROMPTS, prompt_caches=[filled(m, ours(m), p) for p in PREFIX], **kw)
    for a, b in zip(got.logprobs, ref.logprobs):
        assert len(a) == len(b) == N and max(abs(x - y) for x, y in zip(a, b)) < TOL
    for cs in got.caches:
        assert set(leaf_types(cs)) == {K.KVCache, K.RotatingKVCache}


class OurCaches:
    """A model whose ``make_cache`` returns our classes (what `K.make_prompt_cache` builds)."""

    def __init__(self, m):
        self.m, self.layers = m, m.layers

    def __call__(self, *a, **k):
        return self.m(*a, **k)

    def make_cache(self):
        return K.make_prompt_cache(self.m)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_model_making_our_caches_batches_from_empty(name):
    """No caches given: every sequence starts from ``make_cache()`` — ours, all empty, merged."""
    m = model(name)
    ref, _ = generate(m, None)
    got, back = generate(OurCaches(m), None)
    assert_rows(got, ref)
    assert all(isinstance(c, K.LEAF_TYPES) for b in back for c in b)


# -- quantized layers: no mlx-lm batch; the reference is its one-sequence decoding ------------
QM = dict(hidden_size=128)  # head dim 32: one quantization group per row


def quantized(m, bits=8):
    return lambda: [K.QuantizedKVCache(group_size=32, bits=bits) for _ in m.layers]


def quantized_theirs(m, bits=8):
    return lambda: [mlc.QuantizedKVCache(group_size=32, bits=bits) for _ in m.layers]


def test_quantized_layers_batch_as_mlx_lm_decodes_them_alone():
    m = model("llama", **QM)
    got, back = generate(m, [filled(m, quantized(m), p) for p in PREFIX])
    for prompt, prefix, rows, b in zip(PROMPTS, PREFIX, got, back):
        c = filled(m, quantized_theirs(m), prefix)
        ref = [lp for _, lp in generate_step(mx.array(prompt), m, prompt_cache=c, max_tokens=N)]
        assert float(mx.abs(rows - mx.stack(ref)).max()) < TOL
        assert leaf_types(b) == [K.QuantizedKVCache] * len(m.layers)
        assert float(mx.abs(next_logits(m, b) - next_logits(m, c)).max()) < TOL
    # mlx-lm's own quantized cache does not batch: the batch form is ours alone.
    with pytest.raises(ValueError, match="batching"):
        generate(m, [filled(m, quantized_theirs(m), p) for p in PREFIX])


def test_quantized_batches_refuse_mixed_settings():
    m = model("llama", **QM)
    a, b = quantized(m, 8)()[0], quantized(m, 4)()[0]
    with pytest.raises(ValueError, match="group_size, bits"):
        K.QuantizedKVCache.merge([a, b])
    x, y = K.QuantizedKVCache.merge([a]), K.QuantizedKVCache.merge([b])
    with pytest.raises(ValueError, match="cannot extend"):
        x.extend(y)


# -- merge / extend / filter / extract, empty caches included ----------------------------------
@pytest.mark.parametrize("name,make,make_ref", [
    ("llama", ours, theirs), ("gemma3_text", ours, theirs), ("qwen3_next", ours, theirs),
    ("llama:q", quantized, None)])
def test_empty_merged_extended_filtered_extracted(name, make, make_ref):
    """An all-empty merge, extended with a merge of filled caches, filtered, fed, extracted:
    each row's logits equal the same tokens run alone on mlx-lm's caches."""
    base, q = name.split(":")[0], name.endswith(":q")
    m = model(base, **(QM if q else {}))
    empty = [make(m)() for _ in range(2)]
    batch = [c[0].merge([e[i] for e in empty]) for i, c in enumerate(zip(*empty))]
    assert all(c.empty() for c in batch)
    prefixes = [[10, 11, 12], [13]]
    full = [filled(m, make(m), p) for p in prefixes]
    other = [c[0].merge([f[i] for f in full]) for i, c in enumerate(zip(*full))]
    for c, o in zip(batch, other):
        c.extend(o)
    for c in batch:  # keep one empty row and one filled one
        c.filter([1, 2])
    kept = [[], prefixes[0]]
    # mlx-lm's own batch path: right padding in a chunk, then finalize
    tokens = [[4, 5, 6], [7, 8]]
    for c in batch:
        c.prepare(lengths=[3, 2], right_padding=[0, 1])
    m(mx.array([[4, 5, 6], [7, 8, 0]]), cache=batch)
    for c in batch:
        c.finalize()
    step = m(mx.array([[9], [9]]), cache=batch)[:, -1]
    ref_make = (lambda: quantized_theirs(m)()) if q else theirs(m)
    for row, (k, t) in enumerate(zip(kept, tokens)):
        alone = filled(m, ref_make, k + t)
        ref = m(mx.array([[9]]), cache=alone)[0, -1]
        assert float(mx.abs(step[row] - ref).max()) < TOL
        ex = [c.extract(row) for c in batch]
        assert all(isinstance(c, K.LEAF_TYPES) for c in ex)
        assert [c.offset for c in ex] == [len(k + t) + 1] * len(ex)
        assert float(mx.abs(next_logits(m, ex) - next_logits(m, alone)).max()) < TOL


def test_recurrent_rows_of_unknown_length_extract_as_mlx_lm_does():
    """A row merged from mlx-lm's ArraysCache (it counts no tokens), or a model that never
    calls advance (Mamba-1), extracts as mlx-lm's class: never ours with a wrong offset."""
    m = model("qwen3_next")
    mixed = [filled(m, ours(m), [1, 2, 3]), filled(m, theirs(m), [4, 5])]
    batch = [c[0].merge([x[i] for x in mixed]) for i, c in enumerate(zip(*mixed))]
    m(mx.array([[6], [6]]), cache=batch)
    rec = [c for c in batch if isinstance(c, K.BatchRecurrentCache)]
    assert rec
    for c in rec:
        a, b = c.extract(0), c.extract(1)
        assert type(a) is K.RecurrentCache and a.offset == 4
        assert type(b) is mlc.ArraysCache
    mb = model("mamba")
    _, back = generate(mb, [filled(mb, ours(mb), [1, 2]), ours(mb)()], prompts=PROMPTS[:2])
    assert all(type(c) is mlc.ArraysCache for b in back for c in b)


# -- the two meanings of merge -------------------------------------------------------------------
def test_merge_means_batch_with_one_argument_and_snapshots_with_two():
    c = K.KVCache()
    k = mx.ones((1, 2, 4, 8))
    c.update(k, k)
    a = c.snapshot(0)
    c.update(k, k)
    b = c.snapshot(4)
    merged = c.merge(a, b)  # the seed's snapshot merge, on the layer's cache
    assert isinstance(merged, K.KVSnapshot) and (merged.from_offset, merged.to_offset) == (0, 8)
    assert isinstance(K.KVCache.merge([c, K.KVCache()]), K.BatchKVCache)  # mlx-lm's, on the class
    assert isinstance(c.merge([c]), K.BatchKVCache)  # ... and on an instance, as mlx-lm calls it
    assert isinstance(c.merge(caches=[c]), K.BatchKVCache)
    with pytest.raises(TypeError, match="on the class"):
        K.KVCache.merge(merged, merged)
    with pytest.raises(TypeError, match="snapshots where caches"):
        c.merge([merged])
    with pytest.raises(ValueError, match="does not support batching"):
        K.ChunkedKVCache.merge([K.ChunkedKVCache(8)])
    r = K.RotatingKVCache(4)
    r.update(k, k)
    s = r.snapshot(0)
    assert r.merge(None, s) is s and r.merge_snapshots(None, s) is s
    assert isinstance(K.RotatingKVCache.merge([r]), K.BatchRotatingKVCache)
    assert isinstance(K.RecurrentCache.merge([K.RecurrentCache(2)]), K.BatchRecurrentCache)


def test_cache_list_of_ours_merges_through_each_member():
    """mlx-lm's ``CacheList.merge`` calls ``merge([...])`` on each member's first instance."""
    lists = [mlc.CacheList(K.RecurrentCache(2), K.KVCache()) for _ in range(2)]
    merged = mlc.CacheList.merge(lists)
    assert [type(c) for c in merged.caches] == [K.BatchRecurrentCache, K.BatchKVCache]
