#!/usr/bin/env python
"""Snapshot / restore demo on two tiny random-weight mlx-lm models.

For a full-attention model (llama) and a hybrid recurrent one (qwen3_next: gated
delta-net layers plus an attention layer) this

1. runs a prefix with ``mlx_kvcache.make_prompt_cache(model)``,
2. snapshots every layer cache at the end of the prefix,
3. runs a divergent continuation (which overwrites the live state),
4. restores every layer to the end of the prefix,
5. runs the real suffix,

and checks the suffix logits against a straight run (prefix, then suffix, no
detour) with mlx-lm's own caches. Exits with status 1 when any max-abs difference
exceeds the tolerance.

    python scripts/demo.py
"""

from __future__ import annotations

import argparse
import sys
import time

# Must come before mlx / mlx_lm: it preloads a fast BLAS for the CPU build.
import mlx_kvcache  # isort: skip

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_kvcache.testing import build  # noqa: E402

VOCAB = 128


def forward(model, tokens: mx.array, cache) -> mx.array:
    """One forward pass over ``tokens`` ([L] int32); returns logits [L, V] (evaluated)."""
    logits = model(tokens[None], cache=cache)[0]
    # Models that write recurrent state without calling advance() need this.
    mlx_kvcache.settle(cache, tokens.shape[0])
    mx.eval(logits, [c.state for c in cache])
    return logits


def run_model(name: str, prefix_len: int, detour_len: int, suffix_len: int, tol: float) -> bool:
    t0 = time.perf_counter()
    model = build(name)
    mx.random.seed(7)
    prefix = mx.random.randint(0, VOCAB, (prefix_len,)).astype(mx.int32)
    detour = mx.random.randint(0, VOCAB, (detour_len,)).astype(mx.int32)
    suffix = mx.random.randint(0, VOCAB, (suffix_len,)).astype(mx.int32)

    # Reference: mlx-lm's own caches, prefix then suffix, no detour.
    ref_cache = mlx_cache.make_prompt_cache(model)
    forward(model, prefix, ref_cache)
    ref = forward(model, suffix, ref_cache)

    # Ours: prefix, snapshot, detour, restore, suffix.
    cache = mlx_kvcache.make_prompt_cache(model)
    forward(model, prefix, cache)
    leaves = mlx_kvcache.leaf_caches(cache)
    snaps = [c.snapshot(0) for c in leaves]
    snap_bytes = sum(s.nbytes for s in snaps if s is not None)

    detour_logits = forward(model, detour, cache)
    n = prefix_len
    for c, s in zip(leaves, snaps):
        # Rewind in place where the cache can (KV), else bring the snapshot back.
        if not (c.restore(None, n) or c.restore(s, n)):
            raise RuntimeError(f"{name}: could not restore {c!r} to {n} tokens")
    out = forward(model, suffix, cache)

    diff = mx.max(mx.abs(out - ref)).item()
    # How far apart the detour took the state: restoring must undo all of it.
    moved = mx.max(mx.abs(detour_logits[:1] - ref[:1])).item()
    kinds = sorted({type(c).__name__ for c in leaves})
    ok = diff <= tol
    print(
        f"{name:<11} layers={len(leaves)} ({', '.join(kinds)})\n"
        f"  prefix={prefix_len} detour={detour_len} suffix={suffix_len}  "
        f"snapshot bytes={snap_bytes:,}\n"
        f"  suffix logits vs mlx-lm one-pass run: max |diff| = {diff:.3e}  "
        f"(detour logits differed by {moved:.3f})  "
        f"{'OK' if ok else 'FAIL'}  [{time.perf_counter() - t0:.2f} s]"
    )
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=48, help="prefix tokens (default 48)")
    p.add_argument("--detour", type=int, default=24, help="divergent continuation tokens (default 24)")
    p.add_argument("--suffix", type=int, default=16, help="real suffix tokens (default 16)")
    p.add_argument("--tol", type=float, default=1e-4, help="max allowed abs logit diff (default 1e-4)")
    args = p.parse_args(argv)
    print("$ " + " ".join([sys.executable, *sys.argv]))
    ok = True
    for name in ("llama", "qwen3_next"):
        ok &= run_model(name, args.prefix, args.detour, args.suffix, args.tol)
    print("all match" if ok else f"MISMATCH: a diff exceeded {args.tol:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
