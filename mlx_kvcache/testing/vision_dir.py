"""A tiny random-weight Muse Spark directory: mlx-lm 0.32.2's one vision model
(``mlx_lm.models.muse_spark`` with its image processor ``mlx_lm.processors.muse_spark``),
small enough that ``python -m mlx_lm server --model DIR --trust-remote-code`` answers a
chat request with an image on a CPU in well under a second (see `write_vision_dir`).

Why ``--trust-remote-code``: Muse Spark's text model calls fused Metal kernels
(``mlx_lm.kernels``: the expert routing, the q/k head norms with RoPE, the gated attention
output norm, the norm-add-norm of the residual stream, the expert combine), which raise
``[metal_kernel] No Metal back-end`` on MLX's CPU (and CUDA) builds. So the directory's
``model.py`` (``model_file`` in ``config.json``) is a copy of this module: its `Model` is
``muse_spark.Model``, and where MLX has no Metal back-end it first points the model
module at `CPU_KERNELS` — plain-MLX versions of those kernels, the same math (fp32 sums,
one rounding to the input dtype where the kernels round). Every server process that loads
the directory (stock ``mlx_lm.server`` and ``mlx-kvcache serve`` alike) runs the same
code, so their answers are comparable token by token. With Metal the stock kernels run.

Standalone on purpose, like `paged_model`: mlx-lm imports this file from the model
directory as ``custom_model``; only `write_vision_dir` uses this package (lazily).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx import nn
from mlx_lm.models import muse_spark

__all__ = ["IMAGE_TEMPLATE", "IMAGE_TOKENS", "TEXT_CONFIG", "VISION_CONFIG", "CPU_KERNELS",
           "Model", "ModelArgs", "png_bytes", "black_png", "image_data_url", "write_vision_dir"]

ModelArgs = muse_spark.ModelArgs

#: The processor's image markup, added to the character tokenizer as whole tokens (in
#: this order, after its 103 tokens): ``<|patch|>`` is the image token.
IMAGE_TOKENS = ["<|image_start|>", "<|patch|>", "<|image_end|>"]

#: The character tokenizer's template (`dirs.CHAT_TEMPLATE`) with content parts: a
#: message's content is a string, or — as mlx-lm's ``process_message_content(...,
#: keep_images=True)`` leaves a message with images — a list of parts, text parts
#: rendered as their text and each image part as one ``<|patch|>`` (the processor
#: expands it to ``<|image_start|>`` + one ``<|patch|>`` per image token + ``<|image_end|>``).
IMAGE_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for p in content -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}"
    "{%- elif p['type'] in ['image_url', 'image', 'input_image'] -%}<|patch|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|system|>{{ render(m['content']) }}</s>"
    "{%- elif m['role'] == 'user' -%}<|user|>{{ render(m['content']) }}</s>"
    "{%- else -%}<|assistant|>{{ render(m['content']) }}</s>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

#: The text model: two layers — a sliding-window one with RoPE, a full-attention one
#: without (``layer_rope_theta`` 0) — each with four experts, two per token.
TEXT_CONFIG: Dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, rms_norm_eps=1e-5, post_norm_eps=1e-5,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    layer_rope_theta=[10000.0, 0.0], layer_types=["sliding_attention", "full_attention"],
    sliding_window=128, final_logit_softcapping=30.0, output_multiplier=1.0,
    num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32, moe_intermediate_size=32,
    mlp_layer_types=["sparse", "sparse"])

#: The vision tower: two layers (a windowed one, a full one), 4-pixel patches merged 2 x 2,
#: so one image token is 8 x 8 pixels (a 16 x 16 image is 4 image tokens); a 4 x 4
#: position table, so images wider or taller than 16 pixels attend in windows.
VISION_CONFIG: Dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_channels=3, patch_size=4, patch_temporal=2, merge_size=2, pos_emb_height=4,
    pos_emb_width=4, layer_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0})


# -- the kernels in plain MLX ----------------------------------------------------------------
def _rstd(v: mx.array, eps: float) -> mx.array:
    """1 / RMS(v) over the last axis, in fp32."""
    return mx.rsqrt(mx.mean(mx.square(v), axis=-1, keepdims=True) + eps)


def expert_routing(logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float,
                   score_eps: float, route_scale: float) -> List[mx.array]:
    """Sigmoid scores, the top ``top_k`` experts by score + bias (best first), and their
    scores normalised to sum to ``route_scale``: (uint32 indices, fp32 weights)."""
    score = mx.sigmoid(logits.astype(mx.float32) * multiplier)
    biased = score + expert_bias.astype(mx.float32)
    inds = mx.argsort(-biased, axis=-1)[..., :top_k]
    w = mx.take_along_axis(score, inds, axis=-1)
    weights = w / (mx.sum(w, axis=-1, keepdims=True) + score_eps) * route_scale
    return [inds.astype(mx.uint32), weights.astype(mx.float32)]


def norm_add_norm(branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
                  post_weight: Optional[mx.array], post_eps: float,
                  next_norm: Optional[nn.RMSNorm]) -> Tuple[mx.array, Optional[mx.array]]:
    """The post-norm of ``branch`` (``post_weight`` scaling its input), added to the fp32
    ``stream`` with the gate weights, and ``next_norm`` of the sum (None without it)."""
    t = branch.dtype
    v = branch.astype(mx.float32)
    if post_weight is not None:
        v = (post_weight.astype(t).astype(mx.float32) * v).astype(t).astype(mx.float32)
    n = (v * _rstd(v, post_eps)).astype(t).astype(mx.float32)
    new = alpha.astype(mx.float32) * stream.astype(mx.float32) + beta.astype(mx.float32) * n
    if next_norm is None:
        return new, None
    normed = new * _rstd(new, next_norm.eps) * next_norm.weight.astype(mx.float32)
    return new, normed.astype(t)


def pre_norm(stream: mx.array, norm: nn.RMSNorm, *, dtype: mx.Dtype) -> mx.array:
    """``norm`` of the fp32 ``stream``, as `norm_add_norm` computes it."""
    s = stream.astype(mx.float32)
    return (s * _rstd(s, norm.eps) * norm.weight.astype(mx.float32)).astype(dtype)


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array,
                             eps: float) -> mx.array:
    """Each expert output (..., K, D) RMS-normed with ``norm_weight`` scaling its input,
    summed with ``weights`` (..., K) in expert order: (..., D)."""
    t = experts.dtype
    v = experts.astype(mx.float32) * norm_weight.astype(mx.float32)
    v = v * _rstd(v, eps)
    ew = weights.astype(t).astype(mx.float32)[..., None]
    return mx.sum(v * ew, axis=-2).astype(t)


def _qk(qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
        query_scale: float) -> Tuple[mx.array, mx.array]:
    """The normed q (scaled) and k heads of each qkvg row, each rounded as the kernel does."""
    t = qkvg.dtype
    heads = n_heads + n_kv_heads
    x = qkvg[..., : heads * head_dim].astype(mx.float32)
    x = x.reshape(*qkvg.shape[:-1], heads, head_dim)
    y = (x * _rstd(x, eps)).astype(t)
    q = (y[..., :n_heads, :].astype(mx.float32) * query_scale).astype(t)
    return q, y[..., n_heads:, :]


def qk_norm(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
            query_scale: float) -> List[mx.array]:
    """The q (..., n_heads, head_dim) and k (..., n_kv_heads, head_dim) head norms."""
    return list(_qk(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale))


def qk_norm_rope(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                 query_scale: float, rope_base: float,
                 offset: Union[int, mx.array]) -> List[mx.array]:
    """`qk_norm`, then RoPE on neighbour pairs (2i, 2i + 1) (``traditional=True``) at
    positions ``offset``, ``offset + 1``, ... (``offset``: an int or one per batch row)."""
    q, k = _qk(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    L = qkvg.shape[-2]
    pos = mx.arange(L, dtype=mx.float32)
    if isinstance(offset, mx.array):
        off = offset.reshape(-1).astype(mx.float32)
        pos = off[:, None] + pos[None] if off.size > 1 else pos + off[0]
    else:
        pos = pos + offset
    half = head_dim // 2
    inv_freq = mx.power(mx.array(rope_base, dtype=mx.float32),
                        -mx.arange(half, dtype=mx.float32) / half)
    theta = pos[..., None] * inv_freq  # (..., L, half)
    cos, sin = mx.cos(theta)[..., None, :], mx.sin(theta)[..., None, :]  # (..., L, 1, half)

    def rotate(x: mx.array) -> mx.array:
        f = x.astype(mx.float32)
        a, b = f[..., 0::2], f[..., 1::2]
        out = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)

    return [rotate(q), rotate(k)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """rms_norm(x) * sigmoid(gate) per head: x (B, H, L, D), gate (B, L, H * D), the
    result (B, L, H * D) in x's dtype."""
    B, H, L, D = x.shape
    v = x.astype(mx.float32).transpose(0, 2, 1, 3)
    g = gate.astype(mx.float32).reshape(B, L, H, D)
    return (v * _rstd(v, eps) * mx.sigmoid(g)).reshape(B, L, H * D).astype(x.dtype)


#: The names ``mlx_lm.models.muse_spark`` imports from ``mlx_lm.kernels``, in plain MLX.
CPU_KERNELS: Dict[str, Callable[..., Any]] = {
    "expert_routing": expert_routing, "norm_add_norm": norm_add_norm, "pre_norm": pre_norm,
    "post_expert_norm_combine": post_expert_norm_combine, "qk_norm": qk_norm,
    "qk_norm_rope": qk_norm_rope, "rms_norm_sigmoid_gate": rms_norm_sigmoid_gate}


def _use_cpu_kernels() -> None:
    """Without a Metal back-end, point ``muse_spark`` at `CPU_KERNELS` (idempotent)."""
    if not mx.metal.is_available():
        for name, fn in CPU_KERNELS.items():
            setattr(muse_spark, name, fn)


class Model(muse_spark.Model):
    """``muse_spark.Model``, on `CPU_KERNELS` where MLX has no Metal back-end."""

    def __init__(self, args: ModelArgs):
        _use_cpu_kernels()
        super().__init__(args)


# -- images ----------------------------------------------------------------------------------
def _png(width: int, height: int, rows) -> bytes:
    """An 8-bit RGB PNG of ``rows`` (each row's bytes), written by hand (zlib, no Pillow)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    co = zlib.compressobj(1)
    idat = b"".join(co.compress(b"\x00" + row) for row in rows) + co.flush()  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A ``width`` x ``height`` RGB PNG of random pixels (a different image per ``seed``)."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return _png(width, height, (row.tobytes() for row in pixels))


def black_png(width: int, height: int) -> bytes:
    """A black ``width`` x ``height`` RGB PNG: small on the wire (~0.5 MB for 13,000²),
    large once decoded (~500 MB) — what the server's image checks are about."""
    row = bytes(width * 3)
    return _png(width, height, (row for _ in range(height)))


def image_data_url(width: int = 16, height: int = 16, seed: int = 0) -> str:
    """`png_bytes` as a ``data:image/png;base64,...`` URL (what mlx-lm's server decodes)."""
    import base64

    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode()


# -- the directory ---------------------------------------------------------------------------
def write_vision_dir(path: Union[str, Path], seed: int = 0, **text_config: Any) -> Path:
    """Write a tiny random-weight Muse Spark model directory at ``path`` and return it:

    * ``config.json``: ``model_type`` ``muse_spark`` with `TEXT_CONFIG` and
      `VISION_CONFIG`, ``image_token_id`` the tokenizer's ``<|patch|>``,
      ``processor_type`` ``muse_spark`` (mlx-lm picks the processor by the model's module
      name, which for a ``model_file`` model is not ``muse_spark``) and ``model_file``
      ``model.py`` (a copy of this module: see the module doc; servers need
      ``--trust-remote-code``);
    * ``model.safetensors`` (+ its index): the parameters of a freshly built model in
      float32 (MLX's CPU build runs mixture-of-experts in float32), zero-initialised ones
      (the router and its bias) drawn at random like `dirs.write_model_dir`'s, so every
      expert is used; stored as ``muse_spark.Model.sanitize`` takes converted weights;
    * the character tokenizer (`dirs`) with `IMAGE_TOKENS` and `IMAGE_TEMPLATE`; its
      ``tokenizer_config.json`` sets ``chat_template_type`` and ``tool_parser_type`` to
      null, so mlx-lm does not apply Muse Spark's defaults (its response format starts
      in a header state that drops text a random model never leaves);
    * ``processor_config.json``: the processor's settings (mlx-lm 0.32.2's
      ``Processor.from_config`` reads ``patch_size`` and ``merge_size`` from the vision
      config and defaults the rest to these values).

    ``seed`` seeds the weights. Deterministic: the same ``seed`` writes the same weights.
    ``text_config``: overrides of `TEXT_CONFIG` (e.g. ``sliding_window=16``, so that the
    sliding-window layer's rotating cache wraps inside a prompt and cannot be rewound).
    """
    from mlx_kvcache.testing.agent_dirs import write_char_tokenizer
    from mlx_kvcache.testing.dirs import CHARS, SPECIALS, save_random_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_char_tokenizer(path, IMAGE_TEMPLATE, IMAGE_TOKENS)
    ids = {t: i for i, t in enumerate(SPECIALS + CHARS + IMAGE_TOKENS)}
    assert vocab == len(ids)
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.update(chat_template_type=None, tool_parser_type=None)
    tok_config_path.write_text(json.dumps(tok_config, indent=2))

    config: Dict[str, Any] = {
        "model_type": "muse_spark", "model_file": "model.py", "processor_type": "muse_spark",
        "text_config": dict(TEXT_CONFIG, vocab_size=vocab, **text_config),
        "vision_config": dict(VISION_CONFIG), "image_token_id": ids["<|patch|>"],
        "out_hidden_size": VISION_CONFIG["hidden_size"] * VISION_CONFIG["merge_size"] ** 2,
        "projector_hidden_size": 64,
        # Read by transformers only (AutoTokenizer loads the config): its strict
        # MuseSparkConfig wants the audio tower's width to be the text model's; mlx-lm
        # has no audio tower.
        "audio_config": {"out_hidden_size": TEXT_CONFIG["hidden_size"]},
        "eos_token_id": ids["</s>"], "bos_token_id": ids["<s>"]}
    for key in ("eos_token_id", "bos_token_id"):  # transformers checks them against the vocab
        config["text_config"][key] = config[key]

    mx.random.seed(seed)
    save_random_weights(path, muse_spark.Model(ModelArgs.from_dict(config)))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(__file__, path / "model.py")
    (path / "processor_config.json").write_text(json.dumps({
        "patch_size": VISION_CONFIG["patch_size"],
        "downsample_factor": VISION_CONFIG["merge_size"],
        "min_num_image_tokens": 1, "max_num_image_tokens": 4096,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, indent=2))
    return path
