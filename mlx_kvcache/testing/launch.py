"""``mlx.launch`` jobs on loopback for tests and benchmarks: one process group, waits
bounded by the job's progress (`waits`), nothing left behind.

The launcher starts every rank as its child; signalled alone it dies and leaves the ranks
running, so a job is its own process group (``start_new_session``). A stop signals the
ranks (the launcher then exits on its own and keeps relaying their output to the end),
then the whole group if anything is left, SIGKILL once nothing progresses, and checks
through ``/proc`` until no member is left. The ring backend needs one free port per rank.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .servers import BLAS, ROOT, Client, free_port
from .waits import Watch, group_members


def free_port_block(n: int, lo: int = 20000, hi: int = 60000) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    start = random.randrange(lo, hi - n)
    for base in list(range(start, hi - n)) + list(range(lo, start)):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


class Launch:
    """``mlx.launch -n N --backend ring -- COMMAND`` as one process group."""

    def __init__(self, command: Sequence[str], n: int = 2, env: Optional[Dict[str, str]] = None):
        self.n = n
        self.tmp = Path(tempfile.mkdtemp(prefix="mlxlaunch-"))
        # The ranks' temporary directory is the launch's own, but MLX keeps the CPU kernels
        # it compiles (g++, seconds each) under $TMPDIR/mlx: share the usual one, so a
        # launch does not compile them all again.
        kernels = Path(tempfile.gettempdir()) / "mlx"
        kernels.mkdir(exist_ok=True)
        (self.tmp / "mlx").symlink_to(kernels, target_is_directory=True)
        self.log = self.tmp / "ranks.log"
        e = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp), **(env or {}))
        if os.path.exists(BLAS):
            e.setdefault("LD_PRELOAD", BLAS)
        launcher = str(Path(sys.executable).with_name("mlx.launch"))
        argv = [launcher, "-n", str(n), "--backend", "ring",
                "--starting-port", str(free_port_block(n)), "--", *command]
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT, env=e, cwd=str(ROOT),
                                     start_new_session=True)
        self.pgid = self.proc.pid
        # The launcher lives while every rank does (it stops the job when one fails). The
        # ranks spin in their collectives: their CPU use is no sign of progress.
        self.watch = Watch(self.pgid, self.log, self.output,
                           alive=lambda: self.proc.poll() is None, cpu_counts=False)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def members(self) -> List[int]:
        """Live (non-zombie) processes of the job's group."""
        return group_members(self.pgid)

    def ranks(self) -> List[int]:
        """The rank processes (the group without the launcher)."""
        return [p for p in self.members() if p != self.proc.pid]

    def signal_ranks(self, sig=signal.SIGTERM) -> None:
        for pid in self.ranks():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, sig=signal.SIGTERM) -> None:
        """Signal the ranks and wait for the job to end; then the whole group; SIGKILL
        what is left once it stops making progress."""
        if self.members():
            self.signal_ranks(sig)
            try:
                self.watch.wait("the job to end", need_alive=False).until(lambda: not self.members())
            except TimeoutError:
                pass
        for s in (sig, signal.SIGKILL):
            if not self.members():
                break
            try:
                os.killpg(self.pgid, s)
            except ProcessLookupError:
                break
            try:
                self.watch.wait("the job to end", need_alive=False, stall=30).until(
                    lambda: not self.members())
            except TimeoutError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        if not self._out.closed:
            self._out.close()
        if self.members():  # pragma: no cover
            raise RuntimeError(f"process group {self.pgid} survived SIGKILL")

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self.cleanup()


class LaunchedServer(Client):
    """``mlx-kvcache serve`` (or ``mlx_lm server``) on ``n`` ranks; rank 0 speaks HTTP."""

    def __init__(self, model_dir, *extra: str, n: int = 2, stock: bool = False,
                 home: Optional[Path] = None, start_timeout: Optional[float] = None,
                 program: Optional[Sequence[str]] = None):
        self.port = free_port()
        cmd = (list(program) if program is not None  # e.g. a stock server that logs more
               else [sys.executable, "-m", "mlx_lm", "server"] if stock
               else [sys.executable, "-m", "mlx_kvcache.cli", "serve"])
        cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), *extra]
        env = {"XDG_CACHE_HOME": str(home)} if home is not None else {}
        self.job = Launch(cmd, n=n, env=env)
        self.watch = self.job.watch
        try:
            self.wait_healthy(start_timeout)
        except Exception:
            self.job.stop()
            raise

    def cache_lines(self) -> Dict[int, List[Dict[str, int]]]:
        """Each rank's per-request log lines: prompt, cached and prefilled tokens."""
        out: Dict[int, List[Dict[str, int]]] = {}
        for m in re.finditer(r"\[cache\] rank (\d+) \| prompt (\d+) tok \| cached (\d+) \| "
                             r"prefilled (\d+)", self.job.output()):
            out.setdefault(int(m.group(1)), []).append(
                {"prompt": int(m.group(2)), "cached": int(m.group(3)), "prefilled": int(m.group(4))})
        return out

    def wait_for_lines(self, count: int) -> Dict[int, List[Dict[str, int]]]:
        """`cache_lines` once every rank has logged ``count`` requests (a request's line is
        written at its final insert, just after its answer went out)."""
        def enough():
            lines = self.cache_lines()
            ok = len(lines) == self.job.n and all(len(v) >= count for v in lines.values())
            return lines if ok else None
        return self.watch.wait(f"{count} cache lines from every rank").until(enough)

    def stop(self, sig=signal.SIGTERM) -> None:
        self.job.stop(sig)

    def __enter__(self) -> "LaunchedServer":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.job.stop()
        finally:
            self.job.cleanup()
