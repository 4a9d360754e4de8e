#!/usr/bin/env python
"""Benchmark prefix reuse: cold prefill vs `PrefixCache` vs mlx-lm's `LRUPromptCache`
(a benchmark, not a test).

Three contenders serve the same request sequences, one request at a time:

  cold     fresh mlx-lm caches for every request (``mlx_lm.generate.stream_generate``)
  prefix   ``mlx_kvcache.PrefixCache.stream_generate``
  lru      mlx-lm's ``LRUPromptCache`` driven the way ``mlx_lm.server`` does on its
           sequential path (``_serve_single``): ``fetch_nearest_cache`` ->
           ``make_prompt_cache`` on a miss -> ``stream_generate(prompt=rest,
           prompt_cache=cache)`` -> ``insert_cache(prompt + generated, cache)``.
           It gets a generous ``max_size`` / ``max_bytes`` so it never evicts.

For every request the three run back to back in a rotating order (interleaved, so
background load hits them alike). Time to first token (TTFT) is measured outside each
contender, from the call (for lru: from ``fetch_nearest_cache``) to the first response.
"ideal" is the TTFT of prefilling only the tokens PrefixCache did not restore, on top of
a cache that already holds the rest (the cold run's cache, trimmed back): the floor any
reuse scheme could reach. Greedy decoding; each contender's tokens are checked against
the cold run's.

Workloads:
  a. multi-turn chat: a ~600-token system prompt, ~6 turns; each turn appends the
     answer and a new ~60-100-token user message (rendered with the chat template).
  b. shared system prompt: 6 requests (``--batch 8`` for more) sharing a ~1000-token system prompt, each with
     its own ~50-token user message.
  c. tiny hybrid model (qwen3_next: 3 gated-delta-net layers + 1 attention layer,
     float32): prompts that share a long prefix and diverge at different points inside
     an earlier prompt. Reports the fraction of prompt tokens each reuses.
     mlx-lm cannot trim ``ArraysCache``, so LRUPromptCache gets nothing there.

a and b use the embedded SmolLM2-135M-Instruct (``mlx_kvcache.models.default``) with its
tokenizer and chat template; without it, a random-weight llama with random token ids.

    python scripts/bench_prefix.py            # ~4 min on 2 busy CPU cores (less when idle)
    python scripts/bench_prefix.py --batch 8 --max-tokens 16   # the fuller run, ~5 min
    python scripts/bench_prefix.py --quick    # < 1 min
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time

# Must come before mlx / mlx_lm: it preloads a fast BLAS for the CPU build.
import mlx_kvcache  # isort: skip

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate as mlx_stream_generate  # noqa: E402
from mlx_lm.models import cache as mlc  # noqa: E402

from mlx_kvcache import PrefixCache  # noqa: E402
from mlx_kvcache.testing import TokenIdTokenizer as IdTokenizer, build  # noqa: E402

MODEL_KEY = ("bench-model", None, None)  # what mlx_lm.server uses as the trie key
CONTENDERS = ("cold", "prefix", "lru")
ORDERS = [("cold", "prefix", "lru"), ("prefix", "lru", "cold"), ("lru", "cold", "prefix"),
          ("cold", "lru", "prefix"), ("lru", "prefix", "cold"), ("prefix", "cold", "lru")]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def mib(n):
    return n / 2**20


# -- tokenizers / models ------------------------------------------------------------------
def build_random_llama(vocab=32000):
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=vocab,
        tie_word_embeddings=False))
    mx.eval(model.parameters())
    return model


def build_tiny_hybrid():
    """The tiny qwen3_next hybrid the tests use (float32, vocab 128)."""
    return build("qwen3_next")


def load_main_model():
    """(model, tokenizer, description, is_text)."""
    try:
        from mlx_kvcache.models.default import load_default_model

        t0 = time.perf_counter()
        model, tok = load_default_model()
        if not getattr(tok, "has_chat_template", False):
            raise RuntimeError("tokenizer has no chat template")
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                      add_generation_prompt=True)
        mx.eval(model(mx.array(ids)[None]))
        return model, tok, f"SmolLM2-135M-Instruct (embedded GGUF, loaded in " \
                           f"{time.perf_counter() - t0:.1f} s)", True
    except Exception as e:  # noqa: BLE001 - any failure: fall back
        print(f"  default model unavailable ({type(e).__name__}: {e}); using a random llama")
        return build_random_llama(), IdTokenizer(), \
            "random llama hidden=512 layers=8 kv_heads=4 float32 (random token ids)", False


# -- prompt text --------------------------------------------------------------------------
WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an have "
    "not which but all were when we there can more one their has been if would will "
    "about into than them some could these other time only new after also what first "
    "system model cache memory token prompt layer value key state request answer user "
    "question server batch prefix tree node snapshot restore offset length window "
    "history message reply context data table report value number result method test "
    "river mountain city garden window music paper light water stone forest morning "
    "always never often quickly slowly carefully gently clearly simply exactly nearly"
).split()


def make_text(rng, tok, n_tokens, prefix=""):
    """Plain English-looking text of about ``n_tokens`` tokens."""
    words = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(8))
        if rng.random() < 0.5:
            words[-1] += "."
        text = prefix + " ".join(words)
        if len(tok.encode(text, add_special_tokens=False)) >= n_tokens:
            return text


# -- the three contenders ------------------------------------------------------------------
def first_and_rest(gen, t0):
    """Drain a response generator; (TTFT, tokens, last response)."""
    ttft, toks, last = None, [], None
    for r in gen:
        if ttft is None:
            ttft = time.perf_counter() - t0
        toks.append(int(r.token))
        last = r
    return ttft, toks, last


class Contenders:
    def __init__(self, model, tok, max_tokens, prefix_kwargs=None):
        self.model, self.tok, self.max_tokens = model, tok, max_tokens
        self.prefix = PrefixCache(model, max_bytes=8 << 30, **(prefix_kwargs or {}))
        # Every contender prefills in chunks of the same size.
        self.step = self.prefix.prefill_step_size
        self.lru = mlc.LRUPromptCache(max_size=100_000, max_bytes=1 << 62)
        self.last_cold_cache = None

    def cold(self, ids):
        t0 = time.perf_counter()
        cache = mlc.make_prompt_cache(self.model)
        ttft, toks, _ = first_and_rest(
            mlx_stream_generate(self.model, self.tok, ids, max_tokens=self.max_tokens,
                                prompt_cache=cache, prefill_step_size=self.step), t0)
        self.last_cold_cache = cache
        return dict(ttft=ttft, toks=toks, reprocessed=len(ids), total=time.perf_counter() - t0)

    def run_prefix(self, ids):
        t0 = time.perf_counter()
        ttft, toks, last = first_and_rest(
            self.prefix.stream_generate(self.tok, ids, self.max_tokens), t0)
        st = last.cache
        return dict(ttft=ttft, toks=toks, reprocessed=st.prefilled_tokens,
                    restored=st.restored_tokens, matched=st.matched_tokens,
                    total=time.perf_counter() - t0)

    def run_lru(self, ids):
        # mlx_lm.server._serve_single, minus the HTTP / queue plumbing.
        t0 = time.perf_counter()
        cache_key = list(ids)
        cache, rest = self.lru.fetch_nearest_cache(MODEL_KEY, cache_key)
        cached = len(ids) - len(rest)
        rest = list(ids)[cached:]
        if not rest:  # 0.32.2 would raise here (exact-hit hazard); never happens below
            raise RuntimeError("LRUPromptCache exact hit: nothing left to prefill")
        if cache is None:
            cache = mlc.make_prompt_cache(self.model)
        ttft, toks = None, []
        for gen in mlx_stream_generate(self.model, self.tok, rest, max_tokens=self.max_tokens,
                                       prompt_cache=cache, prefill_step_size=self.step):
            if ttft is None:
                ttft = time.perf_counter() - t0
            toks.append(int(gen.token))
            cache_key.append(gen.token)
            if gen.finish_reason is not None:
                break
        self.lru.insert_cache(MODEL_KEY, cache_key, cache)
        return dict(ttft=ttft, toks=toks, reprocessed=len(rest), restored=cached,
                    total=time.perf_counter() - t0)

    def ideal(self, ids, restored):
        """TTFT of prefilling ids[restored:] on a cache already holding ids[:restored]
        (the cold run's cache, trimmed back; KV layers only)."""
        cache = self.last_cold_cache
        self.last_cold_cache = None
        if cache is None or not mlc.can_trim_prompt_cache(cache):
            return None
        off = cache[0].offset
        mlc.trim_prompt_cache(cache, off - restored)
        mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        ttft, _, _ = first_and_rest(
            mlx_stream_generate(self.model, self.tok, list(ids[restored:]), max_tokens=1,
                                prompt_cache=cache, prefill_step_size=self.step), t0)
        return ttft

    def lru_logical_bytes(self):
        """Bytes of the valid rows of every stored LRU cache (its own count includes the
        buffers' spare rows)."""
        total = 0
        stack = [self.lru._trie._trie]
        while stack:
            d = stack.pop()
            for k, v in d.items():
                if k == "__value__":
                    for c in v.prompt_cache:
                        if getattr(c, "keys", None) is not None and hasattr(c, "offset"):
                            used = c.keys[..., : c.offset, :].nbytes * 2
                            total += used
                        else:
                            total += c.nbytes
                else:
                    stack.append(v)
        return total


def warm_up(model, tok, text_model):
    ids = (tok.apply_chat_template([{"role": "user", "content": "warm up " * 20}],
                                   add_generation_prompt=True) if text_model
           else list(range(1, 120)))
    c = Contenders(model, tok, 4)
    for _ in range(2):
        c.cold(ids), c.run_prefix(ids), c.run_lru(ids + [ids[-1]])
    c.prefix.clear()


def serve(c, requests_fn, n_requests, label, want_ideal=True):
    """Run the request sequence on all contenders; returns per-request rows."""
    rows = []
    prev_outputs = None
    for i in range(n_requests):
        ids = requests_fn(i, prev_outputs)
        res = {}
        for name in ORDERS[i % len(ORDERS)]:
            if name == "cold":
                res[name] = c.cold(ids)
                cold_cache = c.last_cold_cache
            elif name == "prefix":
                res[name] = c.run_prefix(ids)
            else:
                res[name] = c.run_lru(ids)
        c.last_cold_cache = cold_cache
        ideal = c.ideal(ids, res["prefix"]["restored"]) if want_ideal else None
        row = dict(i=i, n=len(ids), res=res, ideal=ideal,
                   prefix_ok=res["prefix"]["toks"] == res["cold"]["toks"],
                   lru_ok=res["lru"]["toks"] == res["cold"]["toks"])
        rows.append(row)
        prev_outputs = res["cold"]["toks"]
        print(f"  {label}{i:<3} {len(ids):>6} {res['cold']['reprocessed']:>6} "
              f"{res['prefix']['reprocessed']:>6} {res['lru']['reprocessed']:>6}  "
              f"{1e3 * res['cold']['ttft']:>8.1f} {1e3 * res['prefix']['ttft']:>8.1f} "
              f"{1e3 * res['lru']['ttft']:>8.1f} "
              f"{(1e3 * ideal if ideal is not None else float('nan')):>8.1f}   "
              f"{'ok' if row['prefix_ok'] else 'DIFF':>4} {'ok' if row['lru_ok'] else 'DIFF':>4}",
              flush=True)
    return rows


HEADER = (f"  {'req':<4} {'prompt':>6} {'reprocessed tokens':^20}  {'TTFT ms':^35}   "
          f"{'= cold?':^9}\n"
          f"  {'':<4} {'':>6} {'cold':>6} {'prefix':>6} {'lru':>6}  {'cold':>8} {'prefix':>8} "
          f"{'lru':>8} {'ideal':>8}   {'pfx':>4} {'lru':>4}")


def summarize(name, rows, c, hits_from=1):
    hits = rows[hits_from:]
    t = {k: median([r["res"][k]["ttft"] for r in hits]) for k in CONTENDERS}
    t_ideal = median([r["ideal"] for r in hits])
    r_cold = median([r["res"]["prefix"]["ttft"] / r["res"]["cold"]["ttft"] for r in hits])
    r_lru = median([r["res"]["prefix"]["ttft"] / r["res"]["lru"]["ttft"] for r in hits])
    r_ideal = median([r["res"]["prefix"]["ttft"] / r["ideal"] for r in hits
                      if r["ideal"] is not None])
    reproc = {k: statistics.mean(r["res"][k]["reprocessed"] for r in rows) for k in CONTENDERS}
    reproc_hits = {k: statistics.mean(r["res"][k]["reprocessed"] for r in hits)
                   for k in CONTENDERS}
    pb, lb, ll = c.prefix.nbytes, c.lru.nbytes, c.lru_logical_bytes()
    s = dict(name=name, t=t, t_ideal=t_ideal, r_cold=r_cold, r_lru=r_lru, r_ideal=r_ideal,
             reproc=reproc, reproc_hits=reproc_hits, prefix_bytes=pb, lru_bytes=lb,
             lru_logical=ll, bytes_ratio=pb / lb if lb else float("nan"),
             prefix_ok=sum(r["prefix_ok"] for r in rows), lru_ok=sum(r["lru_ok"] for r in rows),
             n=len(rows), n_entries=len(c.lru))
    print(f"\n  requests {hits_from}..{len(rows) - 1} (hits), median TTFT: "
          f"cold {1e3 * t['cold']:.1f} ms, prefix {1e3 * t['prefix']:.1f} ms, "
          f"lru {1e3 * t['lru']:.1f} ms, ideal {1e3 * t_ideal:.1f} ms")
    print(f"  median per-request ratios: prefix/cold {r_cold:.3f}x, prefix/lru {r_lru:.3f}x, "
          f"prefix/ideal {r_ideal:.3f}x (goal <= 1.2x)")
    print(f"  tokens reprocessed per request (all / hits): "
          + ", ".join(f"{k} {reproc[k]:.0f} / {reproc_hits[k]:.0f}" for k in CONTENDERS))
    print(f"  bytes held at the end: PrefixCache {mib(pb):.2f} MiB, LRUPromptCache "
          f"{mib(lb):.2f} MiB in {len(c.lru)} entries (valid rows only: {mib(ll):.2f} MiB); "
          f"prefix/lru {s['bytes_ratio']:.3f}x (vs valid rows {pb / ll if ll else float('nan'):.3f}x)")
    print(f"  greedy tokens equal to cold: prefix {s['prefix_ok']}/{len(rows)}, "
          f"lru {s['lru_ok']}/{len(rows)}")
    return s


# -- a. multi-turn chat -------------------------------------------------------------------
def workload_chat(c, tok, text_model, args):
    rng = random.Random(1)
    if text_model:
        messages = [{"role": "system",
                     "content": make_text(rng, tok, args.system_tokens,
                                          "You are a careful assistant. ")}]

        def request(i, prev):
            if i > 0:
                messages.append({"role": "assistant", "content": tok.decode(prev)})
            messages.append({"role": "user", "content": make_text(
                rng, tok, rng.randint(args.user_min, args.user_max), f"Question {i + 1}: ")})
            return tok.apply_chat_template(messages, add_generation_prompt=True)
    else:
        conv = [rng.randrange(1, 32000) for _ in range(args.system_tokens)]

        def request(i, prev):
            if i > 0:
                conv.extend(prev + [2])
            conv.extend(rng.randrange(1, 32000)
                        for _ in range(rng.randint(args.user_min, args.user_max)))
            return list(conv)

    print(HEADER)
    rows = serve(c, request, args.turns, "a")
    return summarize("a. multi-turn chat", rows, c)


# -- b. shared system prompt ------------------------------------------------------------
def workload_shared(c, tok, text_model, args):
    rng = random.Random(2)
    if text_model:
        system = make_text(rng, tok, args.shared_tokens, "You are a support agent. ")
        users = [make_text(rng, tok, args.shared_user, f"Ticket {i + 1}: ")
                 for i in range(args.batch)]

        def request(i, prev):
            return tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": users[i]}],
                add_generation_prompt=True)
    else:
        system = [rng.randrange(1, 32000) for _ in range(args.shared_tokens)]
        users = [[rng.randrange(1, 32000) for _ in range(args.shared_user)]
                 for _ in range(args.batch)]

        def request(i, prev):
            return system + users[i]

    print(HEADER)
    rows = serve(c, request, args.batch, "b")
    return summarize("b. shared system prompt", rows, c)


# -- c. hybrid model, diverging prompts --------------------------------------------------
def workload_hybrid(args):
    model = build_tiny_hybrid()
    tok = IdTokenizer()
    rng = random.Random(3)
    L = args.hybrid_len
    base = [rng.randrange(128) for _ in range(L)]
    # Each request shares a long prefix with an earlier prompt and diverges inside it.
    cuts = [int(L * f) for f in args.hybrid_cuts]
    prompts, where = [base], []
    for j, d in enumerate(cuts):
        k = len(prompts) - 1 if j % 2 else 0  # diverge inside the base or the last prompt
        d = min(d, len(prompts[k]) - 8)
        where.append(f"#{k}@{d}")
        prompts.append(prompts[k][:d] + [rng.randrange(128) for _ in range(args.hybrid_tail)])

    configs = [("prefix", dict()),
               (f"prefix(si={args.hybrid_interval})", dict(snapshot_interval=args.hybrid_interval))]
    print(f"  tiny qwen3_next (3 gated-delta-net + 1 attention layer, float32), "
          f"{len(prompts)} prompts: #0 = {L} random tokens, then #1.. = prompt #k's first "
          f"d tokens + {args.hybrid_tail} new ones, #k@d = {' '.join(where)}")
    print(f"  'prefix' = PrefixCache defaults (pre_end_margin=4, snapshot_interval=2048); "
          f"'prefix(si={args.hybrid_interval})' = snapshot_interval={args.hybrid_interval}")
    out = {}
    cold_toks = []
    cold_t = []
    cold_c = Contenders(model, tok, args.max_tokens)
    warm = Contenders(model, tok, 2)
    warm.cold(base[:40]), warm.run_prefix(base[:40]), warm.run_lru(base[:41])
    for p in prompts:
        r = cold_c.cold(p)
        cold_toks.append(r["toks"]), cold_t.append(r["ttft"])
    for label, kw in configs + [("lru", None)]:
        c = Contenders(model, tok, args.max_tokens, kw)
        reused, total, ok, ttfts = 0, 0, 0, []
        per = []
        for k, p in enumerate(prompts):
            r = c.run_lru(p) if label == "lru" else c.run_prefix(p)
            ok += r["toks"] == cold_toks[k]
            if k > 0:  # the first prompt is a miss for everyone
                reused += r["restored"]
                total += len(p)
                ttfts.append(r["ttft"])
            per.append(r["restored"])
        nbytes = c.lru.nbytes if label == "lru" else c.prefix.nbytes
        out[label] = dict(hit=reused / total, ok=ok, ttft=median(ttfts), per=per, bytes=nbytes)
        print(f"  {label:<16} reused tokens per request {per}  hit rate {100 * reused / total:5.1f}%  "
              f"median TTFT {1e3 * median(ttfts):6.1f} ms  bytes {mib(nbytes):.2f} MiB  "
              f"tokens = cold {ok}/{len(prompts)}")
    print(f"  {'cold':<16} median TTFT {1e3 * median(cold_t[1:]):6.1f} ms "
          f"(prompt lengths {[len(p) for p in prompts]})")
    out["cold_ttft"] = median(cold_t[1:])
    out["n"] = len(prompts)
    return out


# -- main --------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (< 1 min)")
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens (12; quick 6)")
    p.add_argument("--turns", type=int, default=None, help="a: chat turns (6; quick 3)")
    p.add_argument("--system-tokens", type=int, default=None, help="a: system prompt (600; quick 150)")
    p.add_argument("--user-min", type=int, default=60)
    p.add_argument("--user-max", type=int, default=100)
    p.add_argument("--batch", type=int, default=None, help="b: requests (6; quick 3)")
    p.add_argument("--shared-tokens", type=int, default=None, help="b: shared prompt (1000; quick 200)")
    p.add_argument("--shared-user", type=int, default=50)
    p.add_argument("--hybrid-len", type=int, default=None, help="c: base prompt (512; quick 256)")
    p.add_argument("--hybrid-tail", type=int, default=48)
    p.add_argument("--hybrid-interval", type=int, default=64)
    p.add_argument("--hybrid-cuts", type=float, nargs="+",
                   default=[0.8, 0.6, 0.35, 0.8, 0.5, 0.2])
    p.add_argument("--skip", nargs="*", default=[], choices=("a", "b", "c"))
    args = p.parse_args(argv)
    q = args.quick
    args.max_tokens = args.max_tokens or (6 if q else 12)
    args.turns = args.turns or (3 if q else 6)
    args.system_tokens = args.system_tokens or (150 if q else 600)
    args.batch = args.batch or (3 if q else 6)
    args.shared_tokens = args.shared_tokens or (200 if q else 1000)
    args.hybrid_len = args.hybrid_len or (256 if q else 512)
    if q:
        args.user_min, args.user_max = min(args.user_min, 40), min(args.user_max, 60)

    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    from mlx_kvcache import _blas
    import mlx_lm

    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}, "
          f"BLAS preloaded: {_blas.loaded}")
    print(f"greedy, max_tokens={args.max_tokens}; TTFT medians are over the hit requests "
          f"(request 0 is a miss for every contender)")
    t_start = time.perf_counter()
    sums = {}
    if not {"a", "b"} <= set(args.skip):
        model, tok, desc, text_model = load_main_model()
        print(f"  model: {desc}")
        warm_up(model, tok, text_model)
        if "a" not in args.skip:
            print(f"\n== a. multi-turn chat: ~{args.system_tokens}-token system prompt, "
                  f"{args.turns} turns, {args.user_min}-{args.user_max}-token user messages ==")
            t0 = time.perf_counter()
            sums["a"] = workload_chat(Contenders(model, tok, args.max_tokens), tok, text_model, args)
            print(f"  ({time.perf_counter() - t0:.0f} s)")
        if "b" not in args.skip:
            print(f"\n== b. shared system prompt: {args.batch} requests, ~{args.shared_tokens}-token "
                  f"system prompt + ~{args.shared_user}-token user part ==")
            t0 = time.perf_counter()
            sums["b"] = workload_shared(Contenders(model, tok, args.max_tokens), tok,
                                        text_model, args)
            print(f"  ({time.perf_counter() - t0:.0f} s)")
        del model
    hyb = None
    if "c" not in args.skip:
        print("\n== c. hybrid model, diverging prompts ==")
        hyb = workload_hybrid(args)

    print(f"\n== summary ({time.perf_counter() - t_start:.0f} s) ==")
    for k, s in sums.items():
        t = s["t"]
        print(f"{s['name']}: median TTFT cold {1e3 * t['cold']:.0f} ms | prefix "
              f"{1e3 * t['prefix']:.0f} ms | lru {1e3 * t['lru']:.0f} ms | ideal "
              f"{1e3 * s['t_ideal']:.0f} ms")
        print(f"   prefix/cold {s['r_cold']:.3f}x  prefix/lru {s['r_lru']:.3f}x  "
              f"prefix/ideal {s['r_ideal']:.3f}x ({'within' if s['r_ideal'] <= 1.2 else 'NOT within'} 1.2x)")
        print(f"   tokens reprocessed per hit request: cold {s['reproc_hits']['cold']:.0f}, "
              f"prefix {s['reproc_hits']['prefix']:.0f}, lru {s['reproc_hits']['lru']:.0f}")
        goal = " (goal <= 0.5x: " + ("met" if s["bytes_ratio"] <= 0.5 else "NOT met") + ")" \
            if k == "b" else ""
        print(f"   bytes held: prefix {mib(s['prefix_bytes']):.1f} MiB, lru "
              f"{mib(s['lru_bytes']):.1f} MiB -> {s['bytes_ratio']:.3f}x{goal}")
        print(f"   greedy tokens = cold: prefix {s['prefix_ok']}/{s['n']}, lru {s['lru_ok']}/{s['n']}")
    if hyb:
        parts = [f"{k} {100 * v['hit']:.1f}%" for k, v in hyb.items() if isinstance(v, dict)]
        print(f"c. hybrid diverging prompts: hit rate (reused / prompt tokens, requests 1..) "
              + ", ".join(parts))
        print("   median TTFT: " + ", ".join(
            f"{k} {1e3 * v['ttft']:.1f} ms" for k, v in hyb.items() if isinstance(v, dict))
            + f", cold {1e3 * hyb['cold_ttft']:.1f} ms")
        print("   greedy tokens = cold: " + ", ".join(
            f"{k} {v['ok']}/{hyb['n']}" for k, v in hyb.items() if isinstance(v, dict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
