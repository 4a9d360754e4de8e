"""The one chunked prefill (`generation.prefill`): chunks of at most ``step`` that end
exactly at every planned stop and at the ``kv_bits`` switch, a checkpoint at each stop,
progress after each chunk, both models of a pair fed; the caches then hold what a cold
run of mlx-lm's own caches holds (next-token log-probs to 1e-4)."""

import mlx.core as mx
from mlx_lm.models import cache as mlc

from mlx_kvcache.caches import KVQuantization
from mlx_kvcache.generation.model_pair import ModelPair
from mlx_kvcache.generation.prefill import Feed, prefill
from mlx_kvcache.prefix.live import LiveSet
from models import V, model
from reference import FLOAT_TOL

TOL = FLOAT_TOL  # float32 summation-order noise: see reference.FLOAT_TOL


class Recording(ModelPair):
    """A pair that records the length of every pass."""

    def __init__(self, *a):
        super().__init__(*a)
        self.passes = []

    def forward(self, x, caches):
        self.passes.append(int(x.shape[-1]))
        return super().forward(x, caches)


def logprobs(m, caches, tok):
    out = m(mx.array([[tok]]), cache=caches)[0, -1]
    return out - mx.logsumexp(out)


def test_chunks_stop_exactly_at_stops_and_the_switch():
    heads = dict(num_attention_heads=2, num_key_value_heads=1)  # head dim 32: one kv group
    m, d = model("llama", **heads), model("llama", seed=2, vocab_size=V - 28, **heads)
    pair = Recording(m, d)
    quant = KVQuantization(8, 32, 13)
    live = LiveSet(pair.make_caches(), quant=quant)
    tokens = [(7 * i + 3) % V for i in range(40)]
    feed = Feed(pair, live)
    marks, progress = [], []
    end = prefill(feed, tokens, 0, 39, step=8, stops=[5, 20, 39],
                  checkpoint=marks.append, progress=progress.append)
    assert end == 39 and marks == [5, 20, 39]
    assert pair.passes == [5, 8, 7, 8, 8, 3]  # ends: 5 13 20 28 36 39 (13: the switch)
    assert progress == [5, 13, 20, 28, 36, 39]
    assert list(feed.fed) == tokens[:39] and feed.pending == []
    target, drafted = feed.lists()
    assert all(c.offset == 39 for c in target + drafted)
    assert all(type(c).__name__ == "QuantizedKVCache" for c in target + drafted)
    ref = mlc.make_prompt_cache(m)  # mlx-lm's caches, switched at 13 by mlx-lm
    m(mx.array([tokens[:13]]), cache=ref)
    ref = [c.to_quantized(group_size=32, bits=8) for c in ref]
    m(mx.array([tokens[13:39]]), cache=ref)
    got, want = logprobs(m, target, tokens[39]), logprobs(m, ref, tokens[39])
    assert float(mx.abs(got - want).max()) < TOL
