"""Work in flight is shared, against real servers with the official SDKs: parallel
subagents' requests (one long uncached prefix, each its own task) reach the server while
the first is still computing that prefix — the second waits for it and computes only its
own tail, on a plain (llama) and a hybrid (qwen3_5: recurrent layers, restored only where
a state was stored) model, with the answers of cold runs; a request sharing nothing is not
held; a leader whose client leaves mid-prefill leaves its follower to compute for itself,
still right; and on the sequential path (a ``seed``: one request at a time) the prompt
being computed stops where the request queued behind it diverges.

"Together" is made real without a clock: the server prefills 2 tokens a step
(``--prefill-step-size 2``), and the follower is sent once ``GET /v1/cache`` shows the
leader's flight part-way through its prompt. The shared prefix is read from the server's
own token log (``MLX_KVCACHE_REQUEST_LOG``): the two prompts' ids as the server rendered
them.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

anthropic = pytest.importorskip("anthropic")

from mlx_kvcache.serving.cache.request_log import TOKEN_LOG_ENV  # noqa: E402
from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server, answer, same_answer  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)

#: The subagents' shared prefix: ~1,800 tokens (one a character), 900 prefill steps.
SYSTEM = ("You are a subagent for software engineering. Read files with care; report what "
          "you find, and nothing else. " * 18).strip()
TASKS = ("Find where the cache is cleared.", "List every test of the trie.")
UNRELATED = "Zebras graze in the savanna at dawn; what do they eat?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("inflight")


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def served(root, kind):
    """``(server sharing work in flight, a cold reference server)`` for ``kind``."""
    d = write_model_dir(root / kind, kind)
    log = root / f"{kind}-tokens.jsonl"
    with Server.ours(d, root / f"{kind}-log.txt", root / f"{kind}-home", "--no-persist",
                     "--prefill-step-size", "2", env={TOKEN_LOG_ENV: str(log)}) as s, \
            Server.ours(d, root / f"{kind}-cold.txt", root / f"{kind}-cold-home",
                        "--no-persist", "--no-foresight") as cold:
        s.tokens = log
        yield s, cold


def _client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="k",
                               max_retries=0)


def _ask(server, task, system=SYSTEM, **kw):
    return _client(server).messages.create(
        model="m", max_tokens=6, system=system, messages=[{"role": "user", "content": task}],
        extra_body=GREEDY, **kw)


def _in_thread(fn, *args, **kw):
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as e:  # handed to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result():
        t.join(CAP)
        if "error" in box:
            raise box["error"]
        return box["value"]
    return result


def _mid_prefill(server, sent: float):
    """Until ``GET /v1/cache`` shows a flight part-way through its prompt; fails when a
    request sent at or after ``sent`` (``time.time()``) finished first (the test's prompts
    would be too short for this machine)."""
    def seen():
        r = server.cache()
        mid = next((f for f in r["in_flight"]["flights"]
                    if f["start"] < f["computed"] < f["prompt_tokens"] - 100), None)
        if mid is None and any(e["time"] >= sent - 0.001 for e in r["recent"]):
            pytest.fail("the leader computed its prompt before the follower could be sent")
        return mid
    return server.watch.wait("a leader part-way through its prompt").until(seen, poll=0.02)


def _held(server, before):
    """Until the follower was held (counted: it may be released before a look sees it
    held); fails when it finished without (the leader's prompt was done first)."""
    def held():
        r = server.cache()
        if r["in_flight"]["held"] > before["in_flight"]["held"]:
            return True
        if r["requests"] >= before["requests"] + 2 and not r["in_flight"]["holding"]:
            pytest.fail("the follower was fetched without waiting: the leader's prompt was "
                        "computed first (too short for this machine)")
        return False
    _until(server, "the follower held", held)


def _until(server, what, cond):
    return server.watch.wait(what).until(cond, poll=0.02)


def _prompt(server, usage=None, tokens=None):
    """The newest prompt of ``tokens`` tokens (or of the request whose Anthropic ``usage``
    this is) the server finished, as it rendered it: its token log, written at the
    request's last insert — just after its answer reached the client (waited for)."""
    if usage is not None:
        tokens = (usage.input_tokens + usage.cache_read_input_tokens
                  + usage.cache_creation_input_tokens)

    def logged():
        lines = server.tokens.read_text().splitlines() if server.tokens.exists() else []
        for line in reversed(lines):
            ids = json.loads(line)["prompt"]
            if len(ids) == tokens:
                return ids
        return None
    return np.asarray(_until(server, f"a prompt of {tokens} tokens in the token log", logged))


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _cold_text(cold, task, **kw):
    cold.request("DELETE", "/v1/cache")
    return _ask(cold, task, **kw).content[0].text


def test_a_request_sharing_a_prefix_in_flight_computes_only_its_tail(served, kind):
    server, cold = served
    server.request("DELETE", "/v1/cache")
    before, sent = server.cache(), time.time()
    leader = _in_thread(_ask, server, TASKS[0])
    _mid_prefill(server, sent)
    follower = _in_thread(_ask, server, TASKS[1])
    _held(server, before)
    # A request sharing nothing in flight goes straight in (counted below: not held).
    other = _ask(server, UNRELATED, system="Be brief.")
    lead, follow = leader(), follower()
    lp, fp = _prompt(server, lead.usage), _prompt(server, follow.usage)
    shared = min(_shared(lp, fp), len(lp) - 1, len(fp) - 1)
    assert shared > len(SYSTEM) // 2  # the system prompt's words and the markup around it
    assert lead.usage.cache_read_input_tokens == 0
    assert follow.usage.cache_read_input_tokens == shared  # read: it computed its tail only
    other_prompt = other.usage.input_tokens + other.usage.cache_read_input_tokens
    assert other.usage.cache_read_input_tokens <= 1  # (the system prompt's opening mark)
    entry = next(e for e in server.cache()["recent"] if e["prompt_tokens"] == other_prompt)
    assert "in_flight" not in entry  # not held
    r = server.cache()["in_flight"]
    assert r["held"] - before["in_flight"]["held"] == 1  # the follower, not the other one
    assert r["released"]["stored"] - before["in_flight"]["released"]["stored"] == 1
    assert r["shared_tokens"] - before["in_flight"]["shared_tokens"] == shared
    entry = next(e for e in reversed(server.cache()["recent"]) if e.get("in_flight"))
    assert entry["in_flight"]["shared_tokens"] == shared and entry["cached_tokens"] == shared
    assert f"read {shared} tok computed for another request" in server.tail(20000)
    # The answers of cold runs, one request at a time on an empty cache.
    assert follow.content[0].text == _cold_text(cold, TASKS[1])
    assert lead.content[0].text == _cold_text(cold, TASKS[0])


def test_answers_read_from_a_prefix_in_flight_equal_cold_ones_to_the_log_prob(served, kind):
    server, cold = served
    server.request("DELETE", "/v1/cache")
    before, sent = server.cache(), time.time()
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]
            for t in TASKS]
    leader = _in_thread(server.chat, msgs[0], max_tokens=6)
    _mid_prefill(server, sent)
    follower = _in_thread(server.chat, msgs[1], max_tokens=6)
    lead, follow = leader(), follower()
    lp, fp = (_prompt(server, tokens=r["usage"]["prompt_tokens"]) for r in (lead, follow))
    shared = min(_shared(lp, fp), len(lp) - 1, len(fp) - 1)
    assert answer(follow)[2] == shared > len(SYSTEM) // 2 and answer(lead)[2] == 0
    assert server.cache()["in_flight"]["held"] == before["in_flight"]["held"] + 1
    for got, m in ((follow, msgs[1]), (lead, msgs[0])):
        cold.request("DELETE", "/v1/cache")
        same_answer(got, cold.chat(m, max_tokens=6))


def _post_and_leave(server, body):
    """Send ``body`` to ``/v1/messages`` and return a function that closes the connection
    without reading the answer (a client that leaves)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CAP)
    conn.request("POST", "/v1/messages", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "x-api-key": "k"})

    def leave():
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
    return leave


def test_a_follower_whose_leader_left_mid_prefill_computes_for_itself(served, kind):
    server, cold = served
    # The leader's prompt is the follower's but a short tail: it is far from their
    # shared point when its client leaves. Should it get there first anyway (a machine
    # that prefilled faster than the departure was seen), the follower read it: tried again.
    body = {"model": "m", "max_tokens": 6, "system": SYSTEM, **GREEDY,
            "messages": [{"role": "user", "content": TASKS[0]}]}
    for attempt in range(3):
        server.request("DELETE", "/v1/cache")
        before, sent = server.cache(), time.time()
        leave = _post_and_leave(server, body)
        _mid_prefill(server, sent)
        follower = _in_thread(_ask, server, TASKS[1])
        _held(server, before)  # (and, unless the leader was quicker, held still)
        leave()
        follow = follower()
        released = server.cache()["in_flight"]["released"]
        if released["ended"] > before["in_flight"]["released"]["ended"]:
            break
        assert released["stored"] > before["in_flight"]["released"]["stored"]
    else:
        pytest.fail("the leader reached the shared point before its departure was seen, "
                    "three times")
    # It read what the leader stored before it left, if anything (a segment end of mlx-lm's
    # own: the system prompt's), and computed the rest.
    assert "s for a prefix in flight; its request ended first" in server.tail(20000)
    prompt = _prompt(server, follow.usage)
    assert follow.usage.cache_read_input_tokens < len(prompt) - len(TASKS[1]) // 2
    assert follow.content[0].text == _cold_text(cold, TASKS[1])


def test_the_sequential_path_stops_where_a_queued_request_diverges(served, kind):
    server, cold = served
    server.request("DELETE", "/v1/cache")
    before, sent = server.cache(), time.time()
    # A seed: mlx-lm serves each request alone (its sequential path); the follower waits in
    # the queue while the leader computes, and asks it for a stop where they diverge.
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]
            for t in TASKS]
    leader = _in_thread(server.chat, msgs[0], max_tokens=6, seed=3)
    if kind == "qwen3_5":
        _mid_prefill(server, sent)
    else:  # a KV model's sequential prompt is no flight: it is fetched, then mlx-lm computes it
        _until(server, "the leader fetched",
               lambda: server.cache()["requests"] > before["requests"])
    follower = _in_thread(server.chat, msgs[1], max_tokens=6, seed=3)
    lead, follow = leader(), follower()
    lp, fp = (_prompt(server, tokens=r["usage"]["prompt_tokens"]) for r in (lead, follow))
    shared = min(_shared(lp, fp), len(lp) - 1, len(fp) - 1)
    assert answer(follow)[2] == shared and answer(lead)[2] == 0
    r = server.cache()["in_flight"]
    if kind == "qwen3_5":  # a KV model restores anywhere in what the leader stores at its end
        assert r["cuts"] == before["in_flight"]["cuts"] + 1
    assert r["held"] == before["in_flight"]["held"]  # queued, not held
    for got, m in ((follow, msgs[1]), (lead, msgs[0])):
        cold.request("DELETE", "/v1/cache")
        same_answer(got, cold.chat(m, max_tokens=6, seed=3))
