"""Front-end support: loading models (GGUF files, the embedded default, mlx-lm dirs).

``load_model(spec)`` is the one entry point the commands use; ``gguf`` builds an mlx-lm
llama model and tokenizer from a GGUF file; ``default`` finds the embedded SmolLM2.
"""

from .default import default_model_path, load_default_model, load_model
from .errors import ModelLoadError
from .gguf import load_gguf

__all__ = ["ModelLoadError", "default_model_path", "load_default_model", "load_gguf", "load_model"]
