"""Test access to the tiny model builders (they live in the package for scripts too), and
one memoised instance of each (model, arguments) for the tests that only read a model."""

from mlx_lm.models.cache import KVCache

from mlx_kvcache.testing import MODELS, V, build  # noqa: F401

_MODELS = {}


def model(name, **over):
    """``build(name, **over)``, built once per test session."""
    key = (name, tuple(sorted(over.items())))
    if key not in _MODELS:
        _MODELS[key] = build(name, **over)
    return _MODELS[key]


class OpaqueStateCache(KVCache):
    """mlx-lm's ``KVCache`` whose state holds something no snapshot can: the one kind the
    trie refuses (caching is off for a model made of it)."""

    @property
    def state(self):
        return self.keys, self.values, self.offset, object()

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset = v[:3]
