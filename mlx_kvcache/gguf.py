"""Load a llama-architecture GGUF file as an mlx-lm model plus tokenizer.

Public API
----------
``load_gguf(path, *, dequantize=None) -> (model, tokenizer)``
    ``model`` is an ``mlx_lm.models.llama.Model``; ``tokenizer`` an
    ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
    ``transformers.PreTrainedTokenizerFast`` built from the GGUF vocabulary.
``read_gguf_header(path) -> GGUFHeader``
    A pure-Python, bounds-checked parse of the header (metadata + tensor table).
``ModelLoadError``
    Raised for every problem with the file: missing, unreadable, truncated or
    corrupt, unsupported architecture / tensor type / tokenizer, missing tensor.

Weights are read with ``mx.load(path, return_metadata=True)``. MLX returns the
GGUF quantized types Q4_0, Q4_1 and Q8_0 as affine ``weight``/``scales``/``biases``
triples (group size 32, 4 or 8 bits) and F32/F16 tensors as plain arrays.
Before handing the file to MLX we validate its header ourselves: MLX's GGUF
reader crashes the process (SIGSEGV) on some corrupt headers.

Quantized tensors stay quantized (``nn.QuantizedLinear``/``QuantizedEmbedding``,
float16 activations) when MLX has a GPU backend (Metal or CUDA), which has fast
quantized kernels; on the CPU build they are dequantized to float32 by default,
because MLX's CPU quantized matmul is much slower (~31x for a 4-bit prefill).
``dequantize=True/False`` overrides the choice.

GGUF llama files store the Q/K projection rows permuted for llama.cpp's
interleaved ("NORM") RoPE, so the model is built with ``rope_traditional=True``.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("mlx_kvcache")

__all__ = ["ModelLoadError", "GGUFHeader", "read_gguf_header", "load_gguf"]


class ModelLoadError(ValueError):
    """A model file or spec could not be loaded; the message says why."""


# --------------------------------------------------------------------------
# Header parsing (pure Python, bounds-checked)
# --------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Tensor types this loader accepts (what MLX's GGUF reader converts).
SUPPORTED_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}

# GGUF metadata value types: id -> struct format (None: string/array)
_VT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
           7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_VT_STRING, _VT_ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (innermost) first
    type_id: int
    offset: int  # relative to the data section

    @property
    def type_name(self) -> str:
        t = GGML_TYPES.get(self.type_id)
        return t[0] if t else f"unknown type id {self.type_id}"

    @property
    def nbytes(self) -> int | None:
        t = GGML_TYPES.get(self.type_id)
        if t is None:
            return None
        n = 1
        for d in self.shape:
            n *= d
        return n // t[1] * t[2]


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    skipped_arrays: set[str] = field(default_factory=set)


class _Reader:
    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path = f, size, path

    def read(self, n: int) -> bytes:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF header (read of {n} bytes "
                f"at offset {pos} runs past the end of the {self.size}-byte file)"
            )
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.read(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, keep_array: bool):
        if vtype in _VT_FMT:
            return self.unpack(_VT_FMT[vtype])
        if vtype == _VT_STRING:
            return self.string()
        if vtype == _VT_ARRAY:
            etype = self.unpack("<I")
            n = self.unpack("<Q")
            if etype in _VT_FMT:
                size = struct.calcsize(_VT_FMT[etype])
                raw = self.read(n * size)
                if not keep_array:
                    return None
                return list(struct.unpack(f"<{n}{_VT_FMT[etype][1]}", raw))
            if etype == _VT_STRING:
                out = [] if keep_array else None
                for _ in range(n):
                    if keep_array:
                        out.append(self.string())
                    else:
                        self.f.seek(self.unpack("<Q"), os.SEEK_CUR)
                        if self.f.tell() > self.size:
                            self.read(1)  # raises a truncation error
                return out
            raise ModelLoadError(
                f"{self.path}: corrupt GGUF metadata: key {key!r} has an array of "
                f"unsupported element type {etype}"
            )
        raise ModelLoadError(
            f"{self.path}: corrupt GGUF metadata: key {key!r} has unknown value type {vtype}"
        )


# Big arrays that only the tokenizer needs; skipped by read_gguf_header by default.
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
               "tokenizer.ggml.token_type")


def read_gguf_header(path: str | os.PathLike, *, keep_big_arrays: bool = False) -> GGUFHeader:
    """Parse and validate a GGUF header without touching MLX.

    Checks magic, version, string/array bounds, tensor dimensions and types,
    offsets/alignment, and that every tensor's data lies inside the file.
    Raises ModelLoadError naming the path and the problem.
    """
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelLoadError(f"not a regular file: {path}")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelLoadError(f"cannot open model file {path}: {e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size, path)
        if size < 24 or f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic / too short, {size} bytes)")
        f.seek(4)
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: unsupported or corrupt GGUF version {version}")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        # Every tensor info / kv takes well over 8 bytes; reject absurd counts early.
        if n_tensors > size // 8 or n_kv > size // 8:
            raise ModelLoadError(
                f"{path}: corrupt GGUF header (claims {n_tensors} tensors, {n_kv} metadata keys)"
            )
        metadata: dict[str, Any] = {}
        skipped: set[str] = set()
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            keep = keep_big_arrays or key not in _BIG_ARRAYS
            val = r.value(vtype, key, keep)
            if keep:
                metadata[key] = val
            else:
                skipped.add(key)
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims > 8:
                raise ModelLoadError(f"{path}: corrupt tensor info for {name!r} ({n_dims} dims)")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            type_id = r.unpack("<I")
            offset = r.unpack("<Q")
            tensors.append(GGUFTensorInfo(name, shape, type_id, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{path}: corrupt GGUF header (alignment {alignment!r})")
        pos = f.tell()
        data_offset = (pos + alignment - 1) // alignment * alignment
    for t in tensors:
        if t.type_id not in GGML_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has unknown ggml type id {t.type_id} (corrupt file?)"
            )
        if t.offset % alignment:
            raise ModelLoadError(f"{path}: corrupt tensor info: {t.name!r} offset not aligned")
        nb = t.nbytes
        end = data_offset + t.offset + nb
        if end > size:
            raise ModelLoadError(
                f"{path}: file is truncated or corrupt: tensor {t.name!r} ends at byte "
                f"{end} but the file has {size} bytes (incomplete download?)"
            )
    return GGUFHeader(version, metadata, tensors, alignment, data_offset, size, skipped)


# --------------------------------------------------------------------------
# Metadata helpers
# --------------------------------------------------------------------------


def _py(v):
    """mx.load metadata values are mx.array, str or list[str]; make them Python."""
    if hasattr(v, "tolist") and not isinstance(v, (str, list)):
        return v.tolist()
    return v


def _get(meta: dict, key: str, default=None, *, required: bool = False, path=""):
    if key in meta:
        return _py(meta[key])
    if required:
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
    return default


def _scalar(meta, key, typ, default=None, *, required=False, path=""):
    v = _get(meta, key, default, required=required, path=path)
    if v is None:
        return None
    if isinstance(v, list):
        if len(set(v)) == 1:
            v = v[0]
        else:
            raise ModelLoadError(
                f"{path}: per-layer values for {key!r} are not supported ({v[:8]}...)"
            )
    try:
        return typ(v)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad value for GGUF key {key!r}: {v!r}") from e


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

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
    hidden = _scalar(meta, f"{a}.embedding_length", int, required=True, path=path)
    n_layers = _scalar(meta, f"{a}.block_count", int, required=True, path=path)
    n_heads = _scalar(meta, f"{a}.attention.head_count", int, required=True, path=path)
    n_kv = _scalar(meta, f"{a}.attention.head_count_kv", int, n_heads, path=path)
    ffn = _scalar(meta, f"{a}.feed_forward_length", int, required=True, path=path)
    eps = _scalar(meta, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-5, path=path)
    theta = _scalar(meta, f"{a}.rope.freq_base", float, 10000.0, path=path)
    ctx = _scalar(meta, f"{a}.context_length", int, None, path=path)
    head_dim = _scalar(meta, f"{a}.attention.key_length", int, hidden // n_heads, path=path)
    v_dim = _scalar(meta, f"{a}.attention.value_length", int, head_dim, path=path)
    rope_dims = _scalar(meta, f"{a}.rope.dimension_count", int, head_dim, path=path)
    if v_dim != head_dim:
        raise ModelLoadError(f"{path}: key_length {head_dim} != value_length {v_dim} not supported")
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: partial RoPE (rope.dimension_count {rope_dims} != head dim {head_dim}) "
            "not supported"
        )
    if "token_embd.weight" not in weights:
        raise ModelLoadError(f"{path}: required tensor 'token_embd.weight' is missing")
    vocab = _scalar(meta, f"{a}.vocab_size", int, None, path=path)
    if vocab is None:
        vocab = int(weights["token_embd.weight"].shape[0])
    rope_scaling = None
    stype = _get(meta, f"{a}.rope.scaling.type")
    if stype not in (None, "none"):
        factor = _scalar(meta, f"{a}.rope.scaling.factor", float, 1.0, path=path)
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


def _default_dequantize() -> bool:
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


def _build_model(weights: dict, meta: dict, path: str, dequantize: bool):
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


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names whose regex is GPT-2's with digits split one by one.
_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}


def _pre_tokenizer(pre: str | None, path: str):
    from tokenizers import Regex, pre_tokenizers as pt

    bl = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking"):
        return bl
    if pre in _DIGITS_GPT2:
        return pt.Sequence([pt.Digits(individual_digits=True), bl])
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "smaug-bpe": _LLAMA3_REGEX,
             "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is not None:
        return pt.Sequence([
            pt.Split(Regex(regex), behavior="isolated", invert=False),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    log.warning("%s: unknown GGUF pre-tokenizer %r; using the GPT-2 byte-level regex", path, pre)
    return bl


def build_tokenizer(meta: dict, path: str = "<gguf>"):
    """TokenizerWrapper from GGUF `tokenizer.ggml.*` metadata (byte-level BPE only)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _get(meta, "tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    tokens = _get(meta, "tokenizer.ggml.tokens", required=True, path=path)
    merges = _get(meta, "tokenizer.ggml.merges", required=True, path=path)
    ttypes = _get(meta, "tokenizer.ggml.token_type", None)
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelLoadError(f"{path}: malformed tokenizer vocabulary / merges")
    if ttypes is None:
        ttypes = [1] * len(tokens)
    if len(ttypes) != len(tokens):
        raise ModelLoadError(f"{path}: token_type has {len(ttypes)} entries for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{path}: malformed BPE merge {m!r}")
        pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(_get(meta, "tokenizer.ggml.pre"), path)
    tok.decoder = decoders.ByteLevel()

    # Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    control = [tokens[i] for i, t in enumerate(ttypes) if t in (2, 3)]
    user = [tokens[i] for i, t in enumerate(ttypes) if t == 4]
    if control:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def tok_of(key):
        i = _get(meta, key)
        if i is None or not (0 <= int(i) < len(tokens)):
            return None
        return tokens[int(i)]

    bos, eos = tok_of("tokenizer.ggml.bos_token_id"), tok_of("tokenizer.ggml.eos_token_id")
    unk, pad = tok_of("tokenizer.ggml.unknown_token_id"), tok_of("tokenizer.ggml.padding_token_id")
    add_bos = bool(_get(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_get(meta, "tokenizer.ggml.add_eos_token", False))
    post = [processors.ByteLevel(trim_offsets=False)]
    use_bos, use_eos = bool(add_bos and bos), bool(add_eos and eos)
    if use_bos or use_eos:
        single = ([bos] if use_bos else []) + ["$A"] + ([eos] if use_eos else [])
        specials = {t: vocab[t] for t in ([bos] if use_bos else []) + ([eos] if use_eos else [])}
        post.append(processors.TemplateProcessing(single=" ".join(single),
                                                  special_tokens=list(specials.items())))
    tok.post_processor = processors.Sequence(post)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        chat_template=_get(meta, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=_scalar(meta, "llama.context_length", int, 1 << 30),
    )
    extra_eos = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = _get(meta, key)
        if i is not None and 0 <= int(i) < len(tokens):
            extra_eos.append(int(i))
    eos_ids = ([vocab[eos]] if eos else []) + extra_eos
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=eos_ids)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def load_gguf(path: str | os.PathLike, *, dequantize: bool | None = None):
    """Load a llama GGUF file -> (mlx_lm llama Model, TokenizerWrapper).

    dequantize: None -> float32 on MLX's CPU build, keep quantized with a GPU
    backend (Metal/CUDA); True/False force it.
    """
    import mlx.core as mx

    path = str(Path(path).expanduser())
    header = read_gguf_header(path)  # validates before MLX sees the file
    arch = header.metadata.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"{path}: unsupported model architecture {arch!r} (only 'llama' is supported)"
        )
    bad = [t for t in header.tensors if t.type_name not in SUPPORTED_TYPES]
    if bad:
        types = sorted({t.type_name for t in bad})
        raise ModelLoadError(
            f"{path}: unsupported tensor type(s) {', '.join(types)} (e.g. tensor "
            f"{bad[0].name!r}); supported: {', '.join(sorted(SUPPORTED_TYPES))}"
        )
    try:
        weights, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError with terse messages
        raise ModelLoadError(f"{path}: MLX could not read the GGUF file: {e}") from e
    if dequantize is None:
        dequantize = _default_dequantize()
    model = _build_model(weights, meta, path, bool(dequantize))
    tokenizer = build_tokenizer(meta, path)
    return model, tokenizer
