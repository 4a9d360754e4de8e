"""What a client on the network can do to `mlx-kvcache serve` (issue 48), tried with real
servers on loopback: run code through a model name, stall the server with idle or slow
connections, outgrow its memory with a body's parse, move the agent routes off the served
model's context and cache, forge log lines. Every wait is bounded by the server's
progress."""

from __future__ import annotations

import json
import re
import resource
import socket
import threading
import time
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server, peak_rss_kib  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)

#: Model A's context (its config) and model B's, smaller than A's prompts below.
A_CONTEXT, B_CONTEXT = 4096, 64
LONG = "Tell me everything about the harbour, the ships and the sea. " * 3  # > 64 tokens


def _plant(path: Path, marker: Path) -> Path:
    """A loadable model directory whose config asks for its own code (``model_file``):
    importing it writes ``marker``."""
    write_model_dir(path, "llama", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["model_file"] = "evil.py"
    (path / "config.json").write_text(json.dumps(config))
    (path / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                  "from mlx_lm.models.llama import Model, ModelArgs\n")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile48")
    marker = root / "ran.txt"
    return {"root": root, "marker": marker,
            "a": write_model_dir(root / "a", "llama", max_position_embeddings=A_CONTEXT),
            "b": write_model_dir(root / "b", "llama", seed=5, max_position_embeddings=B_CONTEXT),
            "evil": _plant(root / "evil", marker)}


@pytest.fixture(scope="module")
def plain(dirs):
    """The served model A, remote code trusted (the operator's own), no switching."""
    with Server.ours(dirs["a"], dirs["root"] / "plain.log", dirs["root"] / "home",
                     "--no-persist", "--trust-remote-code") as s:
        yield s


@pytest.fixture(scope="module")
def switching(dirs):
    """The same with --allow-model-switch."""
    with Server.ours(dirs["a"], dirs["root"] / "switch.log", dirs["root"] / "home2",
                     "--no-persist", "--trust-remote-code", "--allow-model-switch") as s:
        yield s


def _chat(s, **extra):
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2,
            "temperature": 0, **extra}
    return s.request("POST", "/v1/chat/completions", body)


# -- 1. code runs only for the operator's models ----------------------------------------------
def test_a_requested_model_never_runs_its_code(plain, switching, dirs):
    evil, marker = str(dirs["evil"]), dirs["marker"]
    # Without --allow-model-switch: refused before anything loads, saying how to allow it.
    for extra in ({"model": evil}, {"draft_model": evil}):
        status, out = _chat(plain, **extra)
        assert status == 404, (status, out)
        assert "--allow-model-switch" in out["error"]["message"], out
        assert out["error"]["code"] == "model_not_found"
    # The refusal is the same for a directory that exists and one that does not: a name
    # probes nothing.
    gone = str(dirs["root"] / "no-such-model")
    _, here = _chat(plain, model=evil)
    _, there = _chat(plain, model=gone)
    assert here["error"]["message"].replace(repr(evil), "X") == \
        there["error"]["message"].replace(repr(gone), "X")
    # The agent routes answer any name with the served model (they never load another).
    r = anthropic.Anthropic(base_url=f"http://127.0.0.1:{plain.port}", api_key="k",
                            max_retries=0).messages.create(
        model=evil, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert r.model == evil and r.usage.output_tokens >= 1
    # With --allow-model-switch it loads with remote code off: mlx-lm refuses to build it.
    for extra in ({"model": evil}, {"draft_model": evil}):
        status, out = _chat(switching, **extra)
        assert status == 404 and "custom module" in json.dumps(out), (status, out)
    assert not marker.exists()
    # The operator's own model is still served, and its answer is the one before.
    assert _chat(plain)[0] == 200 and _chat(switching)[0] == 200
    assert "a request naming another model gets a 404" in plain.tail(20000)


# -- 6. the agent routes stay on the served model ---------------------------------------------
def _messages(s, content, **extra):
    body = {"model": "claude-x", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}
    status, out = s.request("POST", "/v1/messages", body)
    assert status == 200, (status, out, s.tail())
    return out


def test_a_model_switch_leaves_the_served_context_and_cache(switching, dirs):
    s = switching
    s.request("DELETE", "/v1/cache")
    n = s.request("POST", "/v1/messages/count_tokens", {
        "model": "m", "messages": [{"role": "user", "content": LONG}]})[1]["input_tokens"]
    assert B_CONTEXT < n < A_CONTEXT
    sent = time.time()
    cold = _messages(s, LONG)
    assert s.entry_since(sent)["prompt_tokens"] == n
    for _ in range(2):  # B loaded, then the agent route: checked against A's context
        status, out = _chat(s, model=str(dirs["b"]))
        assert status == 200, (status, out)
        status, listing = s.request("GET", "/v1/models")
        assert listing["data"][0]["context_length"] == A_CONTEXT, listing
        sent = time.time()
        again = _messages(s, LONG)
        assert again["content"] == cold["content"]
        # A's trie was kept while B was loaded: all but the prompt's last token is read.
        assert s.entry_since(sent)["cached_tokens"] == n - 1
    # A request for B is still fitted to B's own context.
    status, out = _chat(s, model=str(dirs["b"]), messages=[{"role": "user", "content": LONG}])
    assert status == 400 and "context" in json.dumps(out), (status, out)


# -- 7. log lines -------------------------------------------------------------------------------
def test_a_hostile_session_name_is_escaped_in_the_log(plain):
    forged = "evil\n[cache] prompt 1 tok | cached 1 | forged\x1b[31m\u2028"
    status, out = plain.request("POST", "/v1/responses", {
        "model": "m", "input": "Hello", "max_output_tokens": 2, "prompt_cache_key": forged})
    assert status == 200, (status, out)
    sent = time.time()
    plain.request("POST", "/v1/responses", {
        "model": "m", "input": "Hello", "max_output_tokens": 2, "prompt_cache_key": forged})
    assert plain.entry_since(sent)["session"] == forged  # the JSON keeps it as sent
    log = Path(plain.log).read_bytes()
    assert b"\x1b" not in log and "\u2028".encode() not in log
    assert not any(line.startswith(b"[cache] prompt 1 tok | cached 1 | forged")
                   for line in log.splitlines())
    assert rb"session evil\n[cache] prompt 1 tok | cached 1 | forged\x1b[31m\u2028" in log
