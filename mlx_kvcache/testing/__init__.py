"""Support for tests, demos and benchmarks: tiny random models and a token-id tokenizer
(``models``), offline mlx-lm model directories (``dirs``), server processes on loopback
(``servers``)."""

from .dirs import (
    CHAT_TEMPLATE, DIR_CONFIGS, DIR_VOCAB, SPECIALS, write_draft_dir, write_model_dir,
    write_paged_model_dir, write_tokenizer_dir,
)
from .models import MODELS, V, TokenIdTokenizer, build, noisy_copy

__all__ = ["MODELS", "V", "TokenIdTokenizer", "build", "CHAT_TEMPLATE", "DIR_CONFIGS",
           "DIR_VOCAB", "SPECIALS", "write_model_dir", "write_tokenizer_dir", "noisy_copy",
           "write_draft_dir", "write_paged_model_dir"]
