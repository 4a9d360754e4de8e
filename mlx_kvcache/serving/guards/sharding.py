"""Whether the served model can be split over the ranks of an ``mlx.launch`` job, asked
before anything is served.

mlx-lm finds out only in its generation thread, after the HTTP server is up: a model
without pipeline support under ``--pipeline`` (or without tensor-parallel support) ends
that thread, and a tensor-parallel split whose attention heads do not divide by the
number of ranks loads — each rank keeps ``heads // ranks`` heads — and fails at the first
request: an empty reply, then 404 "generation thread died", then a job that stops with
``exit 0``. Every rank reads the same ``config.json`` and runs the same check, so every
rank refuses alike, with one line, before serving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["sharding_problem", "head_counts"]


def head_counts(config: Dict[str, Any]) -> Iterator[Tuple[str, int]]:
    """Every attention-head count in a model's ``config.json`` (``num_attention_heads``,
    ``num_key_value_heads``, linear-attention heads, ...; a nested ``text_config`` too):
    tensor parallelism gives each rank an equal share of each."""
    for scope, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for k, v in sorted(cfg.items()):
            if (k.endswith("_heads") or k in ("n_head", "n_heads")) and isinstance(v, int) \
                    and not isinstance(v, bool) and v > 0:
                yield scope + k, v


def _local_dir(model: str) -> Optional[Path]:
    """The directory holding ``model``'s config: the model directory itself, or the
    Hugging Face snapshot of a repo id (its small files only, as mlx-lm's
    ``sharded_load`` fetches them first anyway); None when it cannot be had."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.py"]))
    except Exception:  # noqa: BLE001 - mlx-lm's own load reports it
        return None


def sharding_problem(model: Optional[str], ranks: int, pipeline: bool,
                     trust_remote_code: bool = False) -> Optional[str]:
    """Why ``model`` cannot be served split over ``ranks`` ranks (``pipeline``: by layers,
    else tensor parallel), or None when it can (or when the model cannot be read here:
    mlx-lm's load then says what is wrong)."""
    if model is None or ranks < 2:
        return None
    d = _local_dir(str(model))
    if d is None or not (d / "config.json").is_file():
        return None
    from mlx_lm.utils import load_model

    try:  # lazy: reads the config and the weights' headers, builds the module tree
        m, config = load_model(d, lazy=True, strict=False, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - mlx-lm's own load reports it
        return None
    kind = config.get("model_type", type(m).__name__)
    can_pipeline = hasattr(m, "model") and hasattr(m.model, "pipeline")
    if pipeline:
        if not can_pipeline:
            alt = " (tensor parallelism: drop --pipeline)" if hasattr(m, "shard") else ""
            return f"mlx-lm cannot split a {kind} model into pipeline stages{alt}"
        return None
    if not hasattr(m, "shard"):
        alt = " (try --pipeline)" if can_pipeline else ""
        return f"mlx-lm cannot split a {kind} model by tensor parallelism{alt}"
    bad = [(k, v) for k, v in head_counts(config) if v % ranks]
    if bad:
        what = ", ".join(f"{k} = {v}" for k, v in bad)
        fits = [n for n in range(2, 9) if all(v % n == 0 for _, v in head_counts(config))]
        hint = f"; {' or '.join(map(str, fits))} ranks would divide them" if fits else ""
        if can_pipeline:
            hint += "; or --pipeline"
        return (f"a {kind} model cannot be split over {ranks} ranks by tensor parallelism: "
                f"{what} not divisible by {ranks}{hint}")
    return None
