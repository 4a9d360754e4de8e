"""The parts that bound slow, idle and heavy clients (issue 48 items 2 and 3), without a
model: the connection registry's admission and eviction, the reader's deadlines, the
accept loop out of descriptors, the body budget, and the parse estimate against what
parsing really builds (tracemalloc)."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
import tracemalloc

import pytest

from mlx_kvcache.serving.guards.body_budget import (BodyBudget, BudgetBusy, BudgetExceeded,
                                                   default_body_budget)
from mlx_kvcache.serving.guards.connections import (ConnectionLimits, DeadlinePassed, Evicted,
                                                    default_max_connections, limited,
                                                    raise_descriptor_limit)
from mlx_kvcache.serving.guards.log_text import printable
from mlx_kvcache.serving.routes.body import parse_cost

LOOP = ("127.0.0.1", 5000)
LAN = ("192.168.1.9", 5000)


class _Server:
    """A server class `limited` wraps: no socket, ``get_request`` as told."""

    accept_error = None

    def __init__(self, *a, **k) -> None:
        pass

    def get_request(self):
        raise self.accept_error

    def verify_request(self, request, client_address) -> bool:
        return True

    def shutdown_request(self, request) -> None:
        request.close()


@pytest.fixture
def pairs():
    made = []

    def pair():
        a, b = socket.socketpair()
        made.extend((a, b))
        return a, b  # (server side, client side)
    yield pair
    for s in made:
        s.close()


def _server(n, share=1 / 8, budget=None, header_timeout=None):
    return limited(_Server, ConnectionLimits(n, header_timeout, share), budget)()


def test_a_crowd_in_its_head_evicts_itself_and_busy_connections_stay(pairs):
    srv = _server(4)
    socks = [pairs() for _ in range(6)]
    conns = []
    for i, (server_side, _) in enumerate(socks[:4]):
        assert srv.verify_request(server_side, LOOP)
        conns.append(srv.connections.of(server_side))
        time.sleep(0.002)  # (opened in this order)
    conns[0].head_read()  # the oldest is past its head: it is answering, never evicted
    assert srv.verify_request(socks[4][0], LOOP)
    assert conns[1].evicted and not conns[0].evicted  # the oldest still in its head went
    assert socks[1][1].recv(100).startswith(b"HTTP/1.0 503")
    for c in conns[2:]:
        c.head_read()
    assert srv.connections.counts()["open"] == 4
    assert srv.verify_request(socks[5][0], LOOP)  # evicts the newcomer of before
    assert srv.connections.of(socks[4][0]).evicted
    srv.connections.of(socks[5][0]).head_read()
    # every connection answering: a new one is refused with a 503, nothing evicted
    extra = pairs()
    assert not srv.verify_request(extra[0], LOOP)
    assert extra[1].recv(200).startswith(b"HTTP/1.0 503")
    assert srv.connections.counts()["refused"] == 1
    # a closed connection frees its place
    srv.shutdown_request(socks[0][0])
    assert srv.verify_request(pairs()[0], LOOP)


def test_clients_off_loopback_leave_a_share_to_loopback(pairs):
    srv = _server(8, share=1 / 4)  # others hold at most 6
    lan = [pairs()[0] for _ in range(7)]
    for s in lan[:6]:
        assert srv.verify_request(s, LAN)
        srv.connections.of(s).head_read()
    assert not srv.verify_request(lan[6], LAN)  # the others' share is full (none in head)
    for _ in range(2):
        s = pairs()[0]
        assert srv.verify_request(s, LOOP)
        srv.connections.of(s).head_read()
    assert srv.connections.counts() == {"open": 8, "in_head": 0, "loopback": 2, "evicted": 0,
                                        "refused": 1}
    # a LAN newcomer may evict only a LAN connection still in its head
    waiting = pairs()[0]
    srv.shutdown_request(lan[0])
    assert srv.verify_request(waiting, LAN)
    newcomer = pairs()[0]
    assert srv.verify_request(newcomer, LAN)
    assert srv.connections.of(waiting).evicted


def test_out_of_descriptors_the_accept_loop_evicts_and_pauses(pairs):
    srv = _server(4)
    idle = pairs()[0]
    assert srv.verify_request(idle, LOOP)
    srv.accept_error = OSError(errno.EMFILE, "Too many open files")
    with pytest.raises(OSError):
        srv.get_request()
    assert srv.connections.of(idle).evicted and srv.connections.counts()["evicted"] == 1
    srv.accept_error = OSError(errno.ECONNABORTED, "aborted")  # not a descriptor: no eviction
    with pytest.raises(OSError):
        srv.get_request()
    assert srv.connections.counts()["evicted"] == 1


def test_the_head_deadline_holds_against_a_trickle(pairs):
    srv = _server(4, header_timeout=0.3)
    server_side, client = pairs()
    assert srv.verify_request(server_side, LOOP)
    conn = srv.connections.of(server_side)
    rfile = conn.reader()
    stop = threading.Event()

    def trickle():  # one byte at a time, faster than any per-read timeout would notice
        while not stop.is_set():
            try:
                client.send(b"G")
            except OSError:
                return
            time.sleep(0.02)
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with pytest.raises(DeadlinePassed):
            while True:
                rfile.readline(65537)
        assert conn.expired
    finally:
        stop.set()
        t.join()
    conn.head_late()
    assert client.recv(300).startswith(b"HTTP/1.0 408")


def test_an_evicted_connection_wakes_its_reader(pairs):
    srv = _server(1)
    first, _ = pairs()
    assert srv.verify_request(first, LOOP)
    rfile = srv.connections.of(first).reader()
    got = {}

    def read():
        try:
            rfile.readline(65537)
        except Exception as e:  # noqa: BLE001 - inspected below
            got["e"] = e
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert srv.verify_request(pairs()[0], LOOP)  # the cap is 1: the first goes
    t.join(30)
    assert isinstance(got.get("e"), Evicted)


def test_the_body_deadline_is_for_the_whole_body(pairs):
    srv = _server(4)
    server_side, client = pairs()
    assert srv.verify_request(server_side, LOOP)
    conn = srv.connections.of(server_side)
    conn.head_read()
    rfile = conn.reader()
    client.send(b"x" * 10)
    conn.body_started(0.2)
    assert rfile.read1(100) == b"x" * 10
    with pytest.raises(DeadlinePassed):
        while True:
            client.send(b"y")
            rfile.read1(100)
    conn.body_read()  # no deadline past the body
    client.send(b"z")
    assert rfile.read1(100)


def test_the_descriptor_limit_and_the_default_cap():
    soft, hard = raise_descriptor_limit()
    assert soft == hard or hard == -1 or soft > 0
    assert default_max_connections(2048) == 1024 and default_max_connections(4096) == 1024
    assert default_max_connections(1024) == 512 and default_max_connections(100) == 16
    assert default_body_budget(24 << 30) == 1 << 30 and default_body_budget(4 << 30) == 512 << 20


def test_the_body_budget_waits_refuses_and_keeps_loopbacks_share():
    budget = BodyBudget(800, loopback_share=1 / 4)  # others: 600 together
    lan = budget.hold(loopback=False)
    lan.grow(500, deadline=None)
    with pytest.raises(BudgetExceeded):
        budget.hold(loopback=False).grow(601, deadline=None)  # never, for a LAN client
    with pytest.raises(BudgetBusy):
        budget.hold(loopback=False).grow(200, deadline=time.monotonic())  # the share is taken
    local = budget.hold(loopback=True)
    local.grow(300, deadline=None)  # loopback's share is still there
    assert budget.held == 800
    waiter = budget.hold(loopback=True)
    done = threading.Event()

    def wait():
        waiter.grow(400, deadline=None)
        done.set()
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    assert not done.wait(0.05)
    lan.release()
    lan.release()  # (idempotent)
    t.join(30)
    assert done.is_set() and budget.held == 700
    local.release()
    waiter.release()
    assert budget.held == 0


def _peak_of_parsing(raw: bytes) -> int:
    tracemalloc.start()
    try:
        copy = bytes(raw)  # noqa: F841 - mlx-lm's route reads its own copy
        json.loads(raw.decode("utf-8"))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


N = 1 << 18
BODIES = {
    "empty objects": b'{"x":[' + b",".join([b"{}"] * (N // 3)) + b"]}",
    "empty lists": b'{"x":[' + b",".join([b"[]"] * (N // 3)) + b"]}",
    "nested lists": b'{"x":[' + b",".join([b"[[]]"] * (N // 5)) + b"]}",
    "small objects": b'{"x":[' + b",".join([b'{"a":0}'] * (N // 8)) + b"]}",
    "unique keys": b"{" + b",".join(b'"k%d":{}' % i for i in range(N // 12)) + b"}",
    "floats": b'{"x":[' + b",".join([b"1.5"] * (N // 4)) + b"]}",
    "short strings": b'{"x":[' + b",".join([b'"ab"'] * (N // 5)) + b"]}",
    "escaped wide strings": b'{"x":[' + b",".join([b'"a\\ud83d\\ude00"'] * (N // 16)) + b"]}",
    "deep": b'{"x":' + b"[" * 900 + b"]" * 900 + b"}",
    "text": json.dumps({"x": "hello world " * (N // 12)}).encode(),
    "text, one emoji": json.dumps({"x": "hello world " * (N // 12) + "\U0001F600"},
                                  ensure_ascii=False).encode(),
    "text, one escaped emoji": json.dumps({"x": "hello " * (N // 6) + "\U0001F600"}).encode(),
    "text with escapes": json.dumps({"x": "hello\nworld " * (N // 12)}).encode(),
    "cjk": json.dumps({"x": "漢字" * (N // 6)}, ensure_ascii=False).encode(),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_the_parse_estimate_bounds_what_parsing_builds(name):
    raw = BODIES[name]
    assert parse_cost(raw) >= _peak_of_parsing(raw), name
    assert parse_cost(bytearray(raw)) == parse_cost(raw)  # (read_raw hands a bytearray)


def test_a_text_body_is_not_estimated_far_above_its_size():
    raw = BODIES["text"]
    assert parse_cost(raw) < 4 * len(raw) + (1 << 20)  # 64 MiB of text fits a 1 GiB budget


def test_printable_escapes_what_would_break_a_line():
    assert printable("plain text — fine") == "plain text — fine"
    assert printable("a\nb\x1b[31m\u2028\t") == "a\\nb\\x1b[31m\\u2028\\t"
