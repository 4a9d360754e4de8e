#!/usr/bin/env python
"""Measure what images cost a server's memory (a measurement, not a test).

Starts ``mlx-kvcache serve`` on the test vision model (`testing.vision_dir`: mlx-lm's Muse
Spark, random weights) and prints the server's peak RSS (``VmHWM``, set back to what it
holds before each step through ``/proc/PID/clear_refs``; Linux only) as it answers:

1. under ``--memory-limit 300M``, one 6,000 x 6,000 PNG (~500 MB to decode) on each route,
   then one 512 x 512 PNG (4,096 tokens, ~2 GB for the vision tower to encode);
2. with the default limit, 1, 4 and 8 clients counting a 3,000 x 3,000 PNG at once.

To compare with another checkout, run it with that checkout first on ``PYTHONPATH``.

    python scripts/bench_image_memory.py
"""

from __future__ import annotations

import base64
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx_kvcache
from mlx_kvcache.testing.servers import Server, peak_rss_kib
from mlx_kvcache.testing.vision_dir import black_png, write_vision_dir


def bodies(png: bytes) -> List[Tuple[str, Dict[str, Any]]]:
    """One image and a question, to every route in its own form."""
    b64 = base64.b64encode(png).decode()
    url = "data:image/png;base64," + b64
    anthropic = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "what?"}]}]}
    return [("/v1/messages", anthropic), ("/v1/messages/count_tokens", anthropic),
            ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url},
                {"type": "input_text", "text": "what?"}]}]}),
            ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what?"}]}]})]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_image_memory_"))
    model = write_vision_dir(tmp / "vision")
    print(f"mlx_kvcache from {Path(mlx_kvcache.__file__).parent}")
    with Server.ours(model, tmp / "a.log", tmp, "--no-persist", "--trust-remote-code",
                     "--memory-limit", "300M") as s:
        for side in (6_000, 512):
            for path, body in bodies(black_png(side, side)):
                before = peak_rss_kib(s.proc.pid, reset=True)
                status, out = s.request("POST", path, body)
                grown = (peak_rss_kib(s.proc.pid) - before) / 1024
                print(f"--memory-limit 300M, {side}²: {path}: {status}, peak RSS +{grown:.0f} MiB")
    with Server.ours(model, tmp / "b.log", tmp, "--no-persist", "--trust-remote-code") as s:
        body = dict(bodies(black_png(3_000, 3_000)))["/v1/messages/count_tokens"]
        for n in (1, 4, 8):
            before = peak_rss_kib(s.proc.pid, reset=True)
            with ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda _: s.request("POST", "/v1/messages/count_tokens",
                                                        body), range(n)))
            grown = (peak_rss_kib(s.proc.pid) - before) / 1024
            statuses = sorted({status for status, _ in got})
            print(f"{n} clients counting a 3000² image at once: {statuses}, "
                  f"peak RSS +{grown:.0f} MiB")


if __name__ == "__main__":
    main()
