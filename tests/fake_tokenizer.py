"""A token-id-only tokenizer for PrefixCache tests (prompts are passed as ids)."""

from mlx_lm.tokenizer_utils import TokenizerWrapper


class _Detok:
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


class FakeTokenizer(TokenizerWrapper):
    bos_token = None

    def __init__(self, eos=()):  # noqa: D401 - deliberately skips the real wrapper's setup
        self._tokenizer = None
        self._detokenizer = _Detok()
        self._eos_token_ids = set(eos)

    @property
    def detokenizer(self):
        self._detokenizer.reset()
        return self._detokenizer

    @property
    def eos_token_ids(self):
        return self._eos_token_ids
