"""How long a request that arrives while foresight computes waits for the generation thread.

Foresight (`serving/cache/foresight.py`) computes a session's next prompt while the server
is idle, and asks before each chunk whether a request is waiting. This times that wait on a
real model (the embedded SmolLM2-135M, or ``--model``): a foreseen prefix of ``--tokens``
tokens is computed by `Foresight.run` on the model, as the server's generation thread runs
it, and a "request" arrives after a random delay; the wait is from its arrival to the
moment the run hands the thread back (what the request waits before mlx-lm takes it).
Side by side, in one run: the chunks as they are now (about `foresight.YIELD_S` seconds of
prefill each, measured as it runs) and chunks of the server's whole prefill step (2,048
tokens: what foresight did before).

    python scripts/bench_foresight_yield.py [--tokens 6000] [--tries 12] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import mlx_kvcache  # noqa: F401  (the fast BLAS first)
from mlx_kvcache.caches import make_prompt_cache
from mlx_kvcache.generation.model_pair import ModelPair
from mlx_kvcache.models import load_model
from mlx_kvcache.prefix.manager import PrefixManager
from mlx_kvcache.serving.cache import foresight as fs_mod
from mlx_kvcache.serving.cache.foresight import Foresight


def one_wait(model, tokens, step: int, whole_steps: bool, delay: float, rate: float) -> float:
    """Seconds between the request's arrival (``delay`` after the run starts) and the run
    giving the thread back; ``rate``: seconds a token, as a running server has measured."""
    mgr = PrefixManager(lambda: make_prompt_cache(model), max_bytes=1 << 34)
    fs = Foresight()
    if whole_steps:
        fs.chunk = lambda s: s  # what foresight did before: the server's whole prefill step
    else:
        fs.measured(512, 512 * rate)
    fs.offer("s", tokens, expected=False)
    arrived = threading.Event()
    at = {}

    def arrive():
        time.sleep(delay)
        at["t"] = time.perf_counter()
        arrived.set()
    threading.Thread(target=arrive, daemon=True).start()
    fs.run(mgr, ModelPair(model), step, arrived.is_set)
    done = time.perf_counter()
    if not arrived.is_set():
        return 0.0  # the job ended before the request came: no wait
    return done - at["t"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or repo id (default: the "
                    "embedded SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=6000, help="tokens the foreseen prefix holds")
    ap.add_argument("--tries", type=int, default=12)
    ap.add_argument("--step", type=int, default=2048, help="the server's prefill step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model)
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    tokens = [rng.randrange(1, vocab) for _ in range(args.tokens)]
    # A warm-up run: the rate foresight measures as it runs (the server's first job does too).
    warm = Foresight()
    warm.offer("w", tokens[:512], expected=False)
    t0 = time.perf_counter()
    warm.run(PrefixManager(lambda: make_prompt_cache(model), max_bytes=1 << 34),
             ModelPair(model), args.step, lambda: False)
    rate = (time.perf_counter() - t0) / 512
    print(f"model: {args.model or 'embedded SmolLM2-135M'}; prefill ~{1 / rate:.0f} tok/s; "
          f"a {args.tokens}-token foreseen prefix; {args.tries} requests arriving at random "
          f"times while it is computed")
    rows = []
    for name, whole in (("now (chunks of ~%.2f s)" % fs_mod.YIELD_S, False),
                        (f"before (chunks of {args.step} tokens)", True)):
        waits = []
        for _ in range(args.tries):
            delay = rng.uniform(0.05, max(0.1, 0.8 * args.tokens * rate))
            waits.append(one_wait(model, tokens, args.step, whole, delay, rate))
        rows.append((name, statistics.median(waits), max(waits)))
    print(f"{'chunks':<32} {'wait p50 (s)':>12} {'wait max (s)':>12}")
    for name, p50, worst in rows:
        print(f"{name:<32} {p50:12.3f} {worst:12.3f}")
    print(f"ratio of the worst waits, now / before: {rows[0][2] / max(rows[1][2], 1e-9):.3f}")


if __name__ == "__main__":
    main()
