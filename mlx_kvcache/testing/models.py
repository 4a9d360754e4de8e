"""Tiny random-weight mlx-lm models and a token-id tokenizer, for tests, demos and benchmarks.

Random models often repeat one token, so compare logits, not tokens. Everything is
float32: mixture-of-experts layers need it on MLX's CPU build.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

V = 128


def build(name: str, seed: int = 1, **over):
    """A tiny random-weight model: llama, gemma3_text (window 8), qwen3_next (hybrid, MoE),
    mamba, llama4 (chunked attention, chunk 8: three `ChunkedKVCache` layers and one
    `KVCache`) or deepseek_v41 (its own ``LayerCache``: window 8, compressed groups of 4).
    ``over`` replaces any of the model's arguments (e.g. ``hidden_size``, ``vocab_size``;
    for llama4, those of its text config)."""
    from mlx_lm.models import deepseek_v41, gemma3_text, llama, llama4, mamba, qwen3_next

    mx.random.seed(seed)
    if name == "llama":
        module, kw = llama, dict(
            model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V)
    elif name == "gemma3_text":  # [Rotating, KV, Rotating, KV], window 8
        module, kw = gemma3_text, dict(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, head_dim=16, num_key_value_heads=1, vocab_size=V,
            query_pre_attn_scalar=16, sliding_window_pattern=2, sliding_window=8)
    elif name == "qwen3_next":  # 3 gated-delta-net layers + 1 attention layer, MoE
        module, kw = qwen3_next, dict(
            model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
            mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=V,
            rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=512,
            full_attention_interval=4)
    elif name == "mamba":
        module, kw = mamba, dict(
            model_type="mamba", vocab_size=V, hidden_size=32, intermediate_size=64,
            state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
            use_conv_bias=True, time_step_rank=4, tie_word_embeddings=True)
    elif name == "llama4":
        tc = dict(model_type="llama4_text", attention_bias=False, attention_chunk_size=8,
                  head_dim=16, hidden_size=64, interleave_moe_layer_step=2, intermediate_size=64,
                  intermediate_size_mlp=128, max_position_embeddings=512, num_attention_heads=4,
                  num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
                  num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0,
                  use_qk_norm=True, vocab_size=V, floor_scale=8)
        tc.update(over)
        module, kw, over = llama4, dict(text_config=tc, model_type="llama4"), {}
    elif name == "deepseek_v41":
        module, kw = deepseek_v41, dict(
            vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2, o_lora_rank=16,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            sliding_window=8, compress_ratios=(0, 4, 4, 0), kv_source_layer_ids=(1, 2),
            index_source_layer_ids=(1, 2), index_n_heads=2, index_head_dim=32,
            index_topk=4, hc_mult=2, hc_sinkhorn_iters=3)
    else:
        raise KeyError(name)
    kw.update(over)
    m = module.Model(module.ModelArgs(**kw))
    mx.eval(m.parameters())
    return m


def noisy_copy(name: str, sigma: float, seed: int = 1, noise_seed: int = 0, **over):
    """`build` (same ``name``, ``seed``, ``over``: the same weights) plus Gaussian noise of
    ``sigma`` times each weight tensor's standard deviation: a draft model for speculative
    decoding that agrees less with the target as ``sigma`` grows (0: an identical copy)."""
    from mlx.utils import tree_map

    m = build(name, seed, **over)
    if sigma:
        mx.random.seed(noise_seed)
        m.update(tree_map(lambda p: p + sigma * mx.std(p) * mx.random.normal(p.shape, p.dtype)
                          if p.ndim else p, m.parameters()))
        mx.eval(m.parameters())
    return m


MODELS = ("llama", "gemma3_text", "qwen3_next", "mamba")


class _IdDetokenizer:
    def __init__(self):
        self.tokens = []

    def reset(self):
        self.tokens = []

    def add_token(self, t):
        self.tokens.append(t)

    def finalize(self):
        pass

    @property
    def last_segment(self):
        return f"<{self.tokens[-1]}>" if self.tokens else ""


class TokenIdTokenizer(TokenizerWrapper):
    """A stand-in tokenizer for token-id prompts: ``<id>`` text out, optional EOS ids.

    Enough for `PrefixCache.stream_generate` and `mlx_lm.stream_generate` with random
    tiny models, which have no real vocabulary.
    """

    bos_token = None

    def __init__(self, eos=()):  # deliberately skips the real wrapper's setup
        self._tokenizer = None
        self._eos_token_ids = set(eos)

    @property
    def detokenizer(self):
        return _IdDetokenizer()  # one per caller: requests are detokenized concurrently

    @property
    def eos_token_ids(self):
        return self._eos_token_ids
