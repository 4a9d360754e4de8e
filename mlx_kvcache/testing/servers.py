"""Server processes on loopback for tests and benchmarks: started on a free port, stopped
by their user, spoken to over HTTP with the standard library; every wait is bounded by the
server's progress (`waits`)."""

from __future__ import annotations

import copy
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .waits import Watch, call

ROOT = Path(__file__).resolve().parents[2]
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def peak_rss_kib(pid: int, reset: bool = False) -> int:
    """The peak resident memory (``VmHWM``, KiB) of process ``pid``, first set back to what
    it holds now with ``reset`` (Linux: ``/proc/PID/clear_refs``)."""
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StreamCut(AssertionError):
    """A streamed answer ended without ``data: [DONE]`` (the connection closed first)."""


class Client:
    """HTTP to a server on 127.0.0.1:``port`` (standard library only). Every wait is
    bounded by the server's progress (`waits`), unless a ``timeout`` is given."""

    port: int
    watch: Optional[Watch] = None
    #: Where the client connects (a test may reach a server through another interface).
    address: str = "127.0.0.1"

    def through(self, address: str) -> "Client":
        """The same client, connecting to ``address`` instead (waits still follow the
        server's progress)."""
        other = copy.copy(self)
        other.address = address
        return other

    def tail(self, n: int = 4000) -> str:
        return self.watch.tail()[-n:] if self.watch is not None else ""

    def _wait(self, what: str):
        return self.watch.wait(what) if self.watch is not None else None

    def wait_healthy(self, cap: Optional[float] = None) -> None:
        """Until ``GET /health`` answers 200, while the server lives and makes progress."""
        def healthy():
            try:
                return self.request("GET", "/health", timeout=5)[0] == 200
            except OSError:
                return False
        self.watch.wait("starting the server", cap=cap).until(healthy, poll=0.2)

    def request(self, method: str, path: str, body: Any = None, timeout: Optional[float] = None,
                raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None):
        """(status, JSON body or raw bytes). ``timeout``: a plain socket timeout instead of
        a wait bounded by progress."""
        status, _, payload = self.exchange(method, path, body, timeout, raw, headers)
        return status, payload

    def exchange(self, method: str, path: str, body: Any = None, timeout: Optional[float] = None,
                 raw: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None):
        """(status, response headers (lower-case names), JSON body or raw bytes)."""
        wait = None if timeout is not None else self._wait(f"{method} {path}")
        conn = http.client.HTTPConnection(
            self.address, self.port, timeout=timeout if timeout is not None or wait else 120)

        held: List[socket.socket] = []  # http.client drops conn.sock once a response reads

        def go():
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.connect()
            held.append(conn.sock)
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            payload = r.read()
            head = {k.lower(): v for k, v in r.getheaders()}
            try:
                return r.status, head, json.loads(payload)
            except ValueError:
                return r.status, head, payload
        try:
            return call(go, wait, lambda: held[0] if held else None)
        finally:
            conn.close()

    def chat(self, messages, max_tokens=8, **extra) -> Dict[str, Any]:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": True, "top_logprobs": 5, **extra}
        status, r = self.request("POST", "/v1/chat/completions", body)
        assert status == 200, (status, r, self.tail())
        return r

    def complete(self, prompt, max_tokens=8, **extra) -> Dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": True, "top_logprobs": 5, **extra}
        status, r = self.request("POST", "/v1/completions", body)
        assert status == 200, (status, r, self.tail())
        return r

    def stream_chat(self, messages, max_tokens=8, stop_after: Optional[int] = None,
                    timeout: Optional[float] = None, **extra) -> Iterator[Dict[str, Any]]:
        """Server-sent events of a streamed chat; closing early (``stop_after`` chunks) is
        a client disconnecting mid-stream. Raises `StreamCut` if the stream ends without
        ``[DONE]``."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **extra}
        return self.stream("/v1/chat/completions", body, stop_after, timeout)

    def stream(self, path: str, body: Dict[str, Any], stop_after: Optional[int] = None,
               timeout: Optional[float] = None) -> Iterator[Dict[str, Any]]:
        """The ``data:`` events of a streamed answer, as JSON (see `stream_chat`)."""
        wait = None if timeout is not None else self._wait(f"streaming {path}")
        conn = http.client.HTTPConnection(
            self.address, self.port, timeout=timeout if timeout is not None or wait else 120)
        events: "queue.Queue" = queue.Queue()
        held: List[socket.socket] = []  # http.client drops conn.sock once a response reads

        def read():
            try:
                conn.connect()
                held.append(conn.sock)
                conn.request("POST", path, body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                if r.status != 200:
                    events.put(("status", (r.status, r.read())))
                    return
                for line in r:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        events.put(("done", None))
                        return
                    events.put(("data", json.loads(data)))
                events.put(("cut", None))
            except BaseException as e:  # handed to the reader below
                events.put(("error", e))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        n = 0
        try:
            while True:
                try:
                    kind, value = events.get(timeout=0.2)
                except queue.Empty:
                    if wait is not None:
                        wait.tick()
                    continue
                if kind == "done":
                    return
                if kind == "status":
                    raise AssertionError(f"status {value[0]}: {value[1]!r}")
                if kind == "error":
                    raise value
                if kind == "cut":
                    raise StreamCut(f"the stream of {path} ended without [DONE]\n{self.tail()}")
                yield value
                n += 1
                if stop_after is not None and n >= stop_after:
                    return
        finally:
            for sock in held:  # hang up, even while the reader waits for more
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()
            reader.join(5)

    def cache(self, **headers) -> Dict[str, Any]:
        status, r = self.request("GET", "/v1/cache", headers=headers or None)
        assert status == 200, (status, r)
        return r


class Server(Client):
    """One server process (its own process group), logging to ``log``; listening on
    ``host`` (loopback unless a test needs another interface), spoken to on loopback."""

    def __init__(self, argv: List[str], log: Path, home: Path, port: Optional[int] = None,
                 start_timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
                 host: str = "127.0.0.1"):
        self.port = port or free_port()
        self.log = log
        e = dict(os.environ, XDG_CACHE_HOME=str(home), PYTHONUNBUFFERED="1",
                 HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
        if os.path.exists(BLAS) and "LD_PRELOAD" not in e:
            e["LD_PRELOAD"] = BLAS  # stock mlx_lm gets the same fast BLAS we preload
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            [*argv, "--host", host, "--port", str(self.port)], stdin=subprocess.DEVNULL,
            stdout=self._out, stderr=subprocess.STDOUT, env=e, cwd=str(ROOT),
            start_new_session=True)
        self.watch = Watch(self.proc.pid, log, self.tail, alive=lambda: self.proc.poll() is None)
        try:
            self.wait_healthy(start_timeout)
        except Exception:
            self.stop()
            raise

    @classmethod
    def ours(cls, model_dir, log, home, *extra, prefix: Sequence[str] = (), **kw) -> "Server":
        """``mlx-kvcache serve``; ``prefix`` runs it under another command (e.g. setpriv)."""
        argv = [*prefix, sys.executable, "-m", "mlx_kvcache.cli", "serve"]
        if model_dir is not None:
            argv += ["--model", str(model_dir)]
        return cls([*argv, *extra], log, home, **kw)

    @classmethod
    def stock(cls, model_dir, log, home, *extra, **kw) -> "Server":
        return cls([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), *extra],
                   log, home, **kw)

    def tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- lifecycle ----------------------------------------------------------------------------
    def send_signal(self, sig=signal.SIGTERM) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def entry_since(self, sent: float) -> Dict[str, Any]:
        """The newest ``GET /v1/cache`` `recent` entry of a request fetched at or after
        ``sent`` (``time.time()`` before sending it). A request is listed at its final
        insert, which mlx-lm makes just after the answer's end reaches the client: wait for
        it, bounded by the server's progress."""
        return self.watch.wait("a request's entry in GET /v1/cache").until(
            lambda: next((e for e in reversed(self.cache()["recent"])
                          if e["time"] >= sent - 0.001), None))

    def settled(self, cap: Optional[float] = None) -> Dict[str, Any]:
        """``GET /v1/cache`` once no disk write is pending (ours writes its captures when
        the generation loop is idle), waiting while the server makes progress."""
        def report() -> Optional[Dict[str, Any]]:
            r = self.cache()
            return None if r.get("disk_writes_pending") else r
        return self.watch.wait("the disk writes GET /v1/cache lists as pending", cap=cap).until(
            report, poll=0.05)

    def wait_exit(self, cap: Optional[float] = None) -> int:
        """The exit status, once the server has exited (while it makes progress)."""
        self.watch.wait("the server to exit", cap=cap, need_alive=False).until(
            lambda: self.proc.poll() is not None)
        return self.proc.returncode

    def stop(self, sig=signal.SIGTERM, timeout: Optional[float] = None) -> int:
        """Signal the server and wait for it to exit (SIGKILL if it stops making progress)."""
        if self.proc.poll() is None:
            self.send_signal(sig)
            try:
                self.wait_exit(timeout)
            except TimeoutError:
                self.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        if not self._out.closed:
            self._out.close()
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread like Ctrl-C, so the ``finally`` / ``with`` blocks
    of a script stop the servers (and ``mlx.launch`` jobs) it started: by default a signal
    ends Python at once, and the servers, each in a process group of its own, run on."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def answer(r: Dict[str, Any]):
    """(text, [(step id, [(top id, logprob)...])...], cached tokens) of a response (a step's
    id is the first of its top tokens as mlx-lm lists them, not always the one chosen)."""
    c = r["choices"][0]
    text = c["message"]["content"] if "message" in c else c.get("text", "")
    steps = [(step.get("id"), [(t["id"], t["logprob"]) for t in step.get("top_logprobs", [])])
             for step in (c.get("logprobs") or {}).get("content", [])]
    cached = r.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
    return text, steps, cached


def same_answer(a: Dict[str, Any], b: Dict[str, Any], tol: float = 1e-4) -> None:
    """Same text and, step by step, the same top-5 tokens with the same log-probs (to
    ``tol``), compared by token id: mlx-lm lists a step's top tokens in
    ``argpartition``'s order (and names the step by the first of them), which log-probs
    equal to the last bits can change — as a verify pass of several tokens, summing in
    another order than a one-token step, gives them. A token in one top five and not the
    other is a tie at its edge (within ``tol`` of the other's fifth)."""
    ta, sa, _ = answer(a)
    tb, sb, _ = answer(b)
    assert ta == tb, (ta, tb)
    assert len(sa) == len(sb) and sa, (len(sa), len(sb))
    for (_, ta5), (_, tb5) in zip(sa, sb):
        la, lb = dict(ta5), dict(tb5)
        for x in la.keys() & lb.keys():
            if abs(la[x] - lb[x]) > tol:
                raise AssertionError(f"log-prob {la[x]} vs {lb[x]} (id {x})")
        for one, other in ((la, lb), (lb, la)):
            for x in one.keys() - other.keys():
                assert one[x] <= min(other.values()) + tol, ("not a tie", x, ta5, tb5)
