"""Offline mlx-lm model directories for servers and ``sharded_load``: random float32
weights, ``config.json``, a safetensors index and a one-character-per-token tokenizer
with a chat template."""

import mlx.core as mx

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}</s>"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DIR_VOCAB = len(SPECIALS) + len(CHARS)  # 103: one token per character

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=DIR_VOCAB,
             rope_theta=10000.0, max_position_embeddings=4096)
DIR_CONFIGS = {
    "llama": dict(_TINY, model_type="llama", num_hidden_layers=2, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # [Rotating(8), KV, Rotating(8), KV], one KV head
    "gemma3_text": dict(_TINY, model_type="gemma3_text", num_hidden_layers=4,
                        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                        rope_local_base_freq=10000.0, query_pre_attn_scalar=16,
                        sliding_window=8, sliding_window_pattern=2),
    # three gated-delta-net layers and one attention layer, mixture of experts
    "qwen3_next": dict(_TINY, model_type="qwen3_next", num_hidden_layers=4, num_key_value_heads=2,
                       head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, shared_expert_intermediate_size=32,
                       mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
                       partial_rotary_factor=0.25, norm_topk_prob=True,
                       tie_word_embeddings=False, attention_bias=False,
                       full_attention_interval=4),
    # three MLA layers (an odd count: pipeline ranks hold different layers), MoE after the first
    "deepseek_v3": dict(_TINY, model_type="deepseek_v3", moe_intermediate_size=32,
                        num_hidden_layers=3, num_key_value_heads=4, n_shared_experts=1,
                        n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                        n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
                        first_k_dense_replace=1, rms_norm_eps=1e-6, attention_bias=False),
    # a hybrid whose layers pipeline ranks split unevenly: [gated delta net, attention,
    # gated delta net] (the config nests the text model, as Qwen3.5's does)
    "qwen3_5": {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(
        _TINY, model_type="qwen3_5_text", num_hidden_layers=3, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "rope_type": "default"})},
    # full attention with head_dim 32: quantized KV (``--kv-bits``) needs head dims that are
    # a multiple of its group size (32 or 64)
    "llama_hd32": dict(_TINY, model_type="llama", num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    # chunked attention (chunks of 8): three `ChunkedKVCache` layers and one `KVCache`
    "llama4": {"model_type": "llama4", "text_config": dict(
        _TINY, model_type="llama4_text", attention_bias=False, attention_chunk_size=8,
        head_dim=16, intermediate_size=64, intermediate_size_mlp=128,
        interleave_moe_layer_step=2, num_experts_per_tok=1, num_hidden_layers=4,
        num_key_value_heads=2, num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None,
        use_qk_norm=True, floor_scale=8)},
    # Mamba-1: recurrent layers only, which ignore the batch path's padding masks
    "mamba": dict(model_type="mamba", vocab_size=DIR_VOCAB, hidden_size=64,
                  intermediate_size=128, state_size=8, num_hidden_layers=2, conv_kernel=4,
                  use_bias=False, use_conv_bias=True, time_step_rank=4,
                  tie_word_embeddings=True),
}


def write_tokenizer_dir(path) -> None:
    """A one-character-per-token tokenizer with a chat template, via transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_model_dir(path, kind: str = "llama", seed: int = 0, **overrides):
    """An offline mlx-lm model directory: random float32 weights (mixture-of-experts needs
    float32 on MLX's CPU build), ``config.json``, a safetensors index (pipeline loading
    wants one) and the character tokenizer. Returns the path."""
    import importlib
    import json
    from pathlib import Path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(DIR_CONFIGS[kind], **overrides)
    config.update(eos_token_id=SPECIALS.index("</s>"), bos_token_id=SPECIALS.index("<s>"))
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    save_random_weights(path, module.Model(module.ModelArgs.from_dict(config)))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_dir(path)
    return path


def save_random_weights(path, model) -> None:
    """``model``'s parameters, float32, as ``path/model.safetensors`` with its index;
    parameters initialised to zero (expert routing biases) get random values too, so
    every expert is used. Seed MLX's generator first for the same weights every time."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten, tree_map

    path = Path(path)
    params = tree_map(lambda p: (mx.random.normal(p.shape) * 0.5).astype(mx.float32)
                      if p.ndim >= 1 and mx.all(p == 0).item() else p.astype(mx.float32),
                      model.parameters())
    weights = dict(tree_flatten(params))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in sorted(weights)}}))


def write_draft_dir(path, target, sigma: float = 0.3, seed: int = 0):
    """A draft model for speculative decoding: a copy of the model directory ``target``
    (same architecture and tokenizer) with Gaussian noise of ``sigma`` times each weight
    tensor's standard deviation, so it agrees with the target on some tokens only (0: an
    identical copy). Returns the path."""
    import shutil
    from pathlib import Path

    path, target = Path(path), Path(target)
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(target, path)
    weights = mx.load(str(target / "model.safetensors"))
    mx.random.seed(seed)
    noisy = {k: (v + sigma * mx.std(v) * mx.random.normal(v.shape, v.dtype)) if v.ndim else v
             for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), noisy, metadata={"format": "mlx"})
    return path


def write_paged_model_dir(path, seed: int = 0):
    """A model directory whose model makes a cache class neither mlx-lm nor mlx_kvcache
    knows (`paged_model`: a llama keeping its keys and values in pages), loaded through
    mlx-lm's own custom-model mechanism (``model_file`` in its config; servers need
    ``--trust-remote-code``). Returns the path."""
    import json
    import shutil

    from . import paged_model

    path = write_model_dir(path, "llama", seed=seed)
    shutil.copy(paged_model.__file__, path / "model.py")
    config = json.loads((path / "config.json").read_text())
    config["model_file"] = "model.py"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
