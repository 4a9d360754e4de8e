#!/usr/bin/env python
"""Measure what hostile clients cost a server (a measurement, not a test).

Starts ``mlx-kvcache serve`` on a small test model and prints:

1. the server's peak RSS (``VmHWM``, set back to what it holds before each step through
   ``/proc/PID/clear_refs``; Linux only) as it answers six valid 4 MiB ``/v1/messages``
   bodies at once whose ignored field holds empty JSON objects, then a 60 MiB one (with
   ``--body-budget 512M`` and with the default budget);
2. with 2,100 idle connections open (half a request line each: more than mlx-lm's 2,048
   descriptors), how long an ``openai`` SDK client on loopback waits for its answer, and
   how many idle connections were closed to make room.

To compare with another checkout, run it with that checkout first on ``PYTHONPATH``
(options it does not know are left out: the script says so).

    python scripts/bench_hostile_clients.py
"""

from __future__ import annotations

import json
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import List

import mlx_kvcache
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server, peak_rss_kib

IDLE = 2100


def junk_body(mib: float) -> bytes:
    """A valid /v1/messages body whose ignored field holds ``mib`` MiB of ``{}``."""
    n = int(mib * (1 << 20)) // 3
    head = json.dumps({"model": "m", "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hi"}]})[:-1]
    return head.encode() + b', "junk": [' + b",".join([b"{}"] * n) + b"]}"


def knows(option: str) -> bool:
    """Whether this checkout's server takes ``option``."""
    from mlx_kvcache.serving import app

    return option in Path(app.__file__).read_text()


def bodies(model: Path, tmp: Path, *extra: str) -> None:
    with Server.ours(model, tmp / "bodies.log", tmp, "--no-persist", *extra) as s:
        pid = s.proc.pid
        body = junk_body(4)
        before = peak_rss_kib(pid, reset=True)
        results: List[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            s.request("POST", "/v1/messages", raw=body)[0])) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"  six 4 MiB bodies at once: {sorted(results)}; peak RSS "
              f"{before >> 10} -> {peak_rss_kib(pid) >> 10} MiB")
        big = junk_body(60)
        before = peak_rss_kib(pid, reset=True)
        status, _ = s.request("POST", "/v1/messages", raw=big)
        print(f"  60 MiB body: {status}; peak RSS {before >> 10} -> {peak_rss_kib(pid) >> 10} MiB")


def idle(model: Path, tmp: Path) -> None:
    import openai

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    with Server.ours(model, tmp / "idle.log", tmp, "--no-persist") as s:
        try:
            t0 = time.monotonic()
            for _ in range(IDLE):
                c = socket.create_connection(("127.0.0.1", s.port))
                c.sendall(b"POST /v1/chat/compl")
                socks.append(c)
            print(f"  {IDLE} idle connections opened in {time.monotonic() - t0:.1f} s")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="k",
                                   max_retries=0, timeout=120)
            t0 = time.monotonic()
            try:
                client.chat.completions.create(model="m", max_tokens=2, messages=[
                    {"role": "user", "content": "Hello"}])
                print(f"  the SDK client's answer after {time.monotonic() - t0:.2f} s")
            except openai.APIError as e:
                print(f"  the SDK client failed after {time.monotonic() - t0:.1f} s: {e!r}")
            time.sleep(1)
            closed = 0
            for c in socks:
                try:
                    closed += c.recv(1, socket.MSG_DONTWAIT) != b"x"
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            print(f"  idle connections closed by the server: {closed}")
        finally:
            for c in socks:
                c.close()


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_hostile_"))
    model = write_model_dir(tmp / "model", "llama")
    print(f"mlx_kvcache from {Path(mlx_kvcache.__file__).parent}")
    if knows("--body-budget"):
        print("--body-budget 512M:")
        bodies(model, tmp, "--body-budget", "512M")
    print("default options:")
    bodies(model, tmp)
    print("idle connections:")
    idle(model, tmp)


if __name__ == "__main__":
    main()
