"""Test access to the tiny model builders (they live in the package for scripts too)."""

from mlx_kvcache.testing import MODELS, V, build  # noqa: F401
