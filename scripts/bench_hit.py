#!/usr/bin/env python
"""One prompt-cache hit, in process, through mlx-lm's own ``BatchGenerator``: the cache
restored by stock's ``LRUPromptCache`` against the one restored by our ``TriePromptCache``.

What it isolates: whether the caches ours hands mlx-lm (the trie path's snapshots
concatenated into one buffer) make mlx-lm's prefill and first decode step slower or faster
than stock's deep copy of its LRU entry, with no HTTP, threads or other sessions around.
A first turn (``--prefix`` tokens, then ``--answer`` generated ones) is computed once per
contender and inserted as the server inserts it; then ``--repeats`` times, alternating,
the next turn (the same prefix, the answer, ``--new`` more tokens) is fetched and run to
its first token. Seconds per phase: the fetch (the restore), mlx-lm's prompt passes (timed
by the server's own probe, `mlx_kvcache.serving.cache.profile.probe_mlx_lm`) and the rest of the
way to the first token (the batch's merge, the split into the decode batch, the first step).

    python scripts/bench_hit.py [--prefix 2500 --new 45 --answer 16 --repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import mlx_kvcache  # noqa: F401  (the fast BLAS, before mlx)

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.serving.cache.profile import Profile, probe_mlx_lm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import load_smollm2  # noqa: E402

KEY = ("model", None, None)


def first_token(model, tokens, cache, rest, max_tokens=1):
    """Run ``rest`` over ``cache`` to the end of ``max_tokens``: (seconds, the finished
    request's cache, every token it holds)."""
    bg = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8,
                        prefill_step_size=2048, stream=mx.new_stream(mx.default_device()))
    done = len(tokens) - len(rest)
    bg.insert_segments(segments=[[list(rest)]], max_tokens=[max_tokens], caches=[cache],
                       all_tokens=[list(tokens[:done])])
    t0 = time.perf_counter()
    try:
        while True:
            _, gen = bg.next()
            for r in gen:
                if r.finish_reason is not None:
                    return time.perf_counter() - t0, r.prompt_cache, list(r.all_tokens)
    finally:
        bg.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2500, help="the first turn's prompt tokens")
    ap.add_argument("--answer", type=int, default=16, help="tokens the first turn generates")
    ap.add_argument("--new", type=int, default=45, help="tokens the next turn adds")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    model, _ = load_smollm2("bench_hit_")
    prof = Profile(timing=True)
    probe_mlx_lm(prof)
    rng = np.random.default_rng(0)
    first = rng.integers(100, 40000, args.prefix).tolist()
    more = rng.integers(100, 40000, args.new).tolist()
    provider = types.SimpleNamespace(model=model, tokenizer=None, draft_model=None, model_key=KEY)
    caches = {"stock": LRUPromptCache(100, 1 << 40),
              "ours": TriePromptCache(provider, max_bytes=8 << 30)}
    nxt = {}
    for name, pc in caches.items():
        _, cache, held = first_token(model, first, None, first, max_tokens=args.answer)
        pc.insert_cache(KEY, held, cache, cache_type="assistant")
        nxt[name] = held + more
    print(f"command: python scripts/bench_hit.py {' '.join(argv or sys.argv[1:])}")
    print(f"a hit of {len(nxt['ours']) - args.new} tokens, {args.new} new; SmolLM2; "
          f"seconds per phase, median of {args.repeats}")
    rows = {k: defaultdict(list) for k in caches}
    for _ in range(args.repeats):
        for name, pc in caches.items():
            gc.collect()
            mx.clear_cache()
            prof.seconds.clear()
            t = time.perf_counter()
            cache, rest = pc.fetch_nearest_cache(KEY, nxt[name])
            rows[name]["fetch (restore)"].append(time.perf_counter() - t)
            ttft, _, _ = first_token(model, nxt[name], cache, rest)
            passes = prof.seconds["pass.prefill"]
            rows[name]["prompt passes"].append(passes)
            rows[name]["the rest of the first token"].append(ttft - passes)
            rows[name]["first token"].append(ttft)
            assert len(rest) == args.new + 1 or len(rest) == args.new, (name, len(rest))
    caches["ours"].close()
    print(f"  {'phase':<30}{'stock':>9}{'ours':>9}{'ours/stock':>12}")
    for phase in rows["ours"]:
        a, b = statistics.median(rows["stock"][phase]), statistics.median(rows["ours"][phase])
        print(f"  {phase:<30}{a:>9.4f}{b:>9.4f}{b / a if a else float('nan'):>12.3f}")
    print("  first token, each repeat: stock "
          + " ".join(f"{x:.3f}" for x in rows["stock"]["first token"]) + "; ours "
          + " ".join(f"{x:.3f}" for x in rows["ours"]["first token"]))


if __name__ == "__main__":
    main()
