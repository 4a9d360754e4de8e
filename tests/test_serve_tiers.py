"""The disk tier behind `mlx-kvcache serve` (issue 16), against stock `mlx_lm.server`.

A server whose memory budget holds two and a half sessions and whose disk budget holds all:
four sessions round robin, so every later turn is served from disk, with stock's answers
(top log-probs to 1e-4); both budgets hold after every request; a restart keeps the disk
tier; snapshot files damaged while their nodes are on disk only are recomputed, never
served."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server, answer, same_answer
from mlx_kvcache.testing.waits import CAP

pytestmark = pytest.mark.timeout(CAP)

WORDS = "river stone cloud metric vector buffer kernel socket render commit branch".split()
SESSIONS, TURNS = 4, 4


def session(i):
    """A private system prompt and a long first message: a turn adds ~10% at most."""
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(130)]
    return [{"role": "system", "content": f"Session {i}. Reply tersely."},
            {"role": "user", "content": " ".join(words)}]


def play_round(server, histories, answers, turn):
    """One turn of every session, in order; returns the responses."""
    out = []
    for i, h in enumerate(histories):
        if turn:
            h += [{"role": "assistant", "content": answer(answers[turn - 1][i])[0]},
                  {"role": "user", "content": f"Go on, part {turn}."}]
        out.append(server.chat(h, max_tokens=6))
    return out


def per_token_bytes(d: Path) -> int:
    from mlx_lm.utils import load_model

    from mlx_kvcache.caches import make_prompt_cache
    from mlx_kvcache.generation.sizing import checkpoint_bytes

    model, _ = load_model(d)
    return checkpoint_bytes(model, lambda: make_prompt_cache(model), 1)


def test_sessions_round_robin_from_disk_like_stock(tmp_path):
    d = write_model_dir(tmp_path / "llama", "llama")
    stock_hist = [session(i) for i in range(SESSIONS)]
    stock = []
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        for t in range(TURNS):
            stock.append(play_round(s, stock_hist, stock, t))
    longest = max(r["usage"]["prompt_tokens"] for r in stock[-1]) + 6
    shortest = min(r["usage"]["prompt_tokens"] for r in stock[0])
    budget = int(2.5 * longest * per_token_bytes(d))
    assert 3 * shortest * per_token_bytes(d) > budget  # three sessions never fit
    disk = 64 << 20
    cache = tmp_path / "cache"
    args = ["--cache-dir", str(cache), "--prompt-cache-bytes", str(budget),
            "--max-disk-bytes", str(disk)]
    hist = [session(i) for i in range(SESSIONS)]
    ours, disk_tokens = [], []

    def served(s, t):
        got = []
        for i in range(SESSIONS):
            before = s.cache()["disk_tokens"]
            if t:
                hist[i] += [{"role": "assistant", "content": answer(ours[t - 1][i])[0]},
                            {"role": "user", "content": f"Go on, part {t}."}]
            r = s.chat(hist[i], max_tokens=6)
            # (the report once this request's writes are done: its disk figures count them)
            rep = s.settled()
            same_answer(stock[t][i], r)
            assert rep["bytes_held"] <= rep["max_bytes"] == budget, rep
            assert rep["disk_bytes"] <= rep["max_disk_bytes"] == disk, rep
            assert rep["ram_tokens"] + rep["disk_tokens"] == rep["cached_tokens"]
            disk_tokens.append(rep["disk_tokens"] - before)
            got.append(r)
        ours.append(got)

    s = Server.ours(d, tmp_path / "a.log", tmp_path, *args)
    try:
        for t in range(2):
            served(s, t)
        # Every later turn: its session was parked (three others since), read back.
        assert all(x > 0 for x in disk_tokens[SESSIONS:]), disk_tokens
        assert all(answer(r)[2] >= answer(q)[2] for r, q in zip(ours[1], stock[1]))
        assert s.stop(signal.SIGTERM) == 0, s.tail()
    finally:
        s.stop()
    with Server.ours(d, tmp_path / "b.log", tmp_path, *args) as s:
        # The HTTP side answers while the generation thread may still be opening the cache.
        s.watch.wait("the cache to open").until(lambda: "disk_nodes" in s.cache())
        rep = s.cache()
        assert rep["bytes_held"] == 0 and rep["disk_nodes"] == rep["nodes"] > 0, rep
        served(s, 2)  # a restart keeps the tier: every session continues from disk
        assert all(x > 0 for x in disk_tokens[2 * SESSIONS:]), disk_tokens
        # Damage every snapshot file: nodes in memory never read theirs again; parked
        # ones are checked when read, found bad, and recomputed.
        (mdir,) = [p for p in (cache / "v3").iterdir() if p.is_dir()]
        for f in mdir.glob("*.safetensors"):
            raw = bytearray(f.read_bytes())
            raw[-9] ^= 0x40
            f.write_bytes(bytes(raw))
        served(s, 3)
        print("disk tokens per request", disk_tokens)
        assert "checksum mismatch" in s.tail(200_000)
        assert sum(disk_tokens[3 * SESSIONS:]) < sum(disk_tokens[2 * SESSIONS:3 * SESSIONS])
