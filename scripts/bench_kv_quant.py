#!/usr/bin/env python
"""Quantized KV (``--kv-bits``) prompt passes, in process on SmolLM2: mlx-lm's
``stream_generate`` against `PrefixCache`, with and without the dequantized attention of
passes of many tokens (`mlx_kvcache.generation.model_pair.attention_views`).

mlx-lm's ``stream_generate(kv_bits=8, quantized_kv_start=0)`` computes its first prefill
chunk on plain caches and converts them after it (so its answers depend on the chunking);
every later pass attends through mlx-lm's quantized attention. Ours quantizes from the
first row on (the canonical schedule) and, from two tokens a pass on, attends over the
quantized rows dequantized (`caches.quantized.DequantizedView`); "ours, quantized
attention" is the same code with that turned off (what it did before). Timed, alternating
and repeated: a cold prompt of ``--prompt`` tokens to its first token, then the next
turn's hit (the prompt, ``--new`` tokens more) to its first token — mlx-lm's from a deep
copy of the first turn's caches, as stock's server reuses its LRU entry.

    python scripts/bench_kv_quant.py [--prompt 1500 --new 45 --repeats 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import mlx_kvcache  # noqa: F401  (the fast BLAS, before mlx)

import mlx.core as mx
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvcache import PrefixCache
from mlx_kvcache.generation import model_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import load_smollm2  # noqa: E402

BITS, GROUP, START = 8, 64, 0


def first_token(gen):
    """Seconds to ``gen``'s first response, and its log-probs (the rest is not run)."""
    t = time.perf_counter()
    r = next(iter(gen))
    mx.eval(r.logprobs)
    return time.perf_counter() - t, r.logprobs


def stock(model, tok, first, nxt):
    cache = make_prompt_cache(model)
    kw = dict(max_tokens=1, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=START)
    cold, lp1 = first_token(stream_generate(model, tok, first, prompt_cache=cache, **kw))
    # stock's server: the next turn reuses a deep copy of what the first one left
    hit_cache = copy.deepcopy(cache)
    done = hit_cache[0].offset
    hit, lp2 = first_token(stream_generate(model, tok, nxt[done:], prompt_cache=hit_cache, **kw))
    return cold, hit, lp1, lp2


def ours(model, tok, first, nxt, dequantized: bool):
    saved = model_pair.DEQUANTIZED_FROM
    model_pair.DEQUANTIZED_FROM = saved if dequantized else 1 << 30
    try:
        pc = PrefixCache(model, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=START,
                         max_bytes=4 << 30)
        cold, lp1 = first_token(pc.stream_generate(tok, first, max_tokens=1))
        hit, lp2 = first_token(pc.stream_generate(tok, nxt, max_tokens=1))
        assert pc.last_request.restored_tokens >= len(first) - 1
        pc.close()
        return cold, hit, lp1, lp2
    finally:
        model_pair.DEQUANTIZED_FROM = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1500, help="the cold prompt's tokens")
    ap.add_argument("--new", type=int, default=45, help="tokens the next turn adds")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    model, tok = load_smollm2("bench_kv_quant_")
    rng = np.random.default_rng(0)
    first = rng.integers(100, 40000, args.prompt).tolist()
    nxt = first + rng.integers(100, 40000, args.new).tolist()
    print(f"command: python scripts/bench_kv_quant.py {' '.join(argv or sys.argv[1:])}")
    print(f"SmolLM2, --kv-bits {BITS} --kv-group-size {GROUP} --quantized-kv-start {START}; "
          f"a cold prompt of {args.prompt} tokens, then a hit with {args.new} new; seconds "
          f"to the first token, median of {args.repeats}")
    runs = {"mlx-lm stream_generate": lambda: stock(model, tok, first, nxt),
            "ours": lambda: ours(model, tok, first, nxt, True),
            "ours, quantized attention": lambda: ours(model, tok, first, nxt, False)}
    times = {k: ([], []) for k in runs}
    lps = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            cold, hit, lp1, lp2 = fn()
            times[name][0].append(cold)
            times[name][1].append(hit)
            lps[name] = (lp1, lp2)
    base = {k: statistics.median(v) for k, v in zip(("cold", "hit"), times["mlx-lm stream_generate"])}
    print(f"  {'':<28}{'cold':>9}{'÷ mlx-lm':>10}{'hit':>9}{'÷ mlx-lm':>10}")
    for name, (c, h) in times.items():
        c, h = statistics.median(c), statistics.median(h)
        print(f"  {name:<28}{c:>9.2f}{c / base['cold']:>10.3f}{h:>9.2f}{h / base['hit']:>10.3f}")
    # How far apart the first tokens' log-probs are: 8-bit rows turn float noise into whole
    # quantization steps, which compound over the layers (mlx-lm's own first chunk is not
    # even quantized), so these are the scale of the schedule's own noise, not errors.
    names = list(lps)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diff = max(mx.abs(x - y).max().item() for x, y in zip(lps[a], lps[b]))
            print(f"  max |Δ log-prob|, {a} vs {b}: {diff:.2e}")


if __name__ == "__main__":
    main()
