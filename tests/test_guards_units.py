"""The server's guards (`serving/guards/`), in process: request fields checked before they
reach the generation thread, the admin route's access rules, the memory guard's admission
line and reservations, and the lifecycle's admission during a stop."""

from __future__ import annotations

import types

import mlx.core as mx
import pytest

from mlx_kvcache.serving import app
from models import V, build


def test_request_fields_that_would_end_the_generation_thread():
    from mlx_kvcache.serving.guards.validation import body_problem, generation_problem

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert body_problem("chat", chat) is None
    assert body_problem("text", {"prompt": "hi", "stop": ["a", "b"], "seed": 3}) is None
    bad = [("text", {"prompt": "hi", "stop": 123}, "stop"),
           ("text", {"prompt": "hi", "stop": [1]}, "stop"),
           ("chat", dict(chat, stop=["\ud800"]), "stop"),
           ("text", {"prompt": ""}, "prompt"), ("text", {"prompt": ["a", "b"]}, "prompt"),
           ("text", {}, "prompt"), ("chat", {"messages": []}, "messages"),
           ("chat", dict(chat, seed=-1), "seed"), ("chat", dict(chat, seed=1 << 64), "seed"),
           ("chat", dict(chat, logit_bias={"5": 1.0}), None),
           ("chat", dict(chat, logit_bias={"500": 1.0}), "logit_bias"),
           ("chat", dict(chat, logit_bias={"-1": 1.0}), "logit_bias"),
           ("chat", dict(chat, logit_bias={"x": 1.0}), "logit_bias"),
           ("chat", dict(chat, tools=5), "tools"),
           ("chat", dict(chat, chat_template_kwargs=[]), "chat_template_kwargs"),
           ("chat", dict(chat, stream_options={"include_usage": "yes"}), "include_usage")]
    for route, body, field in bad:
        problem = body_problem(route, body, vocab=100)
        assert (problem is None) if field is None else (field in problem), (body, problem)
    m = build("llama")
    args = types.SimpleNamespace(seed=None, logits=types.SimpleNamespace(logit_bias={V: 1.0}))
    assert "logit_bias" in generation_problem([1, 2], args, m)  # V is one past the last id
    args.logits.logit_bias = {V - 1: 1.0}
    assert generation_problem([1, 2], args, m) is None
    assert "empty" in generation_problem([], args, m)


def test_admin_policy():
    from mlx_kvcache.serving.guards.admin import AdminPolicy

    open_ = AdminPolicy.make(None, "127.0.0.1")
    ok = {"Host": "127.0.0.1:8080"}
    assert open_.refusal("GET", ok) is None
    assert open_.refusal("DELETE", {}) is None  # curl over HTTP/1.0: no Host, no Origin
    assert open_.refusal("GET", {"Host": "localhost:8080"}) is None
    assert open_.refusal("GET", {"Host": "[::1]:8080"}) is None
    assert open_.refusal("GET", {**ok, "Origin": "http://127.0.0.1:8080"}) is None
    for headers in ({**ok, "Origin": "http://evil.example"}, {**ok, "Origin": "null"},
                    {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"},
                    {"Host": "evil.example:8080"}):
        assert open_.refusal("DELETE", headers)[0] == 403, headers
    assert open_.refusal("OPTIONS", ok)[0] == 403
    locked = AdminPolicy.make("t0ken", "0.0.0.0")
    assert locked.refusal("GET", ok)[0] == 401
    assert locked.refusal("GET", {**ok, "Authorization": "Bearer nope"})[0] == 401
    assert locked.refusal("GET", {**ok, "Authorization": "Basic t0ken"})[0] == 401
    assert locked.refusal("GET", {"Host": "proxy.example", "Authorization": "Bearer t0ken"}) is None
    assert locked.refusal("GET", {"Host": "proxy.example", "Origin": "http://evil.example",
                                  "Authorization": "Bearer t0ken"})[0] == 403


def test_admin_policy_decides_by_the_peer_address():
    from mlx_kvcache.serving.guards.admin import AdminPolicy, is_loopback, listens_beyond_loopback

    open_ = AdminPolicy.make(None, "0.0.0.0")
    for peer in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(peer) and open_.refusal("GET", {"Host": "127.0.0.1"}, peer) is None
    for peer in ("192.168.1.7", "10.0.0.2", "::ffff:192.168.1.7", "fe80::1%eth0", "", "x"):
        assert not is_loopback(peer)
        for host in ("127.0.0.1:8080", "8.8.8.8", "localhost"):
            assert open_.refusal("GET", {"Host": host}, peer)[0] == 403, (peer, host)
    locked = AdminPolicy.make("t0ken", "0.0.0.0")
    ok = {"Authorization": "Bearer t0ken"}
    assert locked.refusal("GET", ok, "192.168.1.7") is None
    assert locked.refusal("GET", {}, "127.0.0.1")[0] == 401
    for host, beyond in (("127.0.0.1", False), ("::1", False), ("localhost", False),
                         ("0.0.0.0", True), ("::", True), ("", True), ("192.168.1.7", True)):
        assert listens_beyond_loopback(host) is beyond, host
    assert app.excerpts_shown("auto", "127.0.0.1", None)
    assert not app.excerpts_shown("auto", "0.0.0.0", None)
    assert app.excerpts_shown("auto", "0.0.0.0", "t0ken")
    assert not app.excerpts_shown("off", "127.0.0.1", None)
    assert app.excerpts_shown("on", "0.0.0.0", None)


def _guard_and_queue(limit, sizes, kv_per_token=1.0, wait=3600.0, active=lambda: 0):
    from mlx_kvcache.serving.guards.admission import AdmissionQueue
    from mlx_kvcache.serving.guards.footprint import Footprint
    from mlx_kvcache.serving.guards.memory import MemoryGuard

    g = MemoryGuard(limit=limit, wait=wait, active_memory=active)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=kv_per_token,
                            act_per_token=0.0, step=8)
    q = AdmissionQueue(g, lambda item: sizes[item[1]], lambda item: item[1] == "cmd")

    def req(kind):
        from queue import Queue

        out = Queue()
        q.put((out, kind, None))
        return out
    return g, q, req


def _answered_in_line(q, out):
    """What the admission line ``q`` put on the answer queue ``out`` while it handed the
    generation thread nothing (a refusal, or a `DecodeJob`'s result)."""
    from queue import Empty

    with pytest.raises(Empty):
        q.get_nowait()
    return out.get_nowait()


def test_admission_passes_a_waiting_request_lets_commands_pass_and_refuses_clearly():
    from queue import Empty, Queue

    from mlx_kvcache.serving.guards.memory import MemoryNeverFits, MemoryRefused

    # 1 B per token, twice, rounded to 256 tokens, every row as long as the longest: a
    # "mid" reserves its prompt and the first 256 answer tokens (1280 tokens: 2560 B), not
    # its max_tokens; a "small" beside it as much (padded); a "big" 6144 B and the rows it
    # pads. The limit leaves 7780 B beside the weights.
    sizes = {"mid": (1000, 32_000), "big": (3000, 1), "small": (100, 100),
             "huge": (100_000, 1)}
    g, q, req = _guard_and_queue(8780, sizes)
    req("mid"), req("mid")
    q.put((Queue(), "cmd", None))
    assert q.get(timeout=0)[1] == "cmd"  # a command passes the line
    running = [q.get(timeout=0)]  # mlx-lm's loop waits (blocks) only with an empty batch ...
    running.append(q.get_nowait())  # ... then takes without waiting
    assert [r[1] for r in running] == ["mid", "mid"]
    req("big")
    with pytest.raises(Empty):  # the big one does not fit while two run: it waits ...
        q.get_nowait()
    req("small")
    running.append(q.get_nowait())  # ... and a small one behind it goes first
    assert running[-1][1] == "small"
    m = g.report()
    assert m["admitted_past_waiting"] == 1 and m["waiting_requests"] == 1, m
    # Never fits: refused at once with 400 while others run, never queued.
    refused = _answered_in_line(q, req("huge"))
    assert isinstance(refused, MemoryNeverFits) and refused.status == 400
    assert "100000 prompt tokens" in str(refused) and "--memory-limit" in str(refused)
    m = g.report()
    assert m["never_fit"] == 1 and m["refused"] == 0 and q.qsize() == 1, m
    for r in running:  # the answers end: their memory is released
        r[0].put(None)
    assert q.get_nowait()[1] == "big"  # the waiting one goes as soon as it fits
    assert g.report()["admitted_after_waiting"] == 1
    assert not isinstance(MemoryRefused("x"), MemoryNeverFits) and MemoryRefused.status == 503


def test_admission_fairness_is_bounded():
    from queue import Empty

    from mlx_kvcache.serving.guards.admission import PASS_LIMIT

    sizes = {"small": (100, 100), "big": (4000, 1), "huge": (100_000, 1)}
    g, q, req = _guard_and_queue(10_000, sizes)
    smalls = [req("small")]
    held = [q.get(timeout=0)]  # one runs: the big one cannot fit beside it
    req("big")
    for _ in range(PASS_LIMIT):
        req("small")
        held.append(q.get_nowait())
        assert held[-1][1] == "small"
    assert g.report()["admitted_past_waiting"] == PASS_LIMIT
    req("small")
    huge = req("huge")
    with pytest.raises(Empty):  # passed enough: nothing behind it goes first ...
        q.get_nowait()
    assert huge.get_nowait().status == 400  # ... but what can never fit is still told at once
    for h in held:
        h[0].put(None)
    assert q.get_nowait()[1] == "big"  # it goes first once it fits


def test_images_are_decoded_only_where_the_guard_admits_their_decoding():
    from queue import Queue

    from mlx_kvcache.serving.guards.admission import AdmissionQueue, DecodeJob
    from mlx_kvcache.serving.guards.footprint import Footprint
    from mlx_kvcache.serving.guards.memory import MemoryGuard, MemoryNeverFits, MemoryRefused

    # Rule 6: a request's images (bytes to decode, read from their headers) are admitted
    # before anything decodes them (`size` stands for mlx-lm's tokenizing, which decodes).
    g = MemoryGuard(limit=10_000, wait=3600.0, active_memory=lambda: 0)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0,
                            step=8)
    images = {"text": 0, "photo": 5_000, "poster": 8_000, "mural": 9_001}
    decoded = []

    def size(item):
        decoded.append(item[1])
        return (100, 100)
    q = AdmissionQueue(g, size, lambda item: False, images=lambda item: images[item[1]])

    def put(kind) -> Queue:
        out: Queue = Queue()
        q.put((out, kind, None))
        return out
    # Decoding that can never fit beside the weights: 400 at once, nothing decoded.
    refused = _answered_in_line(q, put("mural"))
    assert isinstance(refused, MemoryNeverFits) and refused.status == 400
    assert "never be decoded" in str(refused) and "--memory-limit" in str(refused)
    assert decoded == [] and g.report()["never_fit"] == 1
    # Fits: decoded once, then admitted as a request.
    put("photo")
    running = q.get(timeout=0)
    assert running[1] == "photo" and decoded == ["photo"]
    # While it runs, images that do not fit beside it wait undecoded; a text request
    # behind them goes first, and a count (`DecodeJob`) that fits runs in the line.
    g.reserve(4_000, 1000, 0)  # (what a long answer beside it holds)
    poster = put("poster")
    put("text")
    assert q.get_nowait()[1] == "text" and decoded == ["photo", "text"]
    counted = Queue()
    q.put((counted, DecodeJob(lambda: 42, 1_000), None))
    assert _answered_in_line(q, counted) == 42 and poster.qsize() == 0
    failing = Queue()
    q.put((failing, DecodeJob(lambda: 1 / 0, 100), None))
    # the asker's error, not the loop's
    assert isinstance(_answered_in_line(q, failing), ZeroDivisionError)
    g.idle()  # the answers ended
    assert q.get_nowait()[1] == "poster" and decoded[-1] == "poster"
    # Waited too long (here: nothing runs that could free what is in use): 503, undecoded.
    g2 = MemoryGuard(limit=10_000, wait=0.0, active_memory=lambda: 7_000)
    g2.footprint = g.footprint
    q2 = AdmissionQueue(g2, size, lambda item: False, images=lambda item: images[item[1]])
    out = Queue()
    q2.put((out, "photo", None))
    refused = _answered_in_line(q2, out)
    assert type(refused) is MemoryRefused and "cannot decode this request's images" in str(refused)
    assert decoded[-1] == "poster"
    # No limit: a job runs as it comes.
    free = AdmissionQueue(MemoryGuard(limit=None), size, lambda item: False)
    out = Queue()
    free.put((out, DecodeJob(lambda: "ran", 10**12), None))
    assert _answered_in_line(free, out) == "ran"


def test_an_image_s_encoding_is_measured_and_reserved_until_the_prefill_ends():
    from queue import Queue

    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.admission import AdmissionQueue
    from mlx_kvcache.serving.guards.footprint import Footprint, measure_encoding
    from mlx_kvcache.serving.guards.memory import MemoryGuard, MemoryNeverFits

    # A stand-in image encoder whose attention holds an n x n float32 score matrix: the
    # measured line grows with n² at 4 bytes (and a little per token: its output rows).
    class Tower:
        def embed_inputs(self, ids, pixel_values):
            scores = mx.outer(pixel_values, pixel_values)
            return mx.repeat(scores.sum(axis=1, keepdims=True), 8, axis=1)

    def probe(n):
        return [0] * (n + 2), mx.ones((n,)), n
    linear, square = measure_encoding(Tower(), probe)
    assert 3.9 <= square <= 4.5 and linear <= 200, (linear, square)
    assert measure_encoding(Tower(), lambda n: None) == (0.0, 0.0)  # the processor made none
    # A processor that gives every image the same tokens: one size, linear only.
    linear, square = measure_encoding(Tower(), lambda n: ([0] * 66, mx.ones((64,)), 64))
    assert square == 0.0 and linear >= 4 * 64

    # The guard: an image of 100 tokens takes 10 x 100 + 1 x 100² = 11,000 B to encode.
    fp = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0, step=8,
                   image_linear=10.0, image_square=1.0)
    assert fp.encoding([100, 100]) == 22_000 and fp.encoding([]) == 0
    g = MemoryGuard(limit=20_000, wait=3600.0, active_memory=lambda: 0)
    g.footprint = fp
    sizes = {"one": (200, 10, (100,)), "two": (200, 10, (100, 100))}
    q = AdmissionQueue(g, lambda item: sizes[item[1]], lambda item: False)
    two: Queue = Queue()
    q.put((two, "two", None))
    q.put((Queue(), "one", None))
    admitted = q.get(timeout=0)
    refused = two.get_nowait()  # 22,000 B of encoding beside 1,000 B of weights: never
    assert isinstance(refused, MemoryNeverFits) and "2 images of 100+100 tokens" in str(refused)
    assert "send fewer or smaller images" in str(refused)
    assert admitted[1] == "one" and g.reserved() == 2 * 256 + 11_000
    admitted[0].put(Response("a", 1, 0.0, None, ()))
    assert g.reserved() == 2 * 256  # prefilled: the encoding is gone


def test_the_reservation_follows_the_decoded_tokens():
    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.memory import DECODE_HEADROOM

    # 10 B per token (twice): a 100-token prompt with max_tokens 32,000 reserves 2 x 512
    # tokens at admission (prompt + 256 rounded), not 32,100 — which would never fit.
    sizes = {"long": (100, 32_000), "late": (100, 32_000)}
    active = {"n": 0}
    g, q, req = _guard_and_queue(35_000, sizes, kv_per_token=10.0, active=lambda: active["n"])
    out = req("long")
    first = q.get(timeout=0)
    assert g.report()["reserved_bytes"] == 2 * 10 * 512
    tok = Response("a", 1, 0.0, None, ())
    for _ in range(DECODE_HEADROOM - 1):  # within its reservation: no growth
        first[0].put(tok)
    assert g.report()["reserved_bytes"] == 2 * 10 * 512
    first[0].put(tok)  # its answer reached the reservation: 256 more tokens
    assert g.report()["reserved_bytes"] == 2 * 10 * 768
    # MLX's active memory counts beside the reservations: what is in use is the larger.
    active["n"] = 25_000
    assert g.in_use() == 25_000 and g.room() == 10_000
    active["n"] = 0
    late_out = req("late")
    late = q.get_nowait()
    late[0].put(tok)  # the second decodes too
    for _ in range(DECODE_HEADROOM * 2):
        first[0].put(tok)
    # The reservations would pass the limit: the newest decoding request ends there,
    # with finish_reason length and its end, and the first goes on.
    assert g.report()["ended_at_limit"] == 1
    late[0].put(tok)
    got = [late_out.get_nowait() for _ in range(late_out.qsize())]
    assert got[-1] is None and got[-2].finish_reason == "length"
    assert all(r.finish_reason is None for r in got[:-2])
    late[0].put(tok)  # mlx-lm's last step for it: dropped
    assert late_out.qsize() == 0 and g.running() == 1
    assert out.qsize() == DECODE_HEADROOM * 3 and g.report()["reserved_bytes"] > 2 * 10 * 768


def test_a_prefill_s_activations_are_reserved_until_the_first_token():
    from mlx_lm.server import Response

    from mlx_kvcache.serving.guards.admission import AdmissionQueue
    from mlx_kvcache.serving.guards.footprint import Footprint
    from mlx_kvcache.serving.guards.memory import MemoryGuard

    g = MemoryGuard(limit=1 << 30, active_memory=lambda: 0)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=100.0,
                            step=64)
    q = AdmissionQueue(g, lambda item: (1000, 10), lambda item: False)
    from queue import Queue

    q.put((Queue(), "r", None))
    admitted = q.get(timeout=0)
    assert g.reserved() == 2 * 1024 + 100 * 64  # caches, and one prefill step (64 tokens)
    admitted[0].put(Response("a", 1, 0.0, None, ()))
    assert g.reserved() == 2 * 1024  # prefilled: the activations are gone


def test_lifecycle_admits_until_stopping():
    import time

    from mlx_kvcache.serving.guards.lifecycle import Lifecycle

    life = Lifecycle(grace=5)
    assert life.admit() and life.inflight == 1
    assert life.admit(counted=False) and life.inflight == 1  # a read of the state: not open
    life.on_signal()
    assert life.asked and life.signals == 1 and not life.cut.is_set()
    life.stopping.set()
    assert not life.admit() and life.inflight == 1
    assert not life.admit(counted=False)
    assert not life.wait_idle(time.monotonic() + 0.05)
    assert not life.wait_idle(time.monotonic() + 60, interrupt=lambda: True)
    life.done()
    assert life.wait_idle(time.monotonic() + 0.05) and life.inflight == 0


def test_the_guards_count_refusals_by_reason_and_each_request_s_queue_wait(monkeypatch):
    from queue import Queue

    from mlx_kvcache.serving.guards import admission
    from mlx_kvcache.serving.guards.admission import AdmissionQueue, DecodeJob
    from mlx_kvcache.serving.guards.counters import GuardCounters, Refusal
    from mlx_kvcache.serving.guards.footprint import Footprint
    from mlx_kvcache.serving.guards.lifecycle import Lifecycle
    from mlx_kvcache.serving.guards.memory import MemoryGuard, MemoryNeverFits, MemoryRefused

    # The histogram's buckets are Prometheus's: a wait counts in every bucket whose upper
    # bound it does not pass (a wait on a bound is in that bucket).
    c = GuardCounters(buckets=(1.0, 10.0))
    for s in (1.0, 1.5, 10.0, 11.0):
        c.waited(s)
    w = c.queue_wait()
    assert (w.bounds, w.cumulative, w.count, w.seconds) == ((1.0, 10.0), (1, 3), 4, 23.5)
    assert c.by_reason() == {"memory": 0, "memory_never_fits": 0, "stopping": 0,
                            "context": 0, "bad_input": 0}

    # The wait runs from the put (an HTTP thread) to the hand-out (the generation thread),
    # on the monotonic clock the line reads.
    clock = [100.0]
    monkeypatch.setattr(admission, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    counters = GuardCounters()
    g = MemoryGuard(limit=10_000, wait=3600.0, active_memory=lambda: 0, counters=counters)
    g.footprint = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0,
                            step=8)
    sizes = {"small": (100, 10), "huge": (100_000, 1)}
    q = AdmissionQueue(g, lambda item: sizes[item[1]], lambda item: item[1] == "cmd")
    q.put((Queue(), "small", None))
    q.put((Queue(), "cmd", None))  # a command: no request, no wait counted
    huge = Queue()
    q.put((huge, "huge", None))
    counted = Queue()
    q.put((counted, DecodeJob(lambda: 7, 10), None))  # count_tokens: no request either
    clock[0] += 7.0
    assert q.get(timeout=0)[1] == "cmd"
    assert q.get_nowait()[1] == "small"
    assert isinstance(_answered_in_line(q, huge), MemoryNeverFits) and counted.get_nowait() == 7
    w = counters.queue_wait()
    assert (w.count, w.seconds) == (1, 7.0) and w.cumulative[w.bounds.index(10.0)] == 1
    assert w.cumulative[w.bounds.index(5.0)] == 0
    assert counters.by_reason()["memory_never_fits"] == 1 == g.report()["never_fit"]
    # Waited too long (nothing running could free what is in use): a memory refusal.
    g2 = MemoryGuard(limit=10_000, wait=0.0, active_memory=lambda: 9_990, counters=counters)
    g2.footprint = g.footprint
    q2 = AdmissionQueue(g2, lambda item: sizes[item[1]], lambda item: False)
    out = Queue()
    q2.put((out, "small", None))
    assert _answered_in_line(q2, out).__class__ is MemoryRefused
    assert counters.refusals(Refusal.MEMORY) == 1 == g2.report()["refused"]
    # No limit: every request passes at once, its wait counted all the same.
    free = AdmissionQueue(MemoryGuard(limit=None, counters=counters), lambda item: None,
                          lambda item: False)
    free.put((Queue(), "small", None))
    clock[0] += 0.5
    assert free.get_nowait()[1] == "small"
    assert (counters.queue_wait().count, counters.queue_wait().seconds) == (2, 7.5)
    # The stop: a request refused at the door counts; a read of the state does not.
    life = Lifecycle(counters=counters)
    life.stopping.set()
    assert not life.admit() and not life.admit(counted=False)
    assert counters.by_reason() == {"memory": 1, "memory_never_fits": 1, "stopping": 1,
                            "context": 0, "bad_input": 0}
