"""The mlx-lm llama model built from a GGUF file's weights and metadata.

GGUF llama files store the Q/K projection rows permuted for llama.cpp's interleaved
("NORM") RoPE, so the model is built with ``rope_traditional=True``. Quantized tensors
(MLX returns Q4_0 / Q4_1 / Q8_0 as affine ``weight``/``scales``/``biases`` triples, group
size 32) stay quantized or are dequantized to float32, as `load_gguf` decides.
"""

from __future__ import annotations

import logging

from .errors import ModelLoadError
from .gguf_meta import meta_scalar, meta_value

log = logging.getLogger("mlx_kvcache")


_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs"}  # handled separately


def _mlx_module_name(gguf_base: str) -> str | None:
    """'blk.3.attn_q' -> 'model.layers.3.self_attn.q_proj'; None when unknown."""
    if gguf_base in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_base]
    parts = gguf_base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"
    return None


def _model_args(meta: dict, weights: dict, path: str):
    from mlx_lm.models.llama import ModelArgs

    a = "llama"
    hidden = meta_scalar(meta, f"{a}.embedding_length", int, required=True, path=path)
    n_layers = meta_scalar(meta, f"{a}.block_count", int, required=True, path=path)
    n_heads = meta_scalar(meta, f"{a}.attention.head_count", int, required=True, path=path)
    n_kv = meta_scalar(meta, f"{a}.attention.head_count_kv", int, n_heads, path=path)
    ffn = meta_scalar(meta, f"{a}.feed_forward_length", int, required=True, path=path)
    eps = meta_scalar(meta, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-5, path=path)
    theta = meta_scalar(meta, f"{a}.rope.freq_base", float, 10000.0, path=path)
    ctx = meta_scalar(meta, f"{a}.context_length", int, None, path=path)
    head_dim = meta_scalar(meta, f"{a}.attention.key_length", int, hidden // n_heads, path=path)
    v_dim = meta_scalar(meta, f"{a}.attention.value_length", int, head_dim, path=path)
    rope_dims = meta_scalar(meta, f"{a}.rope.dimension_count", int, head_dim, path=path)
    if v_dim != head_dim:
        raise ModelLoadError(f"{path}: key_length {head_dim} != value_length {v_dim} not supported")
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: partial RoPE (rope.dimension_count {rope_dims} != head dim {head_dim}) "
            "not supported"
        )
    if "token_embd.weight" not in weights:
        raise ModelLoadError(f"{path}: required tensor 'token_embd.weight' is missing")
    vocab = meta_scalar(meta, f"{a}.vocab_size", int, None, path=path)
    if vocab is None:
        vocab = int(weights["token_embd.weight"].shape[0])
    rope_scaling = None
    stype = meta_value(meta, f"{a}.rope.scaling.type")
    if stype not in (None, "none"):
        factor = meta_scalar(meta, f"{a}.rope.scaling.factor", float, 1.0, path=path)
        if stype == "linear":
            rope_scaling = {"type": "linear", "factor": factor}
        else:
            raise ModelLoadError(f"{path}: RoPE scaling type {stype!r} is not supported")
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=ffn,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=eps,
        vocab_size=vocab,
        rope_theta=theta,
        rope_traditional=True,
        rope_scaling=rope_scaling,
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in weights,
    )


def _make_freqs_rope(dims, base, scale, freq_factors):
    """RoPE with llama.cpp's per-frequency factors (the `rope_freqs` tensor of
    Llama 3.1-style GGUFs): theta_i = pos * scale / (base^(2i/d) * factor_i)."""
    import mlx.core as mx
    import mlx.nn as nn

    class GGUFFreqRoPE(nn.Module):
        def __init__(self):
            super().__init__()
            self.dims = dims
            self.scale = scale
            exps = mx.arange(0, dims, 2, dtype=mx.float32) / dims
            self._freqs = (base ** exps) * freq_factors.astype(mx.float32)

        def __call__(self, x, offset=0):
            return mx.fast.rope(x, self.dims, traditional=True, base=None,
                                scale=self.scale, offset=offset, freqs=self._freqs)

    return GGUFFreqRoPE()


def default_dequantize() -> bool:
    """Whether quantized GGUF weights load dequantized by default: yes without a GPU
    (MLX's CPU quantized matmuls are slow), no with Metal or CUDA."""
    import mlx.core as mx

    gpu = False
    try:
        gpu = bool(mx.metal.is_available())
    except Exception:
        pass
    if not gpu:
        try:
            gpu = bool(mx.cuda.is_available())
        except Exception:
            pass
    return not gpu


def build_model(weights: dict, meta: dict, path: str, dequantize: bool):
    """mlx-lm's llama ``Model`` for a GGUF file's ``weights`` and ``meta`` (read from
    ``path``), its quantized weights kept or dequantized."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import Model

    args = _model_args(meta, weights, path)

    required = ["token_embd.weight", "output_norm.weight"]
    for i in range(args.num_hidden_layers):
        required += [f"blk.{i}.{k}.weight" for k in _LAYER_MAP]
    for name in required:
        if name not in weights:
            raise ModelLoadError(f"{path}: required tensor {name!r} is missing")

    # Group GGUF tensors by base name.
    mlx_weights: dict[str, mx.array] = {}
    qparams: dict[str, dict] = {}
    float_dtype = mx.float32 if dequantize else mx.float16
    for key, arr in weights.items():
        base, _, suffix = key.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        if suffix != "weight" or base in _IGNORED:
            if base not in _IGNORED:
                log.debug("ignoring GGUF tensor %s", key)
            continue
        mod = _mlx_module_name(base)
        if mod is None:
            parts = base.split(".")
            if len(parts) > 1 and parts[0] == "blk" and parts[1].isdigit() and int(
                    parts[1]) >= args.num_hidden_layers:
                raise ModelLoadError(
                    f"{path}: tensor {key!r} belongs to a block beyond "
                    f"block_count={args.num_hidden_layers}")
            log.debug("ignoring GGUF tensor %s", key)
            continue
        if f"{base}.scales" in weights:
            scales = weights[f"{base}.scales"]
            biases = weights.get(f"{base}.biases")
            if biases is None:
                raise ModelLoadError(f"{path}: quantized tensor {key!r} has no biases")
            gsize = 32  # GGUF Q4_0 / Q4_1 / Q8_0 blocks
            if arr.shape[-1] % scales.shape[-1]:
                raise ModelLoadError(f"{path}: unexpected quantized layout for {key!r}")
            bits = arr.shape[-1] // scales.shape[-1]
            if bits not in (4, 8):
                raise ModelLoadError(f"{path}: unsupported quantization ({bits} bits) for {key!r}")
            if dequantize:
                mlx_weights[f"{mod}.weight"] = mx.dequantize(
                    arr, scales.astype(mx.float32), biases.astype(mx.float32),
                    group_size=gsize, bits=bits,
                )
            else:
                mlx_weights[f"{mod}.weight"] = arr
                mlx_weights[f"{mod}.scales"] = scales
                mlx_weights[f"{mod}.biases"] = biases
                qparams[mod] = {"group_size": gsize, "bits": bits}
        else:
            if arr.dtype not in (mx.float32, mx.float16, mx.bfloat16):
                raise ModelLoadError(f"{path}: tensor {key!r} has unsupported dtype {arr.dtype}")
            mlx_weights[f"{mod}.weight"] = arr.astype(float_dtype)

    model = Model(args)
    if qparams:
        nn.quantize(model, class_predicate=lambda p, m: qparams.get(p, False))
    try:
        model.load_weights(list(mlx_weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not match the llama model built from "
                             f"the metadata: {e}") from e

    if "rope_freqs.weight" in weights:
        ff = weights["rope_freqs.weight"]
        scale = 1.0 / args.rope_scaling["factor"] if args.rope_scaling else 1.0
        for layer in model.model.layers:
            layer.self_attn.rope = _make_freqs_rope(args.head_dim, args.rope_theta, scale, ff)
    model.eval()
    mx.eval(model.parameters())
    return model

