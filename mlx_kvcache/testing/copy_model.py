"""A model that copies: a real mlx-lm architecture whose next token is steered.

Random tiny models almost never continue text the way the context did, so prompt lookup
would never be accepted on them. This architecture (loaded from a model directory's
``model_file``: servers need ``--trust-remote-code``; `copy_dirs.write_copy_dir` writes
one) runs a real inner model — llama, gemma3 (a sliding window), qwen3_next (recurrent
layers), anything mlx-lm has — on its own caches, and adds ``strength`` to the logit of

* ``succ[t]`` after input token ``t`` (a bigram chain: the answer copies a text whose
  tokens the table chains, changes included), and
* ``script[p + 1]`` at absolute position ``p`` (an answer written out position by
  position: an edit that quotes a file, then quotes it again with changes),

where the table holds an id (``-1``: nothing). So the greedy answer is decided, while
every log-prob still depends on the inner model and its caches — a cache holding a
wrong token changes them. The forward pass costs what the inner model's costs: all of
it runs on the device, lazily (no host read), as a real model's does.
"""

# (no ``from __future__ import annotations``: mlx-lm execs this file outside sys.modules,
# where dataclasses cannot resolve string annotations)

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn


@dataclass
class ModelArgs:
    """The architecture's config (``config.json``): the inner model's config, the vocab
    size, the steering strength and the tables' lengths."""

    model_type: str = "copy_model"
    inner: Dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    strength: float = 30.0
    script_length: int = 1

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        return cls(**{k: v for k, v in params.items()
                      if k in ("model_type", "inner", "vocab_size", "strength", "script_length")})


def _offset(cache: Optional[List[Any]]) -> Any:
    """Tokens the caches hold before this pass (an int, or one per batch row), from the
    first layer that counts them (a recurrent one of mlx-lm's does not)."""
    for c in cache or ():
        layers = getattr(c, "caches", None)
        for layer in (layers if layers is not None else (c,)):
            off = getattr(layer, "offset", None)
            if off is not None:
                return off
    return 0


class Model(nn.Module):
    """The steered model (see the module doc)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        module = importlib.import_module(f"mlx_lm.models.{args.inner['model_type']}")
        self.inner = module.Model(module.ModelArgs.from_dict(args.inner))
        self.succ = mx.full((args.vocab_size,), -1, mx.int32)
        self.script = mx.full((max(int(args.script_length), 1),), -1, mx.int32)

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        if hasattr(self.inner, "make_cache"):
            return self.inner.make_cache()
        from mlx_lm.models.cache import KVCache
        return [KVCache() for _ in self.inner.layers]

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, **kwargs) -> mx.array:
        off = _offset(cache)
        logits = self.inner(inputs, cache=cache)
        b, n = inputs.shape
        vocab = logits.shape[-1]
        ids = mx.arange(vocab)
        want = mx.take(self.succ, inputs.astype(mx.int32))  # [b, n]
        pos = mx.arange(n)[None, :] + (off[:, None] if isinstance(off, mx.array) else off)
        at = mx.clip(pos + 1, 0, self.script.size - 1)
        inside = (pos + 1 >= 0) & (pos + 1 < self.script.size)  # (batch padding: < 0)
        scripted = mx.where(inside, mx.take(self.script, at), -1)
        want = mx.where(scripted >= 0, scripted, want)
        bias = mx.where(ids[None, None, :] == want[..., None], self.args.strength, 0.0)
        return logits + bias.astype(logits.dtype)

    def sanitize(self, weights):
        return weights
