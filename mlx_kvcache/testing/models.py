"""Tiny random-weight mlx-lm models and a token-id tokenizer, for tests, demos and benchmarks.

Random models often repeat one token, so compare logits, not tokens. Everything is
float32: mixture-of-experts layers need it on MLX's CPU build.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

V = 128


def build(name: str, seed: int = 1, **over):
    """A tiny random-weight model: llama, gemma3_text (window 8), qwen3_next (hybrid, MoE) or mamba."""
    from mlx_lm.models import gemma3_text, llama, mamba, qwen3_next

    mx.random.seed(seed)
    # ``over`` replaces any default below (e.g. more KV heads for a benchmark).
    if name == "llama":
        cls, kw = llama, dict(
            model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V)
    elif name == "gemma3_text":  # [Rotating, KV, Rotating, KV], window 8
        cls, kw = gemma3_text, dict(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, head_dim=16, num_key_value_heads=1, vocab_size=V,
            query_pre_attn_scalar=16, sliding_window_pattern=2, sliding_window=8)
    elif name == "qwen3_next":  # 3 gated-delta-net layers + 1 attention layer, MoE
        cls, kw = qwen3_next, dict(
            model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
            mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=V,
            rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=512,
            full_attention_interval=4)
    elif name == "mamba":
        cls, kw = mamba, dict(
            model_type="mamba", vocab_size=V, hidden_size=32, intermediate_size=64,
            state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
            use_conv_bias=True, time_step_rank=4, tie_word_embeddings=True)
    else:
        raise KeyError(name)
    kw.update(over)
    m = cls.Model(cls.ModelArgs(**kw))
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
