"""Model identity: a fingerprint that keys a persisted prefix cache to one model.

`model_fingerprint` names a loaded model: two models share it only if they have the same
class, config, parameter names, shapes, dtypes and (up to a 64-bit-per-tensor checksum of
every element plus a sample of raw values) the same weights; the tokenizer's vocabulary,
special tokens and chat template are included when it is given. Costs one pass over the
weights (~0.5 s for a 135M model on a 2-core CPU).

`directory_fingerprint` names a model directory (what the server loads) by the SHA-256
of every file, each read once and remembered (`digests`).

`directory_identity` is what the server keys a directory's cache by: its
`directory_fingerprint`, unless the directory was exported from a loaded model
(`record_identity`: the embedded model, a ``.gguf`` file) and still holds exactly the bytes
it was exported with — then that model's `model_fingerprint`, the identity the chat
command (`PrefixCache`) uses for the same model, so both share one cache. A byte changed
after the export (a fused LoRA re-saved in place) changes the directory fingerprint, and
the record no longer applies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields, is_dataclass
from typing import Any, Dict, Optional, Sequence

import mlx.core as mx
import numpy as np

from .format import RAW

__all__ = ["model_fingerprint", "directory_fingerprint", "directory_identity",
           "record_identity", "cache_key"]


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v, sort_keys=True)
        return v
    except (TypeError, ValueError):
        return None


def _config(model) -> Dict[str, Any]:
    args = getattr(model, "args", None)
    if args is None:
        args = getattr(model, "config", None)
    if args is None:
        return {}
    if is_dataclass(args):
        items = {f.name: getattr(args, f.name, None) for f in fields(args)}
    elif isinstance(args, dict):
        items = dict(args)
    else:
        items = dict(getattr(args, "__dict__", {}))
    out = {}
    for k in sorted(items):
        if str(k).startswith("_"):
            continue
        v = _jsonable(items[k])
        if v is not None or items[k] is None:
            out[str(k)] = v
    return out


_CHUNK = 1 << 22  # elements per chunk of the content checksum (bounds temporaries)


def _content_digest(a: mx.array) -> bytes:
    """Order-sensitive checksum of every element's bits, plus a strided sample.

    Integer arithmetic modulo 2**32 is exact and associative, so the result does not
    depend on the device or the reduction order. Each element's bit pattern is weighted
    by an odd position-dependent factor: changing any single element always changes the
    sum, and a realistic fine-tune (many elements) cannot cancel out except by chance.
    """
    flat = a.reshape(-1)
    dt = flat.dtype
    if dt == mx.bool_:
        bits = flat.astype(mx.uint32)
    elif dt in RAW:
        raw = RAW[dt]
        bits = mx.view(flat, raw)
        if raw == mx.uint64:
            bits = mx.view(bits, mx.uint32)
        elif raw != mx.uint32:
            bits = bits.astype(mx.uint32)
    else:  # complex64 and anything 32-bit multiple
        bits = mx.view(flat.astype(mx.float32) if dt.size < 4 else flat, mx.uint32)
    n = bits.size
    sums = []
    for s in range(0, n, _CHUNK):
        part = bits[s:s + _CHUNK]
        idx = mx.arange(s, s + part.size, dtype=mx.uint32)
        w = idx * mx.array(2654435761, dtype=mx.uint32) + mx.array(0x9E3779B9, dtype=mx.uint32)
        w = w | mx.array(1, dtype=mx.uint32)
        sums.append(mx.sum(part * w))
        sums.append(mx.sum(part ^ idx))
    step = max(1, n // 2048)
    sample = bits[::step][:2048]
    mx.eval(sums, sample)
    return np.asarray([int(x.item()) for x in sums], dtype=np.uint64).tobytes() + \
        np.asarray(sample).tobytes()


def _tokenizer_identity(tok) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    inner = getattr(tok, "_tokenizer", tok)

    def get(name):
        for o in (tok, inner):
            try:
                v = getattr(o, name)
            except Exception:
                continue
            if v is not None:
                return v
        return None

    try:
        vocab = inner.get_vocab()
        h = hashlib.sha256()
        for k, v in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
            h.update(f"{v}\t{k}\n".encode("utf-8", "surrogatepass"))
        out["vocab"] = h.hexdigest()
        out["vocab_size"] = len(vocab)
    except Exception:
        pass
    for name in ("vocab_size", "bos_token", "eos_token", "pad_token", "unk_token",
                 "all_special_tokens", "chat_template"):
        v = get(name)
        if v is not None:
            out.setdefault(name, _jsonable(v) if not isinstance(v, (set, tuple)) else sorted(v))
    try:
        out["eos_token_ids"] = sorted(int(t) for t in tok.eos_token_ids)
    except Exception:
        pass
    return out


def model_fingerprint(model, tokenizer=None) -> str:
    """A hex SHA-256 naming the model (config, parameters and their contents) and tokenizer.

    Two models share a fingerprint only if they have the same class, config, parameter
    names, shapes, dtypes and (up to a 64-bit-per-tensor checksum of every element plus
    a sample of raw values) the same weights; the tokenizer's vocabulary, special tokens
    and chat template are included when it is given. Costs one pass over the weights.
    """
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    h.update(f"mlx_kvcache-fingerprint-v1\n{type(model).__module__}.{type(model).__qualname__}\n".encode())
    h.update(json.dumps(_config(model), sort_keys=True, default=str).encode())
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for name, a in params:
        h.update(f"\n{name}:{tuple(a.shape)}:{a.dtype}\n".encode())
        h.update(_content_digest(a))
    if tokenizer is not None:
        h.update(b"\ntokenizer\n")
        h.update(json.dumps(_tokenizer_identity(tokenizer), sort_keys=True, default=str).encode())
    return h.hexdigest()


def directory_fingerprint(model_dir, adapter_dir=None, *, cache_root=None) -> str:
    """A hex SHA-256 naming a model directory by every byte of every file in it.

    Per file (sorted by relative path, so every machine and every rank of a sharded
    model with the same files agrees): its path, size and SHA-256. Hidden files and
    folders (``.cache/`` of a hub download) are left out. ``adapter_dir`` (LoRA
    adapters) is included the same way. Any change to any byte changes the result —
    a fused LoRA re-saved in place with the same size included.

    Reading every weight on every start would be slow, so with ``cache_root`` each
    file's digest is remembered in ``<cache_root>/v<N>/file-digests.sqlite`` under its
    ``stat`` signature (`digests.FileDigests`: what is and is not detected): the first
    start reads the weights once (~1.4 GB/s per core), later starts cost a ``stat`` per
    file. Files of a Hugging Face cache snapshot are named by their SHA-256 and are
    never read.
    """
    from pathlib import Path

    from .digests import FileDigests
    from .format import version_dir

    memo = None if cache_root is None else version_dir(Path(cache_root).expanduser()) / DIGESTS
    h = hashlib.sha256(b"mlx_kvcache-directory-fingerprint-v2\n")
    with FileDigests(memo) as digests:
        for label, root in (("model", model_dir), ("adapter", adapter_dir)):
            if root is None:
                continue
            base = Path(root)
            h.update(f"[{label}]\n".encode())
            files = sorted(q for q in base.rglob("*") if q.is_file()
                           and not any(part.startswith(".") for part in q.relative_to(base).parts))
            for p in files:
                rel = p.relative_to(base).as_posix()
                h.update(f"{rel}\t{p.stat().st_size}\t{digests.sha256(p)}\n".encode())
    return h.hexdigest()


#: The file, in a cache root's version directory, that remembers weight-file digests.
DIGESTS = "file-digests.sqlite"
#: The file, in an exported model directory, naming the model it was exported from (hidden:
#: not part of the directory's own fingerprint).
IDENTITY = ".mlx_kvcache-identity.json"


def record_identity(model_dir, model_fp: str) -> None:
    """Record in ``model_dir`` (just written from a loaded model whose `model_fingerprint`
    is ``model_fp``) that its current bytes are that model (see `directory_identity`)."""
    from pathlib import Path

    record = {"model": model_fp, "directory": directory_fingerprint(model_dir)}
    (Path(model_dir) / IDENTITY).write_text(json.dumps(record))


def directory_identity(model_dir, adapter_dir=None, *, cache_root=None) -> str:
    """The identity the cache of a model directory is keyed by: the `model_fingerprint`
    recorded at its export while its bytes are unchanged (no adapter applied, and the
    directory one of ours: under ``cache_root``'s `exports_dir`), else its
    `directory_fingerprint`."""
    from pathlib import Path

    from .format import exports_dir

    fp = directory_fingerprint(model_dir, adapter_dir, cache_root=cache_root)
    if adapter_dir is not None or cache_root is None:
        return fp
    # Only our own exports are trusted: a downloaded directory could carry any record.
    exports = exports_dir(cache_root).resolve()
    if exports not in Path(model_dir).expanduser().resolve().parents:
        return fp
    try:
        record = json.loads((Path(model_dir) / IDENTITY).read_text())
    except (OSError, ValueError):
        return fp
    if isinstance(record, dict) and record.get("directory") == fp \
            and isinstance(record.get("model"), str):
        return record["model"]
    return fp


def cache_key(model_fp: str, *, draft_fp: Optional[str] = None, sharding: Optional[str] = None,
              cold_bits: Optional[int] = None, kv_quant: Optional[Sequence[Any]] = None) -> str:
    """The name of a persisted cache: the model's fingerprint, combined with everything
    else that changes what its snapshots hold — a draft model's fingerprint (each node
    holds both models' layers), a rank's shard (``sharding``: its own directory),
    compressed snapshots (``cold_bits``: never served as exact ones) and the quantized-KV
    schedule (``kv_quant``: `KVQuantization.signature`, bits, group size and start).

    Each setting names its own directory, so switching a setting and back finds every
    setting's cache intact (one directory holds one signature: a store whose layers do not
    match replaces what it finds). Without a setting the name is what it always was."""
    fp = model_fp
    if draft_fp is not None:
        fp = hashlib.sha256(f"target {fp}\ndraft {draft_fp}\n".encode()).hexdigest()
    if sharding is not None:
        fp = hashlib.sha256(f"{fp}|{sharding}".encode()).hexdigest()
    if cold_bits is not None:
        fp = hashlib.sha256(f"{fp}|cold{cold_bits}".encode()).hexdigest()
    if kv_quant is not None:
        fp = hashlib.sha256(f"{fp}|kv{json.dumps(list(kv_quant))}".encode()).hexdigest()
    return fp
