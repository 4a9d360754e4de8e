#!/usr/bin/env python
"""Measure the memory guard's reservation as an answer decodes (a measurement, not a test).

Starts ``mlx-kvcache serve`` on a small random test model under ``--memory-limit`` (the
first argument, default 64M), streams one chat with a short prompt and ``max_tokens``
32,000 (Claude Code's), and prints, as it decodes, what the guard reserved beside MLX's
active and peak memory (``GET /v1/cache`` → ``memory``), then how the answer ended.

    python scripts/bench_memory_guard.py 64M
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server

MIB = 1 << 20


def main(limit: str = "64M") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_guard_"))
    model = write_model_dir(tmp / "m", "llama", hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=64, num_hidden_layers=4)
    with Server.ours(model, tmp / "serve.log", tmp, "--no-persist", "--memory-limit", limit) as s:
        n, finish, usage = 0, None, None
        for ev in s.stream_chat([{"role": "user", "content": "Hi there"}], max_tokens=32_000):
            for c in ev.get("choices") or []:
                n += 1
                finish = c.get("finish_reason") or finish
            usage = ev.get("usage") or usage
            if n in (1, 300, 1000, 2000, 3000):
                m = s.cache()["memory"]
                print(f"after {n:5d} tokens: reserved {m['reserved_bytes'] / MIB:6.1f} MiB, "
                      f"MLX active {m['active_bytes'] / MIB:6.1f} MiB, "
                      f"peak {m['peak_bytes'] / MIB:6.1f} MiB")
        m = s.cache()["memory"]
        print(f"ended: finish_reason {finish}, usage {usage}; MLX peak "
              f"{m['peak_bytes'] / MIB:.1f} MiB of the {m['limit_bytes'] / MIB:.1f} MiB limit "
              f"(weights {m['weights_bytes'] / MIB:.1f} MiB); ended at the limit: "
              f"{m['ended_at_limit']}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
