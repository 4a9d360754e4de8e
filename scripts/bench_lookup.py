"""Prompt-lookup decoding against stock ``mlx_lm.server`` and plain decoding, side by side.

Three servers on the same model, in one run: stock ``mlx_lm.server``, ``mlx-kvcache
serve --no-prompt-lookup`` (plain decoding) and ``mlx-kvcache serve`` (prompt lookup, its
default). Two answers, each requested ``--repeats`` times from every server in turn:

* **edit** — an agent's answer that copies: after reading a file (a tool result in the
  prompt) the model answers with an ``Edit`` whose ``old_string`` quotes ``--quote``
  lines of it and whose ``new_string`` quotes them again with three small changes;
* **fresh** — an answer with no copying: the file's own words in another order, so every
  step finds a (wrong) match in the context — the case where drafting must stop at once.

The model is `testing.copy_model`: a real mlx-lm body (llama, or a gated-delta-net
hybrid) whose greedy answer is written out position by position, so every server gives
the same answer (checked) while each forward pass costs what the body costs. The body is
small and its vocabulary a real one's (32k): a pass reads ~100 MB of weights, mostly the
output layer, once whatever the tokens, and verifying ten more tokens adds only their
arithmetic (printed: a pass of 11 tokens relative to one) — as on a Mac, whose decode
reads every weight of the model once a pass. The tokenizer splits as GPT-2's does
(a word with its space, runs of symbols, whitespace): code-like token counts.

Each server first answers both requests once, unmeasured (loading, compiling, filling
its prompt cache — and, for ours, measuring what its passes cost), as a server that has
been running does.

Reported per row: decode time per output token (first token to last: prefill excluded)
for each server (medians of the repeats), prompt lookup's time over stock's and over
plain decoding's (the median of each repeat's ratio: the three run back to back, so the
drift of a shared machine cancels), and forward passes per output token (``GET
/v1/cache``; stock and plain decoding run one per token).

    python scripts/bench_lookup.py                         # llama and the hybrid
    python scripts/bench_lookup.py --kinds llama --repeats 5 --quote 40
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_kvcache  # noqa: E402,F401  (first: BLAS preload)
import mlx.core as mx  # noqa: E402

from mlx_kvcache.testing.copy_dirs import write_copy_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server, stop_servers_on_sigterm  # noqa: E402

#: Small bodies with a real model's vocabulary (32k): a pass reads ~100 MB of weights, most of
#: it the output layer, once whatever the tokens — memory-bound as a Mac's decode is — and
#: verifying ten tokens more adds their arithmetic (printed as ``verify``).
BODIES = {
    "llama": dict(model_type="llama", hidden_size=512, num_hidden_layers=8,
                  intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=32000,
                  max_position_embeddings=16384, tie_word_embeddings=False),
    # a Qwen3.5-style hybrid: gated delta nets, one attention layer in three
    "hybrid": {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": dict(
        model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=6,
        intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        rms_norm_eps=1e-6, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=3, tie_word_embeddings=False, vocab_size=32000,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "rope_type": "default"})},
}
SPECIALS = ["<unk>", "<s>", "</s>"]
#: GPT-2's split: a word or a run of symbols with the space before it, spaces kept whole.
TOKEN_RE = r" ?\w+| ?[^\w\s]+|\s+(?!\S)|\s+"


# -- the texts ------------------------------------------------------------------------------
def source_file(lines: int, rng: random.Random) -> List[str]:
    """A Python-like file: small functions with arithmetic, branches and calls."""
    names = ["total", "count", "value", "index", "result", "offset", "limit", "items",
             "buffer", "state", "width", "height", "scale", "delta", "weight", "score"]
    out: List[str] = []
    f = 0
    while len(out) < lines:
        a, b = rng.sample(names, 2)
        out.append(f"def compute_{f}({a}, {b}):")
        for _ in range(rng.randrange(3, 7)):
            x, y, z = rng.sample(names, 3)
            kind = rng.randrange(4)
            if kind == 0:
                out.append(f"    {x} = {y} * {rng.randrange(2, 97)} + {z}")
            elif kind == 1:
                out.append(f"    if {x} > {rng.randrange(1000)}:")
                out.append(f"        {y} = helper_{rng.randrange(40)}({z}, {x})")
            elif kind == 2:
                out.append(f"    for {x} in range({y}):")
                out.append(f"        {z} += {x} // {rng.randrange(2, 9)}")
            else:
                out.append(f"    {x} = [{y}, {z}, {rng.randrange(100)}]")
        out.append(f"    return {a} + {b}")
        out.append("")
        f += 1
    return out[:lines]


def scenario(lines: int, quote: int, seed: int = 0) -> Dict[str, str]:
    rng = random.Random(seed)
    file = source_file(lines, rng)
    start = lines // 3
    old = file[start:start + quote]
    new = list(old)
    for j in (3, quote // 2, quote - 4):  # three small changes
        new[j] = new[j].replace(" + ", " - ", 1) if " + " in new[j] else new[j] + "  # checked"
    system = ("You are a coding agent. Use the tools to read and edit files. Answer with one "
              "tool call at a time.\n") * 6
    body = "\n".join(file)
    context = (f"{system}\nUser: In app.py, subtract instead of adding in three places.\n"
               f"Tool call: Read(file_path=\"app.py\")\nTool result:\n{body}\nAssistant: ")
    edit = ("Edit(file_path=\"app.py\", old_string=\"" + "\n".join(old) + "\", new_string=\""
            + "\n".join(new) + "\")")
    words = [w for line in file for w in line.split()]
    rng2 = random.Random(seed + 1)
    fresh_words = [rng2.choice(words) for _ in range(len(edit.split()) // 2)]
    fresh = "The change touches " + " ".join(fresh_words) + "."
    # The fresh request's prompt goes on past the edit's answer (its positions must not
    # meet the edit answer's in the script): the same context, padded, another question.
    import re
    pad = "Notes: " + " ".join(rng2.choice(words)
                               for _ in range(len(re.findall(TOKEN_RE, edit)) + 50))
    fresh_context = context + f"\n{pad}\nUser: Explain the change in one paragraph.\nAssistant: "
    return {"edit_prompt": context, "edit": edit, "fresh_prompt": fresh_context, "fresh": fresh}


def write_tokenizer(path: Path, texts: List[str]) -> None:
    """A word-level tokenizer: words, runs of spaces and single symbols (exact round trip)."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = sorted({p for t in texts for p in re.findall(TOKEN_RE, t)})
    vocab = {t: i for i, t in enumerate(SPECIALS + pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(TOKEN_RE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(path))


def build(root: Path, kind: str, texts: Dict[str, str]) -> Tuple[Path, Dict[str, Any]]:
    """The model directory for ``kind`` and each answer's (prompt ids, answer ids)."""
    from transformers import AutoTokenizer

    tokdir = root / "tokenizer"
    if not tokdir.exists():
        write_tokenizer(tokdir, list(texts.values()))
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    eos = tok.convert_tokens_to_ids("</s>")
    cases, script = {}, {}
    for name in ("edit", "fresh"):
        prompt = tok.encode(texts[f"{name}_prompt"])
        answer = tok.encode(texts[name]) + [eos]
        for i, t in enumerate(answer):
            assert len(prompt) + i not in script
            script[len(prompt) + i] = t
        cases[name] = (prompt, answer)
    assert len(tok) <= 32000
    body = json.loads(json.dumps(BODIES[kind]))

    def tokenizer(path):
        for f in tokdir.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    d = write_copy_dir(root / kind, inner=body, script=script, tokenizer=tokenizer)
    return d, cases


# -- measuring ---------------------------------------------------------------------------------
def verify_cost(d: Path, prompt: List[int], k: int = 10, repeats: int = 9) -> float:
    """A pass over ``k + 1`` tokens relative to a pass over one, after ``prompt`` (median)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    m = load_model(d, trust_remote_code=True)[0]
    cache = make_prompt_cache(m)
    m(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])

    def timed(n):
        out = []
        for _ in range(repeats):
            snap = [c.state for c in cache]
            t0 = time.perf_counter()
            mx.eval(m(mx.array([[5] * n]), cache=cache))
            out.append(time.perf_counter() - t0)
            for c, s in zip(cache, snap):
                c.state = s
        return statistics.median(out)
    timed(1)
    return timed(k + 1) / timed(1)


def decision_cost(prompt: List[int], answer: List[int]) -> float:
    """Seconds a plain step spends deciding not to draft: the drafter's proposal and the
    policy's choice, per token of ``answer`` after ``prompt`` (median; no model runs)."""
    from mlx_kvcache.generation.draft_length import LookupLength, LookupTally
    from mlx_kvcache.generation.lookup import PromptLookup

    pl, ll, tally = PromptLookup(prompt), LookupLength(), LookupTally()
    out = []
    for t in answer:
        t0 = time.perf_counter()
        toks, match = pl.propose(11)
        if toks:
            ll.next(match, len(toks) - 1, tally)
        out.append(time.perf_counter() - t0)
        pl.extend([t])
    return statistics.median(out)


def stream(port: int, prompt: str, max_tokens: int) -> Tuple[str, int, float]:
    """(text, completion tokens, decode seconds per token after the first)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    text, times, usage = [], [], None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices") or ():
            if c.get("text"):
                text.append(c["text"])
                times.append(time.perf_counter())
    conn.close()
    n = usage["completion_tokens"]
    return "".join(text), n, (times[-1] - times[0]) / max(n - 1, 1)


def passes(server: Server, sent: float) -> Tuple[int, int]:
    """(forward passes, tokens) of ours' request sent at ``sent``."""
    e = server.entry_since(sent)
    return e["decoding"]["forward_passes"], e["answer_tokens"]


def run_kind(kind: str, root: Path, texts: Dict[str, str], repeats: int) -> List[Dict[str, Any]]:
    d, cases = build(root, kind, texts)
    ratio = verify_cost(d, cases["edit"][0])
    decide = decision_cost(*cases["fresh"])
    print(f"[{kind}] a verify pass of 11 tokens costs {ratio:.2f}x a one-token pass here; "
          f"deciding a step's proposal takes {decide * 1e6:.0f} us", flush=True)
    common = ("--trust-remote-code",)
    servers = {
        "stock": Server.stock(d, root / f"{kind}-stock.log", root, *common),
        "plain": Server.ours(d, root / f"{kind}-plain.log", root, *common, "--no-persist",
                             "--no-prompt-lookup"),
        "lookup": Server.ours(d, root / f"{kind}-lookup.log", root, *common, "--no-persist"),
    }
    rows = []
    try:
        for s in servers.values():  # warm up: load, compile, fill the prompt cache, and
            for name in ("edit", "fresh"):  # let ours measure its passes (as a server has)
                stream(s.port, texts[f"{name}_prompt"], len(cases[name][1]) + 8)
        for name in ("edit", "fresh"):
            prompt, answer = cases[name]
            want = texts[name]
            per: Dict[str, List[float]] = {k: [] for k in servers}
            ppt: List[float] = []
            for r in range(repeats):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for key in order:
                    s = servers[key]
                    sent = time.time()
                    text, n, spt = stream(s.port, texts[f"{name}_prompt"], len(answer) + 8)
                    assert text == want and n == len(answer), (key, name, n, len(answer))
                    per[key].append(spt)
                    if key == "lookup":
                        p, tokens = passes(s, sent)
                        ppt.append(p / tokens)
            med = {k: statistics.median(v) for k, v in per.items()}

            def paired(a, b):  # each repeat's ratio (run back to back): the machine's drift cancels
                return statistics.median(x / y for x, y in zip(per[a], per[b]))
            rows.append({"model": kind, "answer": name, "tokens": len(answer),
                         "verify_cost_11": ratio, "decision_us": 1e6 * decide,
                         **{f"{k}_ms_per_token": 1000 * v for k, v in med.items()},
                         "lookup_vs_stock": paired("lookup", "stock"),
                         "lookup_vs_plain": paired("lookup", "plain"),
                         "plain_vs_stock": paired("plain", "stock"),
                         "passes_per_token": statistics.median(ppt),
                         "runs": {k: [round(1000 * x, 3) for x in v] for k, v in per.items()}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| model | answer | tokens | stock ms/tok | plain ms/tok | lookup ms/tok | "
           "lookup ÷ stock | lookup ÷ plain | passes / token |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['answer']} | {r['tokens']} | "
                   f"{r['stock_ms_per_token']:.1f} | {r['plain_ms_per_token']:.1f} | "
                   f"{r['lookup_ms_per_token']:.1f} | **{r['lookup_vs_stock']:.2f}** | "
                   f"{r['lookup_vs_plain']:.2f} | {r['passes_per_token']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="llama,hybrid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lines", type=int, default=150, help="lines of the file read")
    ap.add_argument("--quote", type=int, default=40, help="lines the Edit quotes")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    stop_servers_on_sigterm()
    texts = scenario(args.lines, args.quote)
    root = Path(tempfile.mkdtemp(prefix="bench_lookup-"))
    rows = []
    for kind in args.kinds.split(","):
        rows += run_kind(kind, root, texts, args.repeats)
    print()
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
