"""Test access to the token-id tokenizer stand-in."""

from mlx_kvcache.testing import TokenIdTokenizer as FakeTokenizer  # noqa: F401
