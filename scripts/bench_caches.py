#!/usr/bin/env python
"""Benchmark mlx_kvcache's caches against mlx-lm's (a benchmark, not a test).

a. Decode: per-token cost of our ``KVCache`` vs mlx-lm's ``KVCache`` on the same
   random-weight llama model. Both caches are prefilled with the same prompt; then,
   in interleaved rounds (A B, B A, ...), each decodes ``--round`` greedy tokens and
   is trimmed back to the prompt, so every round runs at the same context length.
   Reports tokens/s and the median per-round ratio ours/theirs.

b. Snapshot + restore bandwidth of one ``KVCache`` layer ([1, 8, T, 128] float16 keys
   and values, the per-layer shape of an 8B model) vs plain ``mx.contiguous`` copies
   of the same bytes. ``snapshot(0)`` is one copy out; ``restore(snap, T)`` into a
   fresh cache is one copy in; the baseline is two contiguous copies (out and back).
   Both single-direction numbers are reported too. The source cache holds T tokens
   in a buffer with spare rows (as after decoding and rewinding), so the snapshot
   and the baseline really copy. Note: when T is a multiple of the cache step (256),
   a restore into a fresh cache overwrites its whole buffer, and MLX then shares the
   snapshot's (immutable) buffer instead of copying: that restore moves no bytes.
   An unaligned T is measured as well so the summary reflects a real copy in.

    python scripts/bench_caches.py            # ~2-3 min
    python scripts/bench_caches.py --quick    # ~30 s
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

# Must come before mlx / mlx_lm: it preloads a fast BLAS for the CPU build.
import mlx_kvcache  # isort: skip

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_lm.models import llama  # noqa: E402


def median(xs):
    return statistics.median(xs)


# -- a. decode ------------------------------------------------------------------------
def build_llama(args):
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, rms_norm_eps=1e-5, vocab_size=args.vocab,
        tie_word_embeddings=False))
    mx.eval(model.parameters())  # float32
    n_params = sum(v.size for _, v in _leaves(model.parameters()))
    return model, n_params


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def decode_eval(model, cache, tok, n):
    """Greedy decode ``n`` tokens, ``mx.eval`` each step; returns the tokens."""
    out = []
    for _ in range(n):
        logits = model(tok[None], cache=cache)[:, -1, :]
        tok = mx.argmax(logits, axis=-1)
        mx.eval(tok)
        out.append(tok.item())
    return out


def decode_generate_step(model, cache, tok, n):
    """Greedy decode ``n`` tokens with mlx-lm's own ``generate_step`` loop."""
    from mlx_lm.generate import generate_step

    out = []
    for _, (t, _) in zip(range(n), generate_step(tok, model, prompt_cache=cache, max_tokens=n)):
        out.append(int(t))
    return out


def bench_decode(args):
    model, n_params = build_llama(args)
    decode = decode_eval if args.loop == "eval" else decode_generate_step
    mx.random.seed(1)
    prompt = mx.random.randint(0, args.vocab, (args.prompt,)).astype(mx.int32)

    caches = {
        "ours": mlx_kvcache.make_prompt_cache(model),
        "mlx-lm": mlx_cache.make_prompt_cache(model),
    }
    assert all(type(c) is mlx_kvcache.KVCache for c in caches["ours"])
    assert all(type(c) is mlx_cache.KVCache for c in caches["mlx-lm"])
    # Warm-up pass on a throwaway cache, so the first timed prefill is not penalised.
    mx.eval(model(prompt[None, :64], cache=mlx_cache.make_prompt_cache(model)))
    first = {}
    for name, cache in caches.items():
        t0 = time.perf_counter()
        logits = model(prompt[None], cache=cache)[:, -1, :]
        tok = mx.argmax(logits, axis=-1)
        mx.eval(tok, [c.state for c in cache])
        first[name] = tok
        print(f"  prefill {args.prompt} tokens ({name}): {time.perf_counter() - t0:.2f} s")

    def one_round(name):
        cache = caches[name]
        t0 = time.perf_counter()
        toks = decode(model, cache, first[name], args.round)
        dt = time.perf_counter() - t0
        for c in cache:  # back to the prompt: every round sees the same context
            c.trim(c.offset - args.prompt)
        return dt, toks

    one_round("ours"), one_round("mlx-lm")  # warm-up
    per_tok = {"ours": [], "mlx-lm": []}
    ratios = []
    mismatch = 0
    for r in range(args.rounds):
        order = ("ours", "mlx-lm") if r % 2 == 0 else ("mlx-lm", "ours")
        res = {name: one_round(name) for name in order}
        for name in order:
            per_tok[name].append(res[name][0] / args.round)
        mismatch += res["ours"][1] != res["mlx-lm"][1]
        # tokens/s ratio ours/theirs for this round = time theirs / time ours
        ratios.append(res["mlx-lm"][0] / res["ours"][0])

    tps = {name: 1.0 / median(v) for name, v in per_tok.items()}
    ratio = median(ratios)
    print(f"\n  model: llama hidden={args.hidden} layers={args.layers} heads={args.heads} "
          f"kv_heads={args.kv_heads} inter={args.intermediate} vocab={args.vocab} float32 "
          f"({n_params / 1e6:.1f} M params)")
    print(f"  context {args.prompt} + {args.round} decode tokens per round, {args.rounds} rounds "
          f"per cache, loop={args.loop}")
    print(f"  {'cache':<8} {'ms/token (median)':>18} {'tokens/s':>10} {'min ms':>8} {'max ms':>8}")
    for name, v in per_tok.items():
        print(f"  {name:<8} {1e3 * median(v):>18.2f} {tps[name]:>10.1f} "
              f"{1e3 * min(v):>8.2f} {1e3 * max(v):>8.2f}")
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratio, ratio, ratio]
    print(f"  ours/mlx-lm tokens/s: median of per-round ratios {ratio:.3f}x "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}); ratio of medians {tps['ours'] / tps['mlx-lm']:.3f}x")
    if mismatch:
        print(f"  WARNING: greedy tokens differed between the caches in {mismatch} rounds")
    else:
        print("  greedy tokens identical for both caches in every round")
    return ratio


# -- b. snapshot / restore bandwidth ----------------------------------------------------
def filled_cache(T, heads, head_dim, dtype):
    """A KVCache holding T tokens in a buffer with spare rows (as after a decode and
    a rewind), so that a view of its T rows is not the whole buffer."""
    mx.random.seed(2)
    k = mx.random.normal((1, heads, T, head_dim)).astype(dtype)
    v = mx.random.normal((1, heads, T, head_dim)).astype(dtype)
    c = mlx_kvcache.KVCache()
    c.update(k, v)
    if c.keys.shape[2] == T:  # grow by one step, then rewind
        c.update(k[:, :, :1], v[:, :, :1])
        c.trim(1)
    mx.eval(c.keys, c.values)
    return c


def bench_snapshot(args, T):
    dtype = mx.float16
    c = filled_cache(T, args.kv_heads_snap, args.head_dim, dtype)
    other = filled_cache(T, args.kv_heads_snap, args.head_dim, dtype)  # source of the copy back
    nbytes = 2 * c.keys[..., :T, :].nbytes  # keys + values, T rows

    def ours():
        t0 = time.perf_counter()
        snap = c.snapshot(0)  # evaluates its copies
        t1 = time.perf_counter()
        c2 = mlx_kvcache.KVCache()
        assert c2.restore(snap, T)
        mx.eval(c2.keys, c2.values)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def base():
        t0 = time.perf_counter()
        a = mx.contiguous(c.keys[..., :T, :])
        b = mx.contiguous(c.values[..., :T, :])
        mx.eval(a, b)
        t1 = time.perf_counter()
        a2 = mx.contiguous(other.keys[..., :T, :])
        b2 = mx.contiguous(other.values[..., :T, :])
        mx.eval(a2, b2)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for _ in range(3):
        ours(), base()
    snap_t, rest_t, out_t, back_t, ratios = [], [], [], [], []
    for r in range(args.snap_reps):
        if r % 2 == 0:
            o, b = ours(), base()
        else:
            b, o = base(), ours()
        snap_t.append(o[0]), rest_t.append(o[1]), out_t.append(b[0]), back_t.append(b[1])
        ratios.append((b[0] + b[1]) / (o[0] + o[1]))

    # Does restore share the snapshot's buffer (zero-copy) at this T?
    snap = c.snapshot(0)
    c2 = mlx_kvcache.KVCache()
    c2.restore(snap, T)
    mx.eval(c2.keys)
    shared = c2.keys.shape[2] == T  # full overwrite of a fresh buffer: MLX shares it
    del snap, c2

    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    ratio = median(ratios)
    return {
        "T": T, "nbytes": nbytes, "shared": shared,
        "snap": median(snap_t), "restore": median(rest_t),
        "out": median(out_t), "back": median(back_t),
        "round_ours": median([a + b for a, b in zip(snap_t, rest_t)]),
        "round_base": median([a + b for a, b in zip(out_t, back_t)]),
        "ratio": ratio, "gbs": gbs,
        "snap_ratio": median([b / a for a, b in zip(snap_t, out_t)]),
    }


def print_snapshot(res):
    g = res["gbs"]
    T = res["T"]
    print(f"\n  T={T}: [1, 8, {T}, 128] float16 keys + values = {res['nbytes'] / 2**20:.2f} MiB"
          + ("   (restore shares the snapshot's buffer: no copy in)" if res["shared"] else ""))
    print(f"  {'operation':<38} {'ms (median)':>11} {'GB/s':>8}")
    rows = [
        ("snapshot(0)            [copy out]", res["snap"]),
        ("restore(snap, T) + eval [copy in]", res["restore"]),
        ("snapshot + restore     [round trip]", res["round_ours"]),
        ("mx.contiguous copy out", res["out"]),
        ("mx.contiguous copy back", res["back"]),
        ("two contiguous copies  [round trip]", res["round_base"]),
    ]
    for label, t in rows:
        print(f"  {label:<38} {1e3 * t:>11.3f} {g(t):>8.2f}")
    print(f"  snapshot / copy out: {res['snap_ratio']:.3f}x   "
          f"snapshot+restore / two copies: {res['ratio']:.3f}x (median of per-rep ratios)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (~30 s)")
    g = p.add_argument_group("decode benchmark")
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--intermediate", type=int, default=1408)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    g.add_argument("--round", type=int, default=None, help="decode tokens per round (default 16, quick 8)")
    g.add_argument("--rounds", type=int, default=None, help="rounds per cache (default 60, quick 12)")
    g.add_argument("--loop", choices=("eval", "generate_step"), default="eval",
                   help="eval: argmax + mx.eval per token; generate_step: mlx-lm's loop")
    g = p.add_argument_group("snapshot benchmark")
    g.add_argument("--tokens", type=int, nargs="+", default=[4096, 4000],
                   help="cache lengths to snapshot (default 4096 4000)")
    g.add_argument("--kv-heads-snap", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--snap-reps", type=int, default=None, help="repeats (default 60, quick 15)")
    g.add_argument("--skip-decode", action="store_true")
    g.add_argument("--skip-snapshot", action="store_true")
    args = p.parse_args(argv)
    if args.round is None:
        args.round = 8 if args.quick else 16
    if args.rounds is None:
        args.rounds = 12 if args.quick else 60
    if args.snap_reps is None:
        args.snap_reps = 15 if args.quick else 60

    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    from mlx_kvcache import _blas
    print(f"mlx {mx.__version__}, device {mx.default_device()}, BLAS preloaded: {_blas.loaded}")
    t_start = time.perf_counter()

    decode_ratio = None
    if not args.skip_decode:
        print("\n== a. decode: our KVCache vs mlx-lm KVCache ==")
        decode_ratio = bench_decode(args)

    snap_results = []
    if not args.skip_snapshot:
        print("\n== b. snapshot + restore vs mx.contiguous copies (one KVCache layer) ==")
        for T in args.tokens:
            res = bench_snapshot(args, T)
            print_snapshot(res)
            snap_results.append(res)

    print(f"\n== summary ({time.perf_counter() - t_start:.0f} s) ==")
    parts = []
    if decode_ratio is not None:
        parts.append(f"decode ours/mlx-lm: {decode_ratio:.2f}x")
    if snap_results:
        # The headline is the worst case among those that really copy in (not shared).
        real = [r for r in snap_results if not r["shared"]] or snap_results
        worst = min(real, key=lambda r: r["ratio"])
        parts.append(f"snapshot+restore / contiguous copy: {worst['ratio']:.2f}x")
        detail = ", ".join(
            f"T={r['T']}: {r['ratio']:.2f}x" + (" (restore zero-copy)" if r["shared"] else "")
            for r in snap_results)
    print("  ".join(parts))
    if snap_results:
        print(f"  (snapshot+restore per T: {detail}; headline = T={worst['T']}, where restore "
              f"really copies)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
