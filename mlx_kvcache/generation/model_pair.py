"""A target model and its optional draft, as every generation path sees them.

One cache list holds the target's caches, then the draft's (mlx-lm's layout for
speculative decoding, and what one trie node stores: a hit skips prefill on both models,
the budget counts both, the disk cache is keyed on both). This module is the one place
that makes and splits such lists, says how many token ids a model takes, and runs one
forward pass over both models — the draft fed clamped ids, both lists settled.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..caches import make_prompt_cache, settle
from .per_model import PerModel

__all__ = ["DEQUANTIZED_FROM", "ModelPair", "attention_views", "clamp_ids", "vocab_size"]

_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings",
                    "embedding")


#: `vocab_size` of each live model: finding the embedding walks every module (about 14 ms
#: on a 32-layer model) and the server asks per request; a model's vocabulary never changes.
_vocabs: "PerModel[Optional[int]]" = PerModel(lambda model: _vocab_size(model))


def vocab_size(model: Any) -> Optional[int]:
    """The token ids ``model`` takes: its config's ``vocab_size`` (or its text config's),
    bounded by the rows of its token embedding when it has one; None if neither is known.

    The one vocabulary rule of the package: prompts are checked against it, a draft with
    fewer ids is fed clamped ones, and a ``logit_bias`` past it is refused."""
    if not isinstance(model, nn.Module):
        return _vocab_size(model)
    return _vocabs(model)


def _vocab_size(model: Any) -> Optional[int]:
    rows = None
    if isinstance(model, nn.Module):
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            if name.rsplit(".", 1)[-1] in _EMBEDDING_NAMES and isinstance(w, mx.array) \
                    and w.ndim == 2:
                rows = int(w.shape[0])
                break
    args = getattr(model, "args", None)
    declared = None
    for holder in (args, getattr(args, "text_config", None)):
        v = holder.get("vocab_size") if isinstance(holder, dict) else getattr(holder, "vocab_size", None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            declared = v
            break
    if declared is not None:
        return declared if rows is None else min(declared, rows)
    return rows


def clamp_ids(ids: mx.array, vocab: Optional[int]) -> mx.array:
    """``ids`` with those a model has no embedding for (``>= vocab``) replaced by its last
    id. Only ever applied to the draft: the target may emit ids a smaller draft vocabulary
    lacks, and MLX does not bound-check an embedding lookup. The draft only proposes, so
    this can lower acceptance, never change the output."""
    return ids if vocab is None else mx.minimum(ids, vocab - 1)


#: Passes of at least this many tokens attend over quantized KV rows dequantized, on the
#: CPU: there mlx-lm's quantized attention is the slower one from two query tokens on (a
#: 2k-token prefill 3.6×, 45 tokens over 10k rows 4.2×), the faster one for one token. On
#: a GPU mlx-lm's fused quantized kernels are kept (not measured here).
DEQUANTIZED_FROM = 2


def attention_views(caches: Sequence[Any], n: int) -> List[Any]:
    """``caches`` as a model should see them for a pass of ``n`` tokens: on the CPU, from
    `DEQUANTIZED_FROM` tokens on, each quantized KV cache of ours as a plain one
    (`caches.quantized.DequantizedView`: the rows it stores are unchanged); the others,
    and mlx-lm's own, as they are."""
    if n < DEQUANTIZED_FROM or mx.default_device() != mx.cpu:
        return list(caches)
    return [c.dequantized_view() if hasattr(c, "dequantized_view") else c for c in caches]


class ModelPair:
    """``model`` and an optional ``draft`` (same tokenizer) sharing one cache list.

    ``target_entries`` and ``vocabs`` (the target's vocabulary, the draft's): facts the
    caller already established with this module's rules for these models (a `PrefixCache`
    does once), used instead of establishing them again."""

    def __init__(self, model: nn.Module, draft: Optional[nn.Module] = None, *,
                 target_entries: Optional[int] = None,
                 vocabs: Optional[Tuple[Optional[int], Optional[int]]] = None) -> None:
        if draft is not None and draft is model:
            raise ValueError("draft_model is the target model itself: pass a separate (smaller) "
                             "model, or no draft model")
        self.model, self.draft = model, draft
        #: Top-level cache entries of the target: a cache list holds them, then the draft's.
        self.target_entries = (len(make_prompt_cache(model)) if target_entries is None
                               else int(target_entries))
        tv, dv = vocabs if vocabs is not None else (
            vocab_size(model), None if draft is None else vocab_size(draft))
        #: The target's vocabulary (a wider draft never proposes past it).
        self.vocab = tv
        #: The draft's vocabulary when smaller than the target's (ids it lacks are fed to it
        #: clamped), else None.
        self.draft_vocab: Optional[int] = None
        if draft is not None and dv is not None and (tv is None or dv < tv):
            self.draft_vocab = dv

    @property
    def models(self) -> Tuple[nn.Module, ...]:
        """The target, then the draft if any."""
        return (self.model,) if self.draft is None else (self.model, self.draft)

    def make_caches(self) -> List[Any]:
        """A fresh cache list: the target's caches (`make_prompt_cache`), then the draft's."""
        caches = make_prompt_cache(self.model)
        return caches if self.draft is None else caches + make_prompt_cache(self.draft)

    def split(self, caches: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
        """``(target caches, draft caches)`` of a cache list (the draft's empty without one)."""
        caches = list(caches)
        return caches[: self.target_entries], caches[self.target_entries:]

    def forward(self, x: mx.array, caches: Sequence[Any]) -> mx.array:
        """One pass of ``x`` (``[1, n]`` token ids) through the target and the draft over
        ``caches`` (a whole cache list); both lists settled. Returns the target's logits
        (a graph: nothing is evaluated here)."""
        target, drafted = self.split(caches)
        n = int(x.shape[-1])
        logits = self.model(x, cache=attention_views(target, n))
        settle(target, n)
        if self.draft is not None:
            self.draft(clamp_ids(x, self.draft_vocab), cache=attention_views(drafted, n))
            settle(drafted, n)
        return logits
