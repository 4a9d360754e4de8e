"""The server's ``--draft-model`` under ``--draft-policy``: a draft that could never pay
for itself is set aside when it loads.

Under ``adaptive`` a draft whose step costs as much as a target step (`draft_set_aside`)
would draft nothing, yet still prefill every prompt, take its share of every cached
prefix and hold its weights in memory. The server then drops it from mlx-lm's model
provider: requests are served by the target alone — still one at a time, as mlx-lm
serves a draft model — and the prompt cache holds the target's layers only (keyed as a
server without a draft). Answers do not change; the log says why, once per load.
"""

from __future__ import annotations

import gc
import logging
import weakref

import mlx.core as mx

from ...generation.draft_length import draft_set_aside

__all__ = ["install"]

log = logging.getLogger("mlx_kvcache")


def install(provider, policy: str) -> None:
    """Make ``provider`` (mlx-lm's ``ModelProvider``) set aside, right after every load,
    a draft model that could never pay under ``policy``. Its ``load`` is what every
    request goes through in the generation thread; only a load that brought a draft
    model has anything to decide."""
    load = provider.load
    # The draft last found worth keeping, not weighed again every request (weakly: a model
    # switch must free it).
    kept = [lambda: None]

    def load_then_check(model_path, adapter_path=None, draft_model_path=None):
        out = load(model_path, adapter_path, draft_model_path)
        draft = getattr(provider, "draft_model", None)
        if draft is not None and draft is not kept[0]():
            why = draft_set_aside(policy, provider.model, draft)
            if why is None:
                kept[0] = weakref.ref(draft)
            else:
                key = getattr(provider, "model_key", None)
                name = key[2] if isinstance(key, tuple) and len(key) > 2 else draft_model_path
                provider.draft_model = None
                del draft
                gc.collect()
                mx.clear_cache()  # its weights go back to the system, not MLX's pool
                log.warning("mlx_kvcache: the draft model %s is not used: %s; requests are "
                            "served by the model alone, one at a time (--draft-policy fixed "
                            "drafts with it anyway)", name, why)
        return out
    provider.load = load_then_check
