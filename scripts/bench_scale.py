#!/usr/bin/env python
"""Per-request cache overhead as the trie grows: 10, 100, 1k, 10k nodes.

What a request costs the cache, excluding the model's forward pass: on the request
thread, ``checkout`` (find, restore, pin), ``checkin`` (record, merge, evict) and, with
persistence, the capture of what changed (the thread's CPU time: a busy machine's waits
are not the cache's cost; ``--wall`` for wall-clock); plus the background writer's CPU time; plus
the bytes written to storage per request, read from ``/proc/self/io`` (``write_bytes``:
every byte this process sent towards the disk — snapshot files, the index, its log).

The model is a stub: two tiny KV layers (1 head, 8 dims) whose "forward" appends random
keys and values, so what is measured is the trie and the store, not MLX. Each request is
one of 8 system prompts (16 tokens) plus 24 fresh tokens plus an 8-token answer: one new
node per request. When the trie reaches a size, a window of requests is measured (with a
flush after each, so each write is charged to its request):

* ``free``: the budgets have room;
* ``full``: the memory budget (and with persistence the disk budget) is set to what is
  held now, so every request evicts.

Goal (issue 14): flat within 1.5x from 10 to 10k nodes. Run on any checkout: the script
only uses `PrefixManager`, `PersistentStore` and `Autosaver`.

    python scripts/bench_scale.py                   # 10 .. 10k nodes, ~5-10 min
    python scripts/bench_scale.py --sizes 10 100 1000 --window 20
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

import mlx.core as mx  # noqa: E402

from mlx_kvcache.caches import KVCache, layer_signature  # noqa: E402
from mlx_kvcache.prefix.manager import PrefixManager  # noqa: E402
from mlx_kvcache.store import PersistentStore, disk_usage  # noqa: E402
from mlx_kvcache.store.autosave import Autosaver  # noqa: E402

LAYERS, HEADS, DIM = 2, 1, 8
#: CPU time of the calling thread: the cost itself, not the waits of a busy machine
#: (``--wall`` switches to wall-clock time).
clock = time.thread_time


def write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def forward(live, tokens) -> None:
    """The stub model: every layer absorbs ``tokens`` (random keys and values)."""
    n = len(tokens)
    for c in live.leaves:
        k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
        c.update_and_fetch(k, k)
    mx.eval([c.keys for c in live.leaves])


class Bench:
    def __init__(self, persist: bool, root: Path, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.heads = [[self.rng.randrange(1, 32000) for _ in range(16)] for _ in range(8)]
        self.mgr = PrefixManager(lambda: [KVCache() for _ in range(LAYERS)], max_bytes=1 << 40,
                                 merge_below=0)
        self.store = self.saver = None
        self.writer_cpu = 0.0
        self._mu = threading.Lock()
        if persist:
            self.store = PersistentStore(self.mgr.trie, layer_signature(self.mgr.ops), root,
                                         "b" * 64, None, keep=self.mgr.keep)
            self.mgr.verify = self.store.before_request

            def write(*plan):
                t = time.thread_time()
                try:
                    return self.store.write(*plan)
                finally:
                    with self._mu:
                        self.writer_cpu += time.thread_time() - t
            self.saver = Autosaver(write)

    def nodes(self) -> int:
        return sum(1 for _ in self.mgr.trie.nodes())

    def disk_bytes(self) -> int:
        s = self.store
        return getattr(s, "disk_bytes", None) or disk_usage(s.directory())

    def request(self, flush: bool):
        prompt = self.rng.choice(self.heads) + [self.rng.randrange(1, 32000) for _ in range(24)]
        answer = [self.rng.randrange(1, 32000) for _ in range(8)]
        t0 = clock()
        live, plan = self.mgr.checkout(prompt)
        t1 = clock()
        forward(live, (prompt + answer)[plan.restored:])
        t2 = clock()
        self.mgr.checkin(live, prompt + answer)
        t3 = clock()
        if self.saver is not None:
            self.saver.submit(self.mgr.run(self.store.capture))
        t4 = clock()
        if flush and self.saver is not None:
            self.saver.flush()
        return (t1 - t0) + (t3 - t2), t4 - t3

    def window(self, n: int, warmup: int = 5):
        for _ in range(warmup):  # the first writes after a change of budget settle debts
            self.request(flush=True)
        cpu0 = self.writer_cpu
        io0 = write_bytes()
        trie_ms, capture_ms = [], []
        for _ in range(n):
            a, b = self.request(flush=True)
            trie_ms.append(a * 1e3)
            capture_ms.append(b * 1e3)
        return (statistics.median(trie_ms), statistics.median(capture_ms),
                (self.writer_cpu - cpu0) * 1e3 / n, (write_bytes() - io0) / n)

    def set_full(self, full: bool) -> None:
        if self.saver is not None:
            self.saver.flush()  # what the growth owes is not charged to the window
        if full:
            self.mgr.max_bytes = self.mgr.nbytes
            if self.store is not None:
                self.saver.flush()
                self.store.max_disk_bytes = self.disk_bytes()
        else:
            self.mgr.max_bytes = 1 << 40
            if self.store is not None:
                self.store.max_disk_bytes = None


def run(persist: bool, sizes, window: int) -> list:
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    rows = []
    try:
        b = Bench(persist, root)
        for size in sizes:
            while b.nodes() < size:
                b.request(flush=False)
            for full in (False, True):
                b.set_full(full)
                n = b.nodes()
                rows.append((persist, full, n) + b.window(window))
                b.set_full(False)
        if b.saver is not None:
            b.saver.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--window", type=int, default=30, help="requests measured per size")
    ap.add_argument("--no-persist", action="store_true", help="skip the persistent runs")
    ap.add_argument("--wall", action="store_true", help="wall-clock instead of thread CPU time")
    args = ap.parse_args()
    if args.wall:
        global clock
        clock = time.perf_counter
    mx.random.seed(0)
    print(f"mlx_kvcache from {Path(mlx_kvcache.__file__).parent}")
    print(f"per request ({'wall' if args.wall else 'thread CPU'} time, median of the window; "
          f"writer CPU and bytes: mean), excluding the stub forward: trie = checkout + checkin "
          f"on the request thread; capture = the store's capture there; writer = the "
          f"background writer's CPU; written = /proc/self/io write_bytes")
    print(f"{'persist':>7} {'budget':>6} {'nodes':>6} {'trie ms':>8} {'capture ms':>10} "
          f"{'writer ms':>9} {'written B':>10}")
    results = []
    for persist in ((False,) if args.no_persist else (False, True)):
        for row in run(persist, args.sizes, args.window):
            results.append(row)
            p, full, n, trie, cap, wcpu, wb = row
            print(f"{'yes' if p else 'no':>7} {'full' if full else 'free':>6} {n:>6} "
                  f"{trie:>8.2f} {cap:>10.2f} {wcpu:>9.2f} {wb:>10.0f}", flush=True)
    print("\nratio largest / smallest trie (goal <= 1.5):")
    for persist in sorted({r[0] for r in results}):
        for full in (False, True):
            rs = [r for r in results if r[0] == persist and r[1] == full]
            if len(rs) < 2:
                continue
            lo, hi = rs[0], rs[-1]
            parts = [f"trie {hi[3] / lo[3]:.2f}x"]
            if persist:
                parts += [f"request thread {(hi[3] + hi[4]) / (lo[3] + lo[4]):.2f}x",
                          f"writer {hi[5] / max(lo[5], 1e-9):.2f}x",
                          f"written {hi[6] / max(lo[6], 1):.2f}x"]
            print(f"  persist={'yes' if persist else 'no'} budget={'full' if full else 'free'}: "
                  + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
