"""Waits bounded by progress, not by a guess of how long a machine takes.

A CI runner may be several times slower than a developer's machine, or busy with other
jobs; a fixed timeout either fails there or is so long it hides a hang. A `Watch` follows
a server's process group instead: it is making progress while its log grows or its
processes use CPU (at least `MIN_CPU_SHARE` of a core, well above an idle server's poll);
a wait fails when the server exits, when it has made no progress for `STALL` seconds, or
after the generous overall `CAP`. Both can be raised through the environment
(``MLX_KVCACHE_TEST_STALL``, ``MLX_KVCACHE_TEST_CAP``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

STALL = float(os.environ.get("MLX_KVCACHE_TEST_STALL", "120"))
CAP = float(os.environ.get("MLX_KVCACHE_TEST_CAP", "1800"))
#: CPU use (seconds per second over a window) that counts as working; an idle server
#: polls at about 0.001.
MIN_CPU_SHARE = 0.05
#: Bytes read or written per window that count as working (a hung collective moves none).
MIN_IO = 1024
_WINDOW = 5.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ServerGone(RuntimeError):
    """The server exited while a test waited on it."""


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) processes of the process group ``pgid``."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[2]) == pgid and rest[0] != "Z":
            pids.append(int(d))
    return pids


def group_usage(pgid: int):
    """(CPU seconds, bytes read and written) used so far by the live members of ``pgid``."""
    ticks = io = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            ticks += int(rest[11]) + int(rest[12])
            with open(f"/proc/{pid}/io") as f:
                fields = dict(line.split(": ", 1) for line in f.read().splitlines())
            io += int(fields["rchar"]) + int(fields["wchar"])
        except (OSError, IndexError, KeyError, ValueError):
            continue
    return ticks / _TICK, io


class Watch:
    """A server's signs of life: its process group and its log.

    Args:
        pgid: the server's process group.
        log: its log file.
        tail: the end of its output, for error messages.
        alive: whether the server still runs (cheap: polled every tick).
        cpu_counts: CPU use counts as progress (not for ``mlx.launch`` ranks, which spin).
    """

    def __init__(self, pgid: int, log: Path, tail: Callable[[], str],
                 alive: Optional[Callable[[], bool]] = None, cpu_counts: bool = True) -> None:
        self.pgid, self.log, self.tail, self.cpu_counts = pgid, Path(log), tail, cpu_counts
        self._alive = alive or (lambda: bool(group_members(pgid)))

    def alive(self) -> bool:
        return self._alive()

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def usage(self):
        """(CPU seconds, bytes read and written) of the group so far (a scan of /proc)."""
        return group_usage(self.pgid)

    def wait(self, what: str, stall: Optional[float] = None, cap: Optional[float] = None,
             need_alive: bool = True) -> "Wait":
        return Wait(self, what, STALL if stall is None else stall, CAP if cap is None else cap,
                    need_alive)


class Wait:
    """One wait on a `Watch`: call `tick` while waiting; it raises when the wait is over."""

    def __init__(self, watch: Watch, what: str, stall: float, cap: float, need_alive: bool):
        self.watch, self.what, self.stall, self.cap, self.need_alive = (
            watch, what, stall, cap, need_alive)
        self.start = self.progress_at = self.window_at = time.monotonic()
        self.size = watch.log_size()
        self.window_cpu, self.window_io = watch.usage()

    def tick(self) -> None:
        t, size = time.monotonic(), self.watch.log_size()
        if size > self.size:
            self.size, self.progress_at = size, t
        if t - self.window_at >= _WINDOW:  # the /proc scan, once a window
            cpu, io = self.watch.usage()
            busy = self.watch.cpu_counts and cpu - self.window_cpu >= MIN_CPU_SHARE * (t - self.window_at)
            if busy or io - self.window_io >= MIN_IO:
                self.progress_at = t
            self.window_at, self.window_cpu, self.window_io = t, cpu, io
        if self.need_alive and not self.watch.alive():
            raise ServerGone(f"{self.what}: the server exited\n{self.watch.tail()}")
        if t - self.progress_at > self.stall:
            raise TimeoutError(f"{self.what}: no progress (log, I/O or CPU) for {self.stall:g} s\n"
                               f"{self.watch.tail()}")
        if t - self.start > self.cap:
            raise TimeoutError(f"{self.what}: still going after {self.cap:g} s\n{self.watch.tail()}")

    def until(self, cond: Callable[[], Any], poll: float = 0.1) -> Any:
        """Poll ``cond`` until it returns something true (returned)."""
        while True:
            v = cond()
            if v:
                return v
            self.tick()
            time.sleep(poll)


def call(fn: Callable[[], Any], wait: Optional[Wait], sock: Callable[[], Optional[socket.socket]]) -> Any:
    """``fn()`` (blocking I/O) run in a thread while ``wait`` ticks; when the wait fails the
    socket ``sock()`` is shut down so the thread ends, and the wait's error is raised."""
    if wait is None:
        return fn()
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.2)
            if t.is_alive():
                wait.tick()
    except BaseException:
        s = sock()
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        t.join(5)
        raise
    if "error" in box:
        raise box["error"]
    return box.get("value")
