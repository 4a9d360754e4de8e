"""Server processes on loopback for tests and benchmarks: started on a free port, stopped
by their user, spoken to over HTTP with the standard library; every wait is bounded."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

ROOT = Path(__file__).resolve().parents[2]
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """HTTP to a server on 127.0.0.1:``port`` (standard library only)."""

    port: int

    def wait_healthy(self, timeout: float, alive=lambda: True, tail=lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not alive():
                raise RuntimeError(f"server exited:\n{tail()}")
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start:\n{tail()}")
            time.sleep(0.2)

    def request(self, method: str, path: str, body: Any = None, timeout: float = 120.0,
                raw: Optional[bytes] = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = r.read()
            try:
                return r.status, json.loads(payload)
            except ValueError:
                return r.status, payload
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
                    timeout: float = 120.0, **extra) -> Iterator[Dict[str, Any]]:
        """Server-sent events of a streamed chat; closing early (``stop_after`` chunks) is
        a client disconnecting mid-stream."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, (r.status, r.read())
            n = 0
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
                n += 1
                if stop_after is not None and n >= stop_after:
                    return
        finally:
            conn.close()

    def cache(self) -> Dict[str, Any]:
        status, r = self.request("GET", "/v1/cache")
        assert status == 200, (status, r)
        return r



class Server(Client):
    """One server process (its own process group), logging to ``log``."""

    def __init__(self, argv: List[str], log: Path, home: Path, port: Optional[int] = None,
                 start_timeout: float = 120.0):
        self.port = port or free_port()
        self.log = log
        env = dict(os.environ, XDG_CACHE_HOME=str(home), PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if os.path.exists(BLAS) and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = BLAS  # stock mlx_lm gets the same fast BLAS we preload
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(self.port)], stdin=subprocess.DEVNULL,
            stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
            start_new_session=True)
        try:
            self.wait_healthy(start_timeout, lambda: self.proc.poll() is None, self.tail)
        except Exception:
            self.stop()
            raise

    @classmethod
    def ours(cls, model_dir, log, home, *extra, **kw) -> "Server":
        argv = [sys.executable, "-m", "mlx_kvcache.cli", "serve"]
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
    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._out.close()
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def answer(r: Dict[str, Any]):
    """(text, [(token id, [(top id, logprob)...])...], cached tokens) of a response."""
    c = r["choices"][0]
    text = c["message"]["content"] if "message" in c else c.get("text", "")
    steps = [(step.get("id"), [(t["id"], t["logprob"]) for t in step.get("top_logprobs", [])])
             for step in (c.get("logprobs") or {}).get("content", [])]
    cached = r.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
    return text, steps, cached


def same_answer(a: Dict[str, Any], b: Dict[str, Any], tol: float = 1e-4) -> None:
    """Same text and, step by step, the same top-5 token ids and log-probs (to ``tol``)."""
    ta, sa, _ = answer(a)
    tb, sb, _ = answer(b)
    assert ta == tb, (ta, tb)
    assert len(sa) == len(sb) and sa, (len(sa), len(sb))
    for (ia, ta5), (ib, tb5) in zip(sa, sb):
        assert ia == ib
        for (x, lx), (y, ly) in zip(ta5, tb5):
            if abs(lx - ly) > tol:
                raise AssertionError(f"log-prob {lx} vs {ly} (ids {x}, {y})")
        # Ties at the 5th place may order differently; the distribution is what matters.
        assert {x for x, _ in ta5[:3]} == {y for y, _ in tb5[:3]}
