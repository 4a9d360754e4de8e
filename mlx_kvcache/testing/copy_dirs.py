"""Model directories of the copying model (`copy_model`) for servers, tests and benchmarks.

`write_copy_dir` writes one: an inner architecture with random weights (the tiny ones of
`dirs.DIR_CONFIGS`, or any config), the character tokenizer (or the caller's), and the
steering tables — a bigram chain (`chain_table`: the answer copies a text) and/or a
script of the next token by position. Serve it with ``--trust-remote-code``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import copy_model
from .dirs import DIR_CONFIGS, DIR_VOCAB, SPECIALS, save_random_weights, write_tokenizer_dir

__all__ = ["write_copy_dir", "chain_table"]


def chain_table(chains: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """The bigram table of ``chains`` (token id sequences: each token's successor in its
    chain; -1 elsewhere). A token in two chains keeps the later one's successor."""
    succ = np.full(vocab, -1, dtype=np.int32)
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            succ[a] = b
    return succ


def write_copy_dir(path, kind: str = "llama", *, succ: Optional[np.ndarray] = None,
                   script: Optional[Mapping[int, int]] = None, seed: int = 0,
                   inner: Optional[Dict[str, Any]] = None, strength: float = 30.0,
                   tokenizer: Any = None, **overrides) -> Path:
    """A copying model's directory: ``kind``'s tiny config (or ``inner``, a whole config;
    ``overrides`` replace its entries) with random weights, the bigram table ``succ``
    and the ``script`` ({position: token id}); the character tokenizer unless
    ``tokenizer`` (a function writing one into the directory) is given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(inner if inner is not None else DIR_CONFIGS[kind], **overrides)
    text = config.get("text_config", config)
    vocab = int(text.get("vocab_size") or DIR_VOCAB)
    config.setdefault("vocab_size", vocab)
    mx.random.seed(seed)
    module = __import__(f"mlx_lm.models.{config['model_type']}", fromlist=["Model"])
    model = module.Model(module.ModelArgs.from_dict(config))
    save_random_weights(path, model)
    weights = {f"inner.{k}": v for k, v in mx.load(str(path / "model.safetensors")).items()}
    table = np.full(vocab, -1, np.int32) if succ is None else np.asarray(succ, np.int32)
    length = max([p + 1 for p in (script or {})] + [1])
    by_pos = np.full(length, -1, np.int32)
    for p, t in (script or {}).items():
        by_pos[p] = t
    weights["succ"], weights["script"] = mx.array(table), mx.array(by_pos)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in sorted(weights)}}))
    shutil.copyfile(copy_model.__file__, path / "copy_model.py")
    top = {"model_type": "copy_model", "model_file": "copy_model.py", "inner": config,
           "vocab_size": vocab, "strength": strength, "script_length": length,
           "eos_token_id": SPECIALS.index("</s>"), "bos_token_id": SPECIALS.index("<s>")}
    (path / "config.json").write_text(json.dumps(top, indent=2))
    (tokenizer or write_tokenizer_dir)(path)
    return path
