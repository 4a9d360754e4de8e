"""`mlx-kvcache serve` starting where it cannot serve, or stopped while it starts: a port
in use is one ``error:`` line and exit 1 before the model loads, and a signal during the
model's load ends the process. Every wait is bounded by the process's progress
(`mlx_kvcache.testing.waits`), never by a guess at how long a start takes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from mlx_kvcache.serving.app import QuietProgress
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import ROOT, free_port
from mlx_kvcache.testing.waits import CAP, Watch

pytestmark = pytest.mark.timeout(CAP)

LOADING = "mlx_kvcache: loading the model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama")


def serve_argv(model, port):
    return [sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(model),
            "--no-persist", "--host", "127.0.0.1", "--port", str(port)]


@pytest.mark.parametrize("embedded", [False, True], ids=["model-dir", "embedded"])
def test_a_port_in_use_is_one_error_line_and_exit_1_before_the_model_loads(model_dir, tmp_path,
                                                                          embedded):
    """Also before the embedded model (or a ``.gguf`` file) is exported to an mlx-lm
    directory, which can take minutes for a big file."""
    port = free_port()
    argv = serve_argv(model_dir, port)
    if embedded:
        argv = [a for a in argv if a not in ("--model", str(model_dir))]
    with socket.socket() as held:  # another server on the port
        held.bind(("127.0.0.1", port))
        held.listen()
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=CAP,
                           cwd=str(ROOT))
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], r.stderr
    assert "already in use" in errors[0] and "--port" in errors[0], errors
    assert "Traceback" not in r.stdout + r.stderr
    assert LOADING not in r.stdout + r.stderr  # found before the model loads
    assert not (tmp_path / "mlx_kvcache" / "models").exists()  # and before any export


def test_bind_and_listen_name_the_address_when_they_cannot():
    """What the server's own bind and listen say (the start checks the port earlier, so
    these meet a port taken in between): a port in use at bind; at listen, a port another
    server bound alike (``SO_REUSEADDR``) and listened on first; a port out of range."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mlx_kvcache.serving.guards.listen import ListenError, bind, listen

    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: address already in use"):
            bind("127.0.0.1", port, ThreadingHTTPServer, 8)
    first = bind("127.0.0.1", port, ThreadingHTTPServer, 8)
    second = bind("127.0.0.1", port, ThreadingHTTPServer, 8)
    try:
        listen(first, BaseHTTPRequestHandler, "127.0.0.1", port)
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: address already in use"):
            listen(second, BaseHTTPRequestHandler, "127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=CAP):
            pass  # the first one listens
    finally:
        first.server_close()
        second.server_close()
    with pytest.raises(ListenError, match="127.0.0.1:70000: a port is a number from 0 to 65535"):
        bind("127.0.0.1", 70000, ThreadingHTTPServer, 8)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_model_load_ends_the_process(model_dir, tmp_path, sig):
    """The weights are a named pipe nobody writes: the load blocks in MLX's reader (holding
    Python's lock) until the process ends, so the signal surely comes during the load."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (blocked / f.name).write_bytes(f.read_bytes())
    os.mkfifo(blocked / "model.safetensors")
    log = tmp_path / "serve.log"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_argv(blocked, free_port()), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
    watch = Watch(proc.pid, log, lambda: log.read_text(errors="replace")[-4000:],
                  alive=lambda: proc.poll() is None)
    try:
        watch.wait("the model load to start").until(lambda: LOADING in watch.tail())
        proc.send_signal(sig)
        # Ended by the signal: the load never returns, so nothing else could end it.
        watch.wait("the process to end", need_alive=False).until(lambda: proc.poll() is not None)
        assert proc.returncode == -sig, watch.tail()
        assert "Starting httpd" not in watch.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_mlx_lm_prefill_progress_lines_are_left_out_of_the_log():
    """mlx-lm logs each prefill chunk of each request at INFO; the server's log leaves
    those out (``--log-level DEBUG`` keeps them), and nothing else."""
    quiet = QuietProgress()

    def record(name, msg):
        return logging.LogRecord(name, logging.INFO, __file__, 1, msg, None, None)

    assert not quiet.filter(record("root", "Prompt processing progress: 2048/9000"))
    assert quiet.filter(record("root", "Starting httpd at 127.0.0.1 on port 8080..."))
    assert quiet.filter(record("mlx_kvcache", "Prompt processing progress is ours to say"))
