"""Every cache class any mlx-lm architecture asks for is accepted: none is refused.

Building all ~130 architectures with tiny configs is not cheap (each has its own
arguments), so the sweep reads every model file's ``make_cache`` and collects the cache
classes it constructs, then takes each class through what the trie does with a model's
caches: `convert` (mlx-lm's classes become ours; others stay the model's own object),
`leaf_caches` (an adapter for a class without a kind of its own), `layer_signature`, and
an empty snapshot / restore. llama4 and deepseek_v41 run end to end in test_cache_kinds.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from pathlib import Path

import mlx_lm.models
import pytest
from mlx_lm.models import cache as mlc

import mlx_kvcache as mk
from mlx_kvcache.caches import GenericCache, layer_signature
from mlx_kvcache.caches.generic import VETTED, class_name

MODELS_DIR = Path(mlx_lm.models.__file__).parent


def cache_classes():
    """``{class: {model files using it}}`` for every cache class a ``make_cache`` constructs."""
    found = {}
    for f in sorted(MODELS_DIR.glob("*.py")):
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "make_cache"):
                continue
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                if not name.endswith(("Cache", "CacheList")) or name in ("make_cache", "make_prompt_cache"):
                    continue
                cls = getattr(mlc, name, None)
                if cls is None:
                    cls = getattr(importlib.import_module(f"mlx_lm.models.{f.stem}"), name)
                found.setdefault(cls, set()).add(f.stem)
    return found


CLASSES = cache_classes()


def instance(cls):
    if cls is mlc.CacheList:
        return mlc.CacheList(mlc.ArraysCache(2), mlc.KVCache())
    args = [8 for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
    return cls(*args)


def test_the_sweep_sees_every_architecture_with_its_own_caches():
    users = set().union(*CLASSES.values())
    assert len(users) >= 45, sorted(users)  # 53 model files define make_cache in mlx-lm 0.32.2
    names = {c.__name__ for c in CLASSES}
    assert {"KVCache", "RotatingKVCache", "ArraysCache", "ChunkedKVCache", "CacheList",
            "LayerCache"} <= names


@pytest.mark.parametrize("cls", sorted(CLASSES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_no_cache_class_is_refused(cls):
    obj = instance(cls)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ours = mk.convert(obj)
        leaves = mk.leaf_caches([ours])
    sig = layer_signature(leaves)
    for leaf, s in zip(leaves, sig):
        assert s[0] in ("kv", "rotating", "recurrent", "quantized", "chunked", "generic"), s
        assert leaf.offset == 0 and leaf.snapshot(0) is None and leaf.restore(None, 0)
        if isinstance(leaf, GenericCache):
            assert leaf.obj is obj  # the model keeps seeing its own object
            unknown = class_name(obj) not in VETTED
            assert any(class_name(obj) in str(x.message) for x in w) or not unknown
    # Classes with a kind of their own are never treated generically.
    if cls.__module__ == "mlx_lm.models.cache" and cls is not mlc.ConcatenateKVCache:
        assert not any(isinstance(x, GenericCache) for x in leaves), (cls, leaves)
