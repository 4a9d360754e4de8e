"""`mlx-kvcache serve` on the paths stock `mlx_lm.server` serves one request at a time —
speculative decoding (`--draft-model`), quantized KV (`--kv-bits`), chunked attention
(llama4), a cache class nobody knows, seeded requests on a hybrid model — and every miss
explained. Real servers on loopback; every wait bounded by the servers' progress.

On each path: the same answers as stock (top-5 log-probs to 1e-4) — as a cold run where
stock's reuse is wrong (llama4, kv-bits, speculative decoding) and as plain decoding where
stock raises (speculative decoding on a hybrid) — at least as many cached tokens as stock on every
request and some on every repeat, the byte budget held, and a hit after a restart on the
same ``--cache-dir``.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc

from mlx_kvcache.testing import write_draft_dir, write_model_dir, write_paged_model_dir
from mlx_kvcache.testing.servers import Server, answer, same_answer
from mlx_kvcache.testing.waits import CAP

sys.path.insert(0, str(Path(__file__).parent))
from test_kv_quant import canonical  # noqa: E402  (the canonical kv_bits cold run)

pytestmark = pytest.mark.timeout(CAP)

SYSTEM = "You are a terse assistant. Reply with one short line, always."
LONG = ("Here is a long message about the weather in the mountains, the rivers that run "
        "through the valleys and the small towns")  # 124 characters = tokens
TOKENS = 6


def chat(user, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


#: The requests of every case, in order: a prompt, its exact repeat, two prompts diverging
#: deep inside the user message at the same point, then the next turn of the first.
REQUESTS = [chat(LONG + " near the lake?"), chat(LONG + " near the lake?"),
            chat(LONG[:90] + " and the sea?"), chat(LONG[:90] + " in winter?"), "turn"]
REPEAT, DIVERGED = 1, 3  # indices: the exact repeat; the second divergence at one point


def play(server: Server, **extra):
    """Every request of `REQUESTS` (the turn continues the first conversation with its
    answer); returns (responses, the messages sent)."""
    out, sent = [], []
    for msgs in REQUESTS:
        if msgs == "turn":
            msgs = REQUESTS[0] + [{"role": "assistant", "content": answer(out[0])[0]},
                                  {"role": "user", "content": "And the forests?"}]
        out.append(server.chat(msgs, max_tokens=TOKENS, **extra))
        sent.append(msgs)
    return out, sent


def cached(responses):
    return [answer(r)[2] for r in responses]


def check_reuse(ours, baseline, report):
    """At least the baseline's cached tokens everywhere, some on the repeat, the budget held."""
    mine, theirs = cached(ours), cached(baseline)
    print("cached tokens: baseline", theirs, "ours", mine)
    assert all(o >= s for o, s in zip(mine, theirs)), (theirs, mine)
    n = ours[REPEAT]["usage"]["prompt_tokens"]
    assert mine[REPEAT] == n - 1, mine  # the exact repeat: all but the last token
    assert report["bytes_held"] <= report["max_bytes"] and report["bytes_held"] > 0


def restart_hits(model_dir, tmp_path, cache_dir, first, *extra, name="again"):
    """A server started anew on ``cache_dir`` answers the first request from disk."""
    with Server.ours(model_dir, tmp_path / f"{name}.log", tmp_path, "--cache-dir",
                     str(cache_dir), *extra) as s:
        r = s.chat(REQUESTS[0], max_tokens=TOKENS)
    same_answer(first, r)
    assert answer(r)[2] == r["usage"]["prompt_tokens"] - 1, answer(r)[2]
    return r


def steps_close(r, ref, tol=1e-4):
    """A response's steps against a reference [(token, log-probs)] (top-5 to ``tol``)."""
    steps = answer(r)[1]
    assert len(steps) <= len(ref) and steps
    for (tid, top), (rt, lp) in zip(steps, ref):
        for t, l in top:
            assert abs(l - lp[t].item()) <= tol, (t, l, lp[t].item())
        assert max(l for _, l in top) >= lp[rt].item() - tol  # the greedy token leads


def cold(model, prompt, max_tokens=TOKENS):
    """Greedy log-probs of a cold run on the model's own (mlx-lm) caches."""
    cache = mlc.make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    out, y = [], prompt[-1]
    for _ in range(max_tokens):
        logits = model(mx.array([y])[None], cache=cache)[0, -1]
        lp = logits - mx.logsumexp(logits)
        y = int(mx.argmax(lp).item())
        out.append((y, lp))
    return out


def ids(tokenizer, msgs):
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def divergence(model_dir) -> int:
    """Where the two diverging requests part, in the model's tokens."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(model_dir))
    a, b = ids(tok, REQUESTS[DIVERGED - 1]), ids(tok, REQUESTS[DIVERGED])
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def drafting(log: Path):
    """(drafted, accepted) of each request's draft model, from our log lines (prompt
    lookup's, "lookup drafted ...", are not the draft's)."""
    return [(int(a), int(b)) for a, b in
            re.findall(r"(?<!lookup )drafted (\d+) accepted (\d+)",
                       log.read_text(errors="replace"))]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {k: write_model_dir(root / k, k)
           for k in ("llama", "qwen3_5", "gemma3_text", "llama_hd32", "llama4", "qwen3_next")}
    # noisy copies: drafts that agree with their target on some tokens only
    out["llama_draft"] = write_draft_dir(root / "llama_draft", out["llama"], sigma=0.3)
    out["qwen3_5_draft"] = write_draft_dir(root / "qwen3_5_draft", out["qwen3_5"], sigma=0.3)
    out["gemma3_text_draft"] = write_draft_dir(root / "gemma3_draft", out["gemma3_text"],
                                               sigma=0.05)
    out["hd32_draft"] = write_draft_dir(root / "hd32_draft", out["llama_hd32"], sigma=0.3)
    out["paged"] = write_paged_model_dir(root / "paged")
    return out


# -- speculative decoding ----------------------------------------------------------------------
def test_draft_model_llama_same_as_plain_decoding_and_cached(dirs, tmp_path):
    """Stock's speculative decoding leaves the target's cache one token short of the key its
    prompt cache stores it under, so every reused answer differs from a cold run; ours are
    plain decoding's, and reuse as much."""
    d, dd = dirs["llama"], dirs["llama_draft"]
    with Server.stock(d, tmp_path / "plain.log", tmp_path) as s:
        plain, _ = play(s)
    with Server.stock(d, tmp_path / "stock.log", tmp_path, "--draft-model", str(dd)) as s:
        stock, _ = play(s)
    cache = tmp_path / "cache"
    log = tmp_path / "ours.log"
    # (fixed: these drafts are as large as their targets, which the adaptive policy never
    # drafts with; the rollback rules are what is tested here)
    with Server.ours(d, log, tmp_path, "--cache-dir", str(cache), "--draft-model", str(dd),
                     "--draft-policy", "fixed") as s:
        ours, _ = play(s)
        report = s.cache()
    for a, b in zip(plain, ours):
        same_answer(a, b)
    same_answer(stock[0], ours[0])  # no reuse yet: stock is right
    with pytest.raises(AssertionError):
        for a, b in zip(plain[1:], stock[1:]):
            same_answer(a, b)
    check_reuse(ours, stock, report)
    assert report["layers"] == 4  # both models' layers in every node
    spec = drafting(log)
    assert len(spec) == len(REQUESTS)
    assert 0 < sum(a for _, a in spec) < sum(d for d, _ in spec), spec  # accepts and rejects
    restart_hits(d, tmp_path, cache, ours[0], "--draft-model", str(dd), "--draft-policy", "fixed")
    # the disk cache is keyed on both models: another draft never reads it
    with Server.ours(d, tmp_path / "other.log", tmp_path, "--cache-dir", str(cache),
                     "--draft-model", str(dirs["hd32_draft"]), "--draft-policy", "fixed") as s:
        assert answer(s.chat(REQUESTS[0], max_tokens=TOKENS))[2] == 0
    # The default policy: a draft as large as the target could never pay, so it is not used
    # at all (the log says why): the answers are plain decoding's, the cache holds the
    # target's layers and is keyed as without a draft (a server without one reads it).
    alog, acache = tmp_path / "adaptive.log", tmp_path / "acache"
    with Server.ours(d, alog, tmp_path, "--cache-dir", str(acache), "--draft-model", str(dd)) as s:
        adaptive, _ = play(s)
        areport = s.cache()
    for a, b in zip(plain, adaptive):
        same_answer(a, b)
    check_reuse(adaptive, stock, areport)
    assert areport["layers"] == 2 and drafting(alog) == []
    text = alog.read_text(errors="replace")
    assert f"the draft model {dd} is not used: a step of the draft model costs 1.00 of a step " \
        "of the model" in text and "--draft-policy fixed drafts with it anyway" in text
    restart_hits(d, tmp_path, acache, adaptive[0], name="nodraft")


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3_text"])
def test_draft_model_where_stock_raises_or_is_wrong(kind, dirs, tmp_path):
    """A hybrid target with a hybrid draft: stock refuses ("requires a trimmable prompt
    cache"). A sliding-window model whose window wraps: stock trims rows the window lost and
    answers wrongly. Ours answer as plain decoding does, reusing checkpoints of both models."""
    d, dd = dirs[kind], dirs[kind + "_draft"]
    with Server.stock(d, tmp_path / "plain.log", tmp_path) as s:
        plain, _ = play(s)
    with Server.stock(d, tmp_path / "stock_draft.log", tmp_path, "--draft-model", str(dd)) as s:
        if kind == "qwen3_5":
            with pytest.raises(Exception):
                s.chat(REQUESTS[0], max_tokens=TOKENS)
            assert "trimmable" in (tmp_path / "stock_draft.log").read_text()
        else:
            with pytest.raises(AssertionError):
                same_answer(plain[0], s.chat(REQUESTS[0], max_tokens=TOKENS))
    cache, log = tmp_path / "cache", tmp_path / "ours.log"
    with Server.ours(d, log, tmp_path, "--cache-dir", str(cache), "--draft-model", str(dd),
                     "--draft-policy", "fixed", "--checkpoint-interval", "16") as s:
        ours, _ = play(s)
        report = s.cache()
    for a, b in zip(plain, ours):
        same_answer(a, b)
    check_reuse(ours, plain, report)
    at = divergence(d)  # inside the long message: exact the second time
    assert cached(ours)[DIVERGED] == at and cached(ours)[DIVERGED - 1] >= at - 16, cached(ours)
    assert report["layers"] == {"qwen3_5": 6, "gemma3_text": 8}[kind]
    spec = drafting(log)
    assert 0 < sum(a for _, a in spec) < sum(d for d, _ in spec), spec
    restart_hits(d, tmp_path, cache, ours[0], "--draft-model", str(dd), "--draft-policy", "fixed",
                 "--checkpoint-interval", "16")


# -- quantized KV --------------------------------------------------------------------------------
KV = ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0")


class Singles:
    """Positions a server computed in one-token passes (a prompt's last token, the answer),
    per prefix, the first time: the canonical cold run feeds those one at a time too (the
    float noise between one-token and chunked passes can round to a quantization step)."""

    def __init__(self):
        self.single = {}

    def record(self, prompt, answer_ids):
        seq = list(prompt) + list(answer_ids)
        for p in range(len(seq)):
            self.single.setdefault(tuple(seq[: p + 1]), p >= len(prompt) - 1)

    def of(self, prompt, restored):
        return {p for p in range(restored) if self.single.get(tuple(prompt[: p + 1]))}


def check_canonical(model, tokenizer, responses, sent, start):
    singles = Singles()
    for r, msgs in zip(responses, sent):
        p = ids(tokenizer, msgs)
        ref = canonical(model, p, TOKENS, start, bits=8, group=32,
                        singles=singles.of(p, answer(r)[2]))
        steps_close(r, ref)
        singles.record(p, [t for t, _ in ref][: len(answer(r)[1])])


def test_kv_bits_canonical_answers_and_reuse(dirs, tmp_path):
    """``--kv-bits``: stock switches to quantized rows after a prefill chunk, so its answers
    move with its chunking and reuse; ours switch exactly at ``--quantized-kv-start`` and
    equal the canonical cold run — with a draft model too, and when the switch happens
    during decoding (the prompt's rows are stored unquantized first)."""
    from mlx_lm import load

    d = dirs["llama_hd32"]
    model, tok = load(str(d))
    with Server.stock(d, tmp_path / "stock.log", tmp_path, *KV) as s:
        stock, _ = play(s)
    cache = tmp_path / "cache"
    with Server.ours(d, tmp_path / "ours.log", tmp_path, "--cache-dir", str(cache), *KV) as s:
        ours, sent = play(s)
        report = s.cache()
    assert report["kv_bits"] == [8, 32, 0]
    check_canonical(model, tok, ours, sent, 0)
    check_reuse(ours, stock, report)
    restart_hits(d, tmp_path, cache, ours[0], *KV)
    # with a draft model (both models switch at the start)
    with Server.ours(d, tmp_path / "draft.log", tmp_path, "--no-persist", *KV,
                     "--draft-model", str(dirs["hd32_draft"]), "--draft-policy", "fixed") as s:
        drafted, sent = play(s)
    check_canonical(model, tok, drafted, sent, 0)
    assert cached(drafted)[REPEAT] == drafted[REPEAT]["usage"]["prompt_tokens"] - 1
    # the switch during decoding: a repeat still restores the prompt's unquantized rows
    n = len(ids(tok, REQUESTS[0]))
    late = ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", str(n + 2))
    with Server.ours(d, tmp_path / "late.log", tmp_path, "--no-persist", *late) as s:
        first, again = (s.chat(REQUESTS[0], max_tokens=TOKENS) for _ in range(2))
    check_canonical(model, tok, [first, again], [REQUESTS[0]] * 2, n + 2)
    assert cached([first, again]) == [0, n - 1]


# -- cache classes stock cannot reuse correctly, or at all ---------------------------------------
def test_llama4_chunked_attention_reused_exactly(dirs, tmp_path):
    """Stock reuses llama4's chunked caches by trimming them, and its answers then differ
    from a cold run; ours equal the cold run and reuse at least as much."""
    from mlx_lm import load

    d = dirs["llama4"]
    model, tok = load(str(d))
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        stock, _ = play(s)
    cache = tmp_path / "cache"
    with Server.ours(d, tmp_path / "ours.log", tmp_path, "--cache-dir", str(cache)) as s:
        ours, sent = play(s)
        report = s.cache()
    for r, msgs in zip(ours, sent):
        steps_close(r, cold(model, ids(tok, msgs)))
    with pytest.raises(AssertionError):  # stock's trimmed chunked caches: not the cold run
        for r, msgs in zip(stock, sent):
            steps_close(r, cold(model, ids(tok, msgs)))
    check_reuse(ours, stock, report)
    restart_hits(d, tmp_path, cache, ours[0])


def test_a_cache_class_nobody_knows_is_reused_at_checkpoints(dirs, tmp_path):
    """A model (mlx-lm's ``model_file`` mechanism) whose layers use a cache class neither
    mlx-lm nor this package knows: stock reuses exact and shorter prefixes only (none here);
    ours snapshots its state whole at checkpoints."""
    d = dirs["paged"]
    with Server.stock(d, tmp_path / "stock.log", tmp_path, "--trust-remote-code") as s:
        stock, _ = play(s)
    cache, log = tmp_path / "cache", tmp_path / "ours.log"
    with Server.ours(d, log, tmp_path, "--cache-dir", str(cache), "--trust-remote-code",
                     "--checkpoint-interval", "16") as s:
        ours, _ = play(s)
        report = s.cache()
    for a, b in zip(stock, ours):
        same_answer(a, b)
    check_reuse(ours, stock, report)
    assert cached(ours)[DIVERGED] == divergence(d), cached(ours)
    assert log.read_text().count("PagedKVCache is a cache class this package does not know") == 1
    restart_hits(d, tmp_path, cache, ours[0], "--trust-remote-code", "--checkpoint-interval", "16")


# -- seeded requests on a hybrid, and the miss explanations --------------------------------------
def test_seeded_hybrid_requests_checkpoint_and_misses_are_explained(dirs, tmp_path):
    d = dirs["qwen3_next"]
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        stock, _ = play(s, seed=0)
    cache, log = tmp_path / "cache", tmp_path / "ours.log"
    with Server.ours(d, log, tmp_path, "--cache-dir", str(cache),
                     "--checkpoint-interval", "16") as s:
        ours, _ = play(s, seed=0)
        # mlx-lm inserts (and we list) the last request just after its answer's end
        report = s.watch.wait("every request's entry in GET /v1/cache").until(
            lambda: (lambda r: r if len(r["recent"]) >= len(REQUESTS) else None)(s.cache()))
        for a, b in zip(stock, ours):
            same_answer(a, b)
        check_reuse(ours, stock, report)
        # the second divergence inside the message restores exactly (a branch point); the
        # first lands within one interval of it
        at = divergence(d)
        assert cached(ours)[DIVERGED] == at
        assert cached(ours)[DIVERGED - 1] >= at - 16 > cached(stock)[DIVERGED - 1]
        recent = report["recent"]
        assert [e["path"] for e in recent[-len(REQUESTS):]] == ["sequential"] * len(REQUESTS)
        assert recent[-len(REQUESTS) + REPEAT]["reuse"]["kind"] == "hit"
        # A client that rewrites a line at the top of its system prompt every turn.
        for tag in ("1a2b3c", "9f8e7d"):
            sent = time.time()
            s.chat(chat(LONG, system=f"Session {tag}.\n" + SYSTEM), max_tokens=2, seed=0)
        last = s.entry_since(sent)
    reuse = last["reuse"]
    at = 1 + len("Session ")  # <|system|> is one token
    assert reuse["kind"] == "diverged" and reuse["diverged_at"] == at, reuse
    assert reuse["before"].endswith("Session ") and reuse["cached"].startswith("1a2b3c")
    assert reuse["prompt"].startswith("9f8e7d") and last["cached_tokens"] <= at
    assert "recurrent layers restore only at checkpoints" in reuse["rule"]
    text = log.read_text()
    assert f'diverged at {at}: cached "…{reuse["before"]}|1a2b3c' in text
    restart_hits(d, tmp_path, cache, ours[0], "--checkpoint-interval", "16")


def test_the_seam_swaps_stream_generate_only_while_serving():
    from mlx_lm import server as S

    from mlx_kvcache.serving import seam

    before = S.stream_generate
    with seam.patched(lambda parser: None, lambda *a, **k: None, ["mlx-kvcache serve"]):
        assert S.stream_generate is not before and S.stream_generate.__wrapped__ is before
    assert S.stream_generate is before
