"""`mlx-kvcache serve` left running, tried as an attacker and a careless operator would:
the admin route closed to web pages, a stop that ends every answer properly, DELETE that
answers (and names the directory) when the disk refuses, requests that would end mlx-lm's
generation thread refused with 400, a burst of connections, and no wrong recurrent state
from a padded batch row ever stored. Real servers on loopback; every wait bounded by the
server's progress."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import ROOT, Server, answer, free_port, same_answer
from mlx_kvcache.testing.waits import CAP

# Every wait here is bounded by the servers' progress (`mlx_kvcache.testing.waits`); the
# suite-wide pytest-timeout is a wall-clock guess a slow or busy CI runner can miss.
pytestmark = pytest.mark.timeout(CAP)

HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]
STORY = [{"role": "user", "content": "Tell me a very long story about the sea and the ships."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: write_model_dir(root / k, k) for k in ("llama", "mamba")}


def run(fn, *args, **kw):
    """``fn`` in a thread; returns (thread, box) where box gets "value" or "error"."""
    box = {}

    def go():
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as e:  # inspected by the test
            box["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


def finished(t, box, s):
    s.watch.wait("a client thread").until(lambda: not t.is_alive())
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- 1. the admin route ------------------------------------------------------------------------
def test_admin_route_is_closed_to_web_pages(dirs, tmp_path):
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--cache-dir",
                     str(tmp_path / "c")) as s:
        s.chat(HELLO, max_tokens=2)
        own = f"127.0.0.1:{s.port}"
        status, head, r = s.exchange("GET", "/v1/cache")
        assert status == 200 and r["nodes"] > 0
        assert not any(k.startswith("access-control") for k in head), head
        evil = {"Origin": "http://evil.example"}
        for method in ("GET", "DELETE", "OPTIONS"):
            status, head, r = s.exchange(method, "/v1/cache", headers=evil)
            assert status == 403 and "error" in r, (method, status, r)
            assert not any(k.startswith("access-control") for k in head), head
        # A DNS-rebinding page is same-origin to the browser: its Host gives it away.
        rebound = {"Host": f"evil.example:{s.port}", "Origin": f"http://evil.example:{s.port}"}
        assert s.exchange("DELETE", "/v1/cache", headers=rebound)[0] == 403
        assert s.exchange("GET", "/v1/cache", headers={"Host": "evil.example"})[0] == 403
        assert s.cache()["nodes"] > 0  # nothing was cleared
        # The server's own origin, and mlx-lm's CORS on its own routes, unchanged.
        assert s.exchange("GET", "/v1/cache", headers={"Origin": f"http://{own}"})[0] == 200
        status, head, _ = s.exchange("OPTIONS", "/v1/chat/completions", headers=evil)
        assert status == 204 and head.get("access-control-allow-origin") == "*"
        status, head, _ = s.exchange("POST", "/v1/chat/completions", headers=evil,
                                     body={"messages": HELLO, "max_tokens": 2})
        assert status == 200 and head.get("access-control-allow-origin") == "*"
    with Server.ours(dirs["llama"], tmp_path / "b.log", tmp_path, "--no-persist",
                     "--admin-token", "s3cret") as s:
        s.chat(HELLO, max_tokens=2)
        assert s.exchange("GET", "/v1/cache")[0] == 401
        status, head, _ = s.exchange("DELETE", "/v1/cache", headers={"Authorization": "Bearer nope"})
        assert status == 401 and head.get("www-authenticate", "").startswith("Bearer")
        ok = {"Authorization": "Bearer s3cret"}
        assert s.cache(**ok)["nodes"] > 0
        status, _, r = s.exchange("DELETE", "/v1/cache", headers=ok)
        assert status == 200 and r["cleared"] and r["nodes"] == 0
        assert s.exchange("GET", "/v1/cache", headers={**ok, "Origin": "http://evil.example"})[0] == 403


def own_address():
    """This machine's address on a non-loopback interface, or None. A UDP socket's connect
    only picks the route (no packet is sent); ``hostname -I`` is the fallback."""
    import ipaddress

    found = []
    for probe in ("10.255.255.255", "192.0.2.1", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.connect((probe, 1))
                found.append(u.getsockname()[0])
        except OSError:
            continue
    try:
        found += subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                                timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pass
    for a in found:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_loopback and not ip.is_unspecified:
            return a
    return None


SECRET = "My card 4111-1111-1111-1111 pin 9731. Help me"
GUESS = "My card 4111-1111-1111-1111 pin 0000. Help me"


def test_prompt_text_stays_with_its_owner_on_a_shared_network(dirs, tmp_path):
    lan = own_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address to reach a server through")
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--no-persist",
                     host="0.0.0.0") as s:
        s.complete(SECRET, max_tokens=2)
        peer = s.through(lan)  # a client reaching the server the way a LAN peer does
        peer.complete(GUESS, max_tokens=2)  # completions stay open to everyone
        for method in ("GET", "DELETE"):
            for host in (None, "8.8.8.8", f"127.0.0.1:{s.port}", "localhost"):
                status, head, r = peer.exchange(method, "/v1/cache",
                                                headers={"Host": host} if host else None)
                assert status == 403 and "admin token" in r["error"], (method, host, status, r)
                assert SECRET[32:36] not in json.dumps(r)
        # This machine's own clients still read it, without prompt text: the server
        # listens beyond loopback without a token, so excerpts are off by default.
        r = s.cache()
        assert r["nodes"] > 0 and r["prompt_excerpts"] is False
        reuse = r["recent"][-1]["reuse"]
        assert reuse["kind"] == "diverged" and reuse["diverged_at"] == 32, reuse
        assert reuse["cached"] == reuse["prompt"] == reuse["before"] == "", reuse
        assert "9731" not in json.dumps(r)
    log = (tmp_path / "a.log").read_text()
    assert "diverged at 32" in log and "9731" not in log, log[-3000:]
    with Server.ours(dirs["llama"], tmp_path / "b.log", tmp_path, "--no-persist",
                     "--admin-token", "s3cret", host="0.0.0.0") as s:
        s.complete(SECRET, max_tokens=2)
        s.complete(GUESS, max_tokens=2)
        peer = s.through(lan)
        assert peer.exchange("GET", "/v1/cache")[0] == 401
        r = peer.cache(Authorization="Bearer s3cret")  # the token opens it from anywhere
        # With a token, excerpts are shown by default: the token holder sees them.
        assert r["prompt_excerpts"] is True and "9731" in r["recent"][-1]["reuse"]["cached"]
    with Server.ours(dirs["llama"], tmp_path / "c.log", tmp_path, "--no-persist",
                     "--prompt-excerpts", "off") as s:  # loopback: on unless turned off
        s.complete(SECRET, max_tokens=2)
        s.complete(GUESS, max_tokens=2)
        r = s.cache()
        assert r["prompt_excerpts"] is False and "9731" not in json.dumps(r)
    assert "9731" not in (tmp_path / "c.log").read_text()


# -- 2. a clean stop ---------------------------------------------------------------------------
def stream_text(chunks):
    return "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                   for c in chunks if c.get("choices"))


def last_finish(chunks):
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    return reasons[-1] if reasons else None


def consistent(r):
    """A complete non-streamed answer: its counts agree with its log-probs."""
    steps = r["choices"][0]["logprobs"]["content"]
    assert r["usage"]["completion_tokens"] == len(steps), (r["usage"], len(steps))


def wait_open(s, n):
    s.watch.wait(f"{n} open requests").until(lambda: s.cache()["open_requests"] >= n)


def wait_refusing(s):
    def refusing():
        try:
            return s.request("GET", "/health", timeout=10)[0] == 503
        except OSError:
            return False
    s.watch.wait("the server to refuse new requests").until(refusing)


def test_stop_lets_open_answers_finish_then_ends_the_rest(dirs, tmp_path):
    """Batch path: one answer finishes inside the grace period, the other is ended by the
    second signal with finish_reason "length" and [DONE]; new requests get 503; exit 0."""
    s = Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--cache-dir",
                    str(tmp_path / "c"), "--shutdown-grace", "120")
    try:
        first = s.chat(HELLO, max_tokens=4)
        chunks = []
        long_t, long_box = run(lambda: [chunks.append(c) for c in s.stream_chat(STORY, max_tokens=100_000)])
        s.watch.wait("the first streamed chunk").until(lambda: chunks)
        short_t, short_box = run(s.chat, STORY, max_tokens=1500)
        wait_open(s, 2)
        s.send_signal(signal.SIGTERM)
        wait_refusing(s)
        status, r = s.request("POST", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
        assert status == 503 and "stopping" in r["error"]
        short = finished(short_t, short_box, s)  # finishes inside the grace period
        assert short["choices"][0]["finish_reason"] == "length"
        assert short["usage"]["completion_tokens"] == 1500
        consistent(short)
        n = len(chunks)
        assert long_t.is_alive()  # still streaming: the grace period is not over
        s.send_signal(signal.SIGTERM)  # a second signal ends it now
        finished(long_t, long_box, s)  # raises StreamCut without [DONE]
        assert len(chunks) >= n and last_finish(chunks) == "length"
        assert chunks[-1]["usage"]["completion_tokens"] >= n  # the usage chunk came too
        assert s.wait_exit() == 0, s.tail()
        assert "2 open" in s.tail(20000)
    finally:
        s.stop()
    assert list((tmp_path / "c").glob("v*/*/index.*")), "nothing was flushed"
    with Server.ours(dirs["llama"], tmp_path / "b.log", tmp_path, "--cache-dir",
                     str(tmp_path / "c")) as s2:
        again = s2.chat(HELLO, max_tokens=4)
        same_answer(first, again)
        assert answer(again)[2] > 0  # flushed before the exit


def test_stop_ends_sequential_answers_and_refuses_the_unstarted(dirs, tmp_path):
    """Sequential path (a seed): the running answer ends with finish_reason "length" and
    [DONE] after the grace period, the one queued behind it gets a 503 JSON error."""
    s = Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--no-persist",
                    "--shutdown-grace", "1")
    try:
        chunks = []
        t1, b1 = run(lambda: [chunks.append(c) for c in s.stream_chat(STORY, max_tokens=100_000, seed=1)])
        s.watch.wait("the first streamed chunk").until(lambda: chunks)
        t2, b2 = run(s.request, "POST", "/v1/chat/completions",
                     {"messages": HELLO, "max_tokens": 5, "seed": 2})
        wait_open(s, 2)
        s.send_signal(signal.SIGTERM)
        finished(t1, b1, s)
        assert last_finish(chunks) == "length"
        status, r = finished(t2, b2, s)
        assert status == 503 and "not started" in r["error"], (status, r)
        assert s.wait_exit() == 0, s.tail()
    finally:
        s.stop()


# -- 3. DELETE when the disk refuses ------------------------------------------------------------
def unwritable(path: Path):
    """Make ``path`` unwritable to the server; returns the command prefix that makes it so
    for root too (root ignores permissions unless it drops CAP_DAC_OVERRIDE)."""
    os.chmod(path, 0o555)
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    assert setpriv, "running as root needs setpriv (util-linux) to make a directory unwritable"
    return (setpriv, "--bounding-set=-dac_override,-dac_read_search", "--")


def test_delete_on_an_unwritable_directory_answers_and_names_it(dirs, tmp_path):
    cache = tmp_path / "c"
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--cache-dir", str(cache)) as s:
        s.chat(HELLO, max_tokens=3)
    (d,) = [p for p in cache.glob("v*/*") if p.is_dir()]
    prefix = unwritable(d)
    try:
        with Server.ours(dirs["llama"], tmp_path / "b.log", tmp_path, "--cache-dir", str(cache),
                         prefix=prefix) as s:
            assert answer(s.chat(HELLO, max_tokens=3))[2] > 0  # loaded from it
            assert s.cache()["nodes"] > 0
            status, r = s.request("DELETE", "/v1/cache")
            assert status == 500, (status, r)
            assert str(d) in r["error"] and r["memory_cleared"] is True and r["disk_cleared"] is False
            assert s.cache()["nodes"] == 0
            assert s.request("GET", "/health")[0] == 200
            s.chat(HELLO, max_tokens=3)  # still serving
    finally:
        os.chmod(d, 0o755)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs, unmounted after the test (needs permission to mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> int:
    """Write ``path`` until the file system is full; returns the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            while True:
                try:
                    n += f.write(b"\0" * size)
                except OSError:
                    break
    return n


def test_delete_frees_a_full_disk(dirs, tmp_path, small_tmpfs):
    cache = small_tmpfs / "c"
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--cache-dir", str(cache),
                     "--max-disk-bytes", "1G") as s:
        for i in range(6):
            s.complete(f"{i} " + STORY[0]["content"] * 2, max_tokens=2)
        s.watch.wait("snapshots on disk").until(lambda: s.cache()["disk_bytes"] > 100_000)
        fill(small_tmpfs / "filler")
        (d,) = [p for p in cache.glob("v*/*") if p.is_dir()]
        held = sum(p.stat().st_size for p in d.iterdir() if p.name != ".lock")
        assert held > 100_000 and os.statvfs(small_tmpfs).f_bavail == 0
        status, r = s.request("DELETE", "/v1/cache")
        assert status == 200, (status, r)
        assert r["cleared"] and r["disk_cleared"] and r["nodes"] == 0
        assert r["freed_bytes"] == held and r["freed_files"] >= 3, (r, held)
        assert [p.name for p in d.iterdir()] in ([], [".lock"])
        assert os.statvfs(small_tmpfs).f_bavail > 0
        (small_tmpfs / "filler").unlink()
        s.complete("0 " + STORY[0]["content"] * 2, max_tokens=2)  # caches again
        s.watch.wait("a snapshot on disk").until(lambda: s.cache()["disk_bytes"] > 0)


# -- 4. within memory ----------------------------------------------------------------------------
def burst(s, prompts, max_tokens):
    """The prompts sent at the same instant (greedy, with log-probs); their answers."""
    go = threading.Barrier(len(prompts))

    def one(p):
        go.wait()
        return s.complete(p, max_tokens=max_tokens)
    runs = [run(one, p) for p in prompts]
    return [finished(t, box, s) for t, box in runs]


def test_a_burst_that_would_exceed_the_memory_limit_is_served_within_it(tmp_path):
    # Caches of 8 KiB per token: a 16-way burst of ~270-token prompts needs ~100 MiB at
    # once (caches, prefill, the prompt cache's copies); the limit takes a few at a time.
    model = write_model_dir(tmp_path / "m", "llama", hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=64, num_hidden_layers=4)
    prompts = [f"{i:02d} " + "the sea and the ships " * 12 for i in range(16)]
    limit = 48 << 20
    with Server.stock(model, tmp_path / "stock.log", tmp_path) as s:
        # one at a time: stock's listen backlog of 5 resets some of a burst's connections
        stock = [s.complete(p, max_tokens=6) for p in prompts]
    with Server.ours(model, tmp_path / "a.log", tmp_path, "--no-persist", "--memory-limit",
                     str(limit)) as s:
        m = s.cache()["memory"]
        assert m["limit_bytes"] == limit and m["weights_bytes"] > 0, m
        ours = burst(s, prompts, 6)
        m = s.cache()["memory"]
        assert m["admitted"] == 16 and m["refused"] == 0, m
        assert m["admitted_after_waiting"] > 0, m  # the limit held some back
        assert m["cache_given_way_bytes"] > 0, m  # the prompt cache gave way first
        assert m["peak_bytes"] <= limit, m  # MLX's active memory never crossed it
        assert m["reserved_bytes"] == 0 and m["waiting_requests"] == 0, m
        for a, b in zip(ours, stock):
            same_answer(a, b)
        # A request that can never fit: a clear 400 at once, the server goes on.
        status, r = s.request("POST", "/v1/completions",
                              {"prompt": prompts[0] * 40, "max_tokens": 6})
        assert status == 400 and "memory limit" in r["error"]["message"], (status, r)
        assert r["error"]["type"] == "invalid_request_error", r
        assert s.cache()["memory"]["never_fit"] == 1
        same_answer(s.complete(prompts[1], max_tokens=6), stock[1])
    assert "memory limit 48.0 MiB (--memory-limit)" in (tmp_path / "a.log").read_text()


def test_the_guard_reserves_what_answers_use_and_refuses_the_impossible_at_once(tmp_path):
    import re

    model = write_model_dir(tmp_path / "m", "llama", hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=64, num_hidden_layers=4)
    limit = 64 << 20
    log = tmp_path / "a.log"
    with Server.ours(model, log, tmp_path, "--no-persist", "--memory-limit", str(limit)) as s:
        longest = int(re.search(r"a prompt of more than (\d+) tokens can never fit",
                                log.read_text()).group(1))
        # Claude Code's max_tokens on a short prompt: its caches for 32,000 answer tokens
        # would pass the limit many times over; admitted on its prompt and a headroom.
        stream = s.stream_chat(HELLO, max_tokens=32_000)
        first = next(stream)
        assert first["choices"], first
        m = s.cache()["memory"]
        admitted = m["reserved_bytes"]
        assert m["running_requests"] == 1 and 0 < admitted < limit - m["weights_bytes"], m
        # A request that can never fit, on each API, while that answer runs: 400 at once
        # in the API's shape with the numbers, never queued. (The agent routes refuse it
        # in the HTTP thread already: their context is what the memory limit holds for
        # one request, `guards.context`; the chat route's comes from the guard.)
        big = [{"role": "user", "content": "x" * (2 * longest)}]
        status, r = s.request("POST", "/v1/chat/completions", {"messages": big, "max_tokens": 8})
        assert status == 400 and r["error"]["type"] == "invalid_request_error", (status, r)
        assert r["error"]["code"] == "memory_limit_exceeded", r
        assert "prompt tokens" in r["error"]["message"] and "--memory-limit" in r["error"]["message"]
        for streamed in (False, True):  # (streamed: refused before its stream opens)
            status, r = s.request("POST", "/v1/messages", {"model": "m", "max_tokens": 8,
                                                           "messages": big, "stream": streamed})
            assert status == 400 and r["type"] == "error", (status, r)
            assert r["error"]["type"] == "invalid_request_error"
            assert re.search(r"prompt is too long: \d+ tokens > \d+ maximum",
                             r["error"]["message"]), r
        status, r = s.request("POST", "/v1/responses", {"model": "m", "input": big})
        assert status == 400 and r["error"]["type"] == "invalid_request_error", (status, r)
        assert r["error"]["code"] in ("memory_limit_exceeded", "context_length_exceeded"), r
        m = s.cache()["memory"]
        # The long answer is still running: the refusals did not wait for it.
        assert m["never_fit"] >= 1 and m["refused"] == 0 and m["running_requests"] == 1, m
        # Its reservation grows with the tokens it decodes.
        s.watch.wait("the reservation to grow").until(
            lambda: s.cache()["memory"]["reserved_bytes"] > admitted)
        assert s.cache()["memory"]["peak_bytes"] <= limit
        stream.close()  # the client leaves: its reservation goes
        s.watch.wait("the answer to leave").until(
            lambda: s.cache()["memory"]["running_requests"] == 0)


def test_memory_footprint_and_admission_units():
    from mlx_kvcache.serving.guards.footprint import Footprint
    from mlx_kvcache.serving.guards.memory import MemoryGuard, default_limit

    assert default_limit(1 << 30, 16 << 30)[0] == int((16 << 30) * 0.85)
    big = default_limit(15 << 30, 16 << 30)
    assert big[0] == (15 << 30) + (1 << 29) and "half of what they leave" in big[1]
    fp = Footprint(weights=1000, kv_fixed=0, kv_per_token=10.0, act_per_token=1.0, step=100)
    assert fp.need(100, 100) == 2 * 10 * 256 + 100  # one step of 256 tokens, twice
    active = {"n": 0}
    g = MemoryGuard(limit=20_000, active_memory=lambda: active["n"])
    g.footprint = fp
    held = {"n": 16_000}

    class Held:  # the prompt cache, as the guard sees it
        @property
        def nbytes(self):
            return held["n"]

        def trim_to(self, *, n_sequences=None, n_bytes=None):
            held.update(n=min(held["n"], n_bytes))
    g.hold(Held())
    need = g.need(100, 100)
    assert g.try_admit(need) and held["n"] == 20_000 - 1000 - need  # the cache gave way
    res = g.reserve(need, 100, 100)
    assert g.room() == 20_000 - 1000 - need
    # A longer request pads the running row to its length too.
    assert g.need(300, 100) == fp.need(300, 100) + 10 * (400 - 200)
    assert not g.try_admit(20_000)
    active["n"] = 40_000  # MLX holds more than was reserved (less the cache): that counts
    assert g.room() == 0 and not g.try_admit(1)
    active["n"] = 0
    res.release()
    res.release()  # idempotent
    assert g.running() == 0 and g.room() == 20_000 - 1000


# -- 5. beyond stock -----------------------------------------------------------------------------
KILLERS = [
    ("/v1/completions", {"prompt": "hi", "stop": 123}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": HELLO, "stop": 123}, "stop"),
    ("/v1/chat/completions", {"messages": HELLO, "seed": 0, "stop": 123}, "stop"),
    ("/v1/chat/completions", {"messages": HELLO, "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": HELLO, "stream": True, "stream_options": 5},
     "stream_options"),
]


def start_fails(model, tmp_path, *extra) -> str:
    """``mlx-kvcache serve`` with ``extra`` exits non-zero before serving; returns its one
    line of error (and checks there is no traceback)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(model),
                        "--no-persist", "--host", "127.0.0.1", "--port", str(free_port()), *extra],
                       capture_output=True, text=True, env=env, timeout=CAP, cwd=str(ROOT))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out and "Starting httpd" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    return errors[0]


def test_start_fails_fast_on_a_draft_or_kv_setting_that_cannot_work(dirs, tmp_path):
    # A draft whose architecture is a custom module: it loads only with --trust-remote-code,
    # which the target's flag now grants it too (mlx-lm loads a draft without it).
    custom = write_model_dir(tmp_path / "custom", "llama")
    config = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**config, "model_file": "arch.py"}))
    (custom / "arch.py").write_text("from mlx_lm.models.llama import Model, ModelArgs\n")
    line = start_fails(dirs["llama"], tmp_path, "--draft-model", str(custom))
    assert "draft model" in line and "trust_remote_code" in line, line
    line = start_fails(dirs["llama"], tmp_path, "--draft-model", str(tmp_path / "missing"))
    assert "draft model" in line and "missing" in line, line
    # The test model's heads are 16 wide: no group size of mx.quantize divides them.
    for extra in (["--kv-bits", "4"], ["--kv-bits", "4", "--kv-group-size", "32"],
                  ["--kv-bits", "7"]):
        line = start_fails(dirs["llama"], tmp_path, *extra)
        assert f"--kv-bits {extra[1]}" in line, line
    with Server.ours(dirs["llama"], tmp_path / "d.log", tmp_path, "--no-persist",
                     "--trust-remote-code", "--draft-model", str(custom)) as s:
        r = s.chat(HELLO, max_tokens=3)
        assert r["choices"][0]["finish_reason"] == "length"


def test_requests_that_would_end_the_generation_thread_get_400(dirs, tmp_path):
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--no-persist") as s:
        for path, body, field in KILLERS:
            raw = json.dumps({"max_tokens": 3, **body}).encode()
            status, r = s.request("POST", path, raw=raw)
            assert status == 400 and field in r["error"], (body, status, r)
            assert s.request("GET", "/health")[0] == 200, (body, s.tail())
        # stream_options without include_usage: mlx-lm reads the key unguarded at the end.
        chunks = list(s.stream_chat(HELLO, max_tokens=3, stream_options={}))
        assert last_finish(chunks) == "length"
        s.chat(HELLO, max_tokens=3)


def test_bursts_of_connections_are_served(dirs, tmp_path):
    """32 clients connecting at the same instant, three times: none is reset (the
    standard library's listen backlog of 5 resets some while the model computes)."""
    n = 32
    with Server.ours(dirs["llama"], tmp_path / "a.log", tmp_path, "--no-persist") as s:
        for burst in range(3):
            start, socks, errors = threading.Barrier(n), [None] * n, []

            def connect(i):
                body = json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}],
                                   "max_tokens": 2}).encode()
                head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
                start.wait()
                try:
                    c = socket.create_connection(("127.0.0.1", s.port))
                    c.sendall(head.encode())  # as http.client does: head, then body
                    c.sendall(body)
                    socks[i] = c
                except OSError as e:
                    errors.append(repr(e))
            threads = [threading.Thread(target=connect, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            s.watch.wait(f"burst {burst} to connect").until(
                lambda: not any(t.is_alive() for t in threads))
            answers = {}
            for i, c in enumerate(socks):
                if c is not None:
                    c.setblocking(False)
                    answers[i] = b""

            def all_read():
                open_ = [socks[i] for i in answers if socks[i].fileno() != -1]
                for c in select.select(open_, [], [], 0.1)[0]:
                    i = socks.index(c)
                    try:
                        data = c.recv(65536)
                    except OSError as e:
                        errors.append(repr(e))
                        data = b""
                    answers[i] += data
                    if not data:
                        c.close()
                return all(socks[i].fileno() == -1 for i in answers)
            s.watch.wait(f"burst {burst}").until(all_read, poll=0)
            assert not errors, errors
            assert all(a.startswith(b"HTTP/1.0 200") for a in answers.values()), \
                [a[:40] for a in answers.values()]


# -- 4. (issue item 8) padded recurrent rows -----------------------------------------------------
def test_a_padded_mamba_row_is_never_stored(dirs, tmp_path):
    """mlx-lm 0.32.2's batch path runs Mamba-1's recurrent state over the padding of the
    shorter prompts of a batch. The answers stay mlx-lm's, but such a state must not be
    stored: after a restart the short prompt alone gets the cold answer."""
    d, cache = dirs["mamba"], str(tmp_path / "c")
    long = [{"role": "user", "content": "Tell me about the mountains and the rivers. " * 3}]
    short = HELLO
    with Server.stock(d, tmp_path / "stock.log", tmp_path) as s:
        cold = {"long": s.chat(long, max_tokens=5), "short": s.chat(short, max_tokens=5)}
    s = Server.ours(d, tmp_path / "a.log", tmp_path, "--cache-dir", cache)
    try:
        # A seeded request runs alone (sequential path) while both prompts queue behind it,
        # so they enter one batch together and the short one is padded. It is a plain
        # completion: it shares no prefix with the chats (no branch-point checkpoints).
        release, seen = threading.Event(), []

        def blocker():
            body = {"prompt": "Zebras " * 4, "max_tokens": 100_000, "seed": 0, "stream": True}
            for c in s.stream("/v1/completions", body):
                seen.append(c)
                if release.is_set():
                    return  # hangs up: the server stops this request
        tb, bb = run(blocker)
        s.watch.wait("the blocker to stream").until(lambda: seen)
        both = {k: run(s.chat, m, max_tokens=5) for k, m in (("long", long), ("short", short))}
        s.watch.wait("both prompts queued").until(lambda: s.cache()["queued_requests"] >= 2)
        release.set()
        finished(tb, bb, s)
        got = {k: finished(t, b, s) for k, (t, b) in both.items()}
    finally:
        s.stop()
    # The padded row's answer is what mlx-lm computes, not the cold one (the defect is real).
    with pytest.raises(AssertionError):
        same_answer(cold["short"], got["short"])
    same_answer(cold["long"], got["long"])
    with Server.ours(d, tmp_path / "b.log", tmp_path, "--cache-dir", cache) as s:
        again = {"short": s.chat(short, max_tokens=5), "long": s.chat(long, max_tokens=5)}
    same_answer(cold["short"], again["short"])
    assert answer(again["short"])[2] == 0
    same_answer(cold["long"], again["long"])
    assert answer(again["long"])[2] > 0  # the unpadded row was stored
