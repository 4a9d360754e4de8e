"""Write a GGUF model (the embedded default included) as an mlx-lm model directory.

mlx-lm's server (and ``sharded_load``) load models from a directory: ``config.json``,
safetensors weights, tokenizer files. A GGUF file is converted once — weights through
``mx.save_safetensors``, the config from the built model's arguments, the tokenizer
through its ``save_pretrained`` — into a directory keyed by the file's identity, written
under a temporary name and renamed, so a half-written export is never used.

The directory records the `model_fingerprint` of the model it was written from
(`mlx_kvcache.store.record_identity`): the server keys its cache by that identity while the
directory's bytes are unchanged, so the chat command (which loads the GGUF file itself) and
the server share one cache for the same model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from .errors import ModelLoadError


def _key(gguf: Path, dequantize: bool) -> str:
    st = gguf.stat()
    raw = f"{gguf.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\t{dequantize}\texport-v2"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def export_gguf(gguf, root, *, dequantize: Optional[bool] = None) -> Path:
    """The mlx-lm model directory for ``gguf`` under ``root`` (written if missing)."""
    from ..store import model_fingerprint, record_identity
    from .gguf import load_gguf
    from .gguf_model import default_dequantize

    gguf = Path(gguf).expanduser()
    if dequantize is None:
        dequantize = default_dequantize()
    out = Path(root).expanduser() / f"{gguf.stem}-{_key(gguf, bool(dequantize))}"
    if (out / "config.json").exists():
        return out
    model, tokenizer = load_gguf(gguf, dequantize=dequantize)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        _write(model, tokenizer, tmp, gguf)
        record_identity(tmp, model_fingerprint(model, tokenizer))  # before it can be used
        try:
            os.replace(tmp, out)
        except OSError:  # another process exported it first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(model, tokenizer, d: Path, source: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if type(model.model.layers[0].self_attn.rope).__name__ == "GGUFFreqRoPE":
        raise ModelLoadError(f"{source}: its per-frequency RoPE factors (rope_freqs) cannot be "
                             f"written as an mlx-lm config; convert it with mlx_lm.convert")
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    quant = {}
    for path, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size"):
            quant[path] = {"group_size": m.group_size, "bits": m.bits}
    if quant:
        first = next(iter(quant.values()))
        config["quantization"] = {**first, **quant}
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(d))  # (mlx-lm's wrapper hands it to the HF tokenizer)
