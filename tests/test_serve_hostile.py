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
    """The same with --allow-model-switch (and a short --header-timeout)."""
    with Server.ours(dirs["a"], dirs["root"] / "switch.log", dirs["root"] / "home2",
                     "--no-persist", "--trust-remote-code", "--allow-model-switch",
                     "--header-timeout", "2") as s:
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
    # A DELETE while B is loaded clears A's kept cache too.
    assert s.request("DELETE", "/v1/cache")[0] == 200
    sent = time.time()
    _messages(s, LONG)
    assert s.entry_since(sent)["cached_tokens"] == 0


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
    # The start log says who shares the cache (here: loopback, namespaces per request).
    assert b"cache namespaces (--cache-namespace-by request): all clients share one cache" in log


def test_the_start_log_says_who_shares_the_cache():
    from mlx_kvcache.serving.routes.namespace import sharing_note

    assert "other machines" in sharing_note("request", beyond_loopback=True)
    assert "other machines" not in sharing_note("request", beyond_loopback=False)
    assert "each API key has a cache namespace of its own" in sharing_note("api-key", True)


# -- 2. slow and idle clients -------------------------------------------------------------------
IDLE = 2100  # more than mlx-lm's 2,048 descriptors


def _read_replies(socks, got):
    """Add to ``got`` (socket index -> bytes) what each socket has received, read without
    blocking; the indexes of those the server has closed (their reply whole)."""
    for i, c in enumerate(socks):
        if got.get(i, b"").endswith(b"<closed>"):
            continue
        try:
            data = c.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        got[i] = got.get(i, b"") + (data or b"<closed>")
    return [i for i, r in got.items() if r.endswith(b"<closed>")]


def _trickled_until_answered(s, sock, what):
    """Send one byte at a time until the server answers ``sock`` (bounded by the
    server's progress); the answer."""
    def answered():
        try:
            return sock.recv(4096, socket.MSG_DONTWAIT) or b"closed"
        except BlockingIOError:
            try:
                sock.send(b"x")  # still trickling: faster than any timeout per read
            except OSError:
                return b"closed"
            return None
    return s.watch.wait(what).until(answered, poll=0.2)


def test_a_trickled_request_head_gets_408_at_its_deadline(switching):
    sock = socket.create_connection(("127.0.0.1", switching.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: ")
        reply = _trickled_until_answered(switching, sock, "the trickled head's 408")
        assert reply.startswith(b"HTTP/1.0 408") and b"--header-timeout" in reply, reply
    finally:
        sock.close()


def test_idle_and_slow_connections_leave_loopback_clients_served(dirs):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 256:
        pytest.skip(f"this test opens {IDLE} connections: the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    with Server.ours(dirs["a"], dirs["root"] / "idle.log", dirs["root"] / "home3", "--no-persist",
                     "--body-timeout", "2") as s:
        try:
            # A body trickled a byte at a time: held no longer than its deadline although
            # bytes keep coming (a timeout per read never fires).
            body = socket.create_connection(("127.0.0.1", s.port))
            body.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            reply = _trickled_until_answered(s, body, "the trickled body's 408")
            assert reply.startswith(b"HTTP/1.0 408") and b"--body-timeout" in reply, reply
            body.close()
            for _ in range(IDLE):  # half a request line each, then nothing
                c = socket.create_connection(("127.0.0.1", s.port))
                c.sendall(b"POST /v1/chat/compl")
                socks.append(c)
                if len(socks) % 100 == 0:
                    s.watch.wait("opening idle connections").tick()
            # An SDK client on loopback is served while they are all open.
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="k",
                                   max_retries=0)
            answer = []
            sdk = threading.Thread(target=lambda: answer.append(client.chat.completions.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": "Hello"}])),
                daemon=True)
            sdk.start()
            s.watch.wait("the SDK client's answer").until(lambda: not sdk.is_alive())
            assert answer and answer[0].choices[0].message.content is not None
            # The oldest idle ones made room (a 503 each, then closed): never more open than
            # the cap (1,024 here), and no descriptor ran out.
            got = {}
            closed = s.watch.wait("the evicted connections' 503s").until(
                lambda: (lambda done: done if len(done) >= IDLE - 1024 else None)(
                    _read_replies(socks, got)), poll=0.2)
            assert all(got[i].startswith(b"HTTP/1.0 503") for i in closed), \
                {got[i][:20] for i in closed}
            assert s.request("GET", "/health")[0] == 200
            log = s.tail(400000)
            assert "connections: at most 1024 open" in log
            assert "Too many open files" not in log
        finally:
            for c in socks:
                c.close()


# -- 3. what parsing a body may take ----------------------------------------------------------
def _junk_body(mib: float) -> bytes:
    """A valid /v1/messages body whose ignored field holds ``mib`` MiB of empty objects."""
    n = int(mib * (1 << 20)) // 3
    head = json.dumps({"model": "m", "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hi"}]})[:-1]
    return head.encode() + b', "junk": [' + b",".join([b"{}"] * n) + b"]}"


def test_bodies_of_small_values_stay_within_the_body_budget(dirs):
    budget = 512 << 20
    with Server.ours(dirs["a"], dirs["root"] / "parse.log", dirs["root"] / "home4",
                     "--no-persist", "--body-budget", "512M") as s:
        pid = s.proc.pid
        big = _junk_body(60)
        before = peak_rss_kib(pid, reset=True)
        status, out = s.request("POST", "/v1/messages", raw=big)
        assert status == 413 and "--body-budget" in out["error"]["message"], (status, out)
        grown = (peak_rss_kib(pid) - before) << 10
        # the body's bytes, never its parse (it was 1.5 GB parsed)
        assert grown < len(big) + (48 << 20), grown
        # Six bodies whose parse takes ~100 MB each: admitted two at a time.
        body = _junk_body(4)
        before = peak_rss_kib(pid, reset=True)
        results = []

        def send():
            results.append(s.request("POST", "/v1/messages", raw=body))
        threads = [threading.Thread(target=send, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        s.watch.wait("six parses").until(lambda: not any(t.is_alive() for t in threads))
        assert [st for st, _ in results] == [200] * 6, results
        grown = (peak_rss_kib(pid) - before) << 10
        assert grown < budget + (64 << 20), grown  # six at once: over 600 MB
