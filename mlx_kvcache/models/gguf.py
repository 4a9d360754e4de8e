"""Load a llama-architecture GGUF file as an mlx-lm model plus tokenizer.

Public API
----------
``load_gguf(path, *, dequantize=None) -> (model, tokenizer)``
    ``model`` is an ``mlx_lm.models.llama.Model``; ``tokenizer`` an
    ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a
    ``transformers.PreTrainedTokenizerFast`` built from the GGUF vocabulary.
``read_gguf_header(path) -> GGUFHeader``
    The bounds-checked pre-check of the header (``gguf_header``) that keeps a corrupt
    file away from MLX's reader.
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

The model is built in ``gguf_model``, the tokenizer in ``gguf_tokenizer``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError
from .gguf_header import SUPPORTED_TYPES, read_gguf_header
from .gguf_model import build_model, default_dequantize
from .gguf_tokenizer import build_tokenizer

__all__ = ["ModelLoadError", "read_gguf_header", "load_gguf", "build_tokenizer"]

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
        dequantize = default_dequantize()
    model = build_model(weights, meta, path, bool(dequantize))
    tokenizer = build_tokenizer(meta, path)
    return model, tokenizer
