"""Running mlx-lm's server with our prompt cache: its options plus ours, its HTTP server
with our handler, and a clean stop (SIGTERM / SIGINT) that flushes the disk tier.

mlx-lm's own ``run`` has no signal handling (SIGTERM kills it mid-write) and its
interpreter exit can abort; ours stops the HTTP server, lets the generation thread finish
(bounded), waits for the background writes, then exits with status 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("mlx_kvcache")

#: Default checkpoint interval: one per default prefill chunk (2048 tokens) — a recurrent
#: state is megabytes per layer on real hybrid models, so denser is rarely worth it.
DEFAULT_CHECKPOINT_INTERVAL = 2048


def positive_int(s: str) -> int:
    import argparse

    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_options(parser) -> None:
    """Our options, added to mlx-lm's server parser (they show in ``--help``)."""
    from mlx_lm.server import _parse_size

    from ..store import default_root

    g = parser.add_argument_group(
        "mlx_kvcache", "the prefix-trie prompt cache (replaces mlx-lm's LRU prompt cache; "
        "--prompt-cache-bytes bounds every byte it holds, default 20% of memory)")
    g.add_argument("--cache-dir", default=None,
                   help=f"where the prompt cache persists between runs (default: "
                   f"{default_root()})")
    g.add_argument("--no-persist", action="store_true", help="keep the prompt cache in memory only")
    g.add_argument("--max-disk-bytes", type=_parse_size, default=None,
                   help="disk budget for this model's persisted cache (default: no limit)")
    g.add_argument("--checkpoint-interval", type=positive_int, default=DEFAULT_CHECKPOINT_INTERVAL,
                   help="hybrid (SSM / gated delta net) and sliding-window models also store "
                   "their state every this many prompt tokens, so a prompt that diverges inside "
                   f"a long message restores close to the divergence (default: "
                   f"{DEFAULT_CHECKPOINT_INTERVAL}, one per default prefill chunk)")
    g.add_argument("--dequantize", action="store_true", default=None,
                   help="GGUF models only: dequantize to float (default: on MLX's CPU build)")


def run(host: str, port: int, model_provider, server_class=None, handler_class=None) -> None:
    """Stands in for ``mlx_lm.server.run``: same arguments, our cache and handler."""
    from mlx_lm.server import ThreadingHTTPServer

    from ..store import default_root
    from ..prefix.manager import default_max_bytes
    from .distributed import agreement
    from .generator import CheckpointingResponseGenerator
    from .handler import CacheAPIHandler
    from .prompt_cache import TriePromptCache

    args = model_provider.cli_args
    cache_dir = None if args.no_persist else str(args.cache_dir or default_root())
    max_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else default_max_bytes()
    agree = agreement()
    sharding = (f"{'pipeline' if args.pipeline else 'tensor'}-{agree.size}-rank{agree.rank}"
                if agree.size > 1 else "")
    cache = TriePromptCache(model_provider, max_bytes=max_bytes,
                            checkpoint_interval=args.checkpoint_interval, cache_dir=cache_dir,
                            max_disk_bytes=args.max_disk_bytes, max_entries=args.prompt_cache_size,
                            agree=agree, sharding=sharding)
    load_default = model_provider.load_default

    def load_then_open_cache():
        # The default model loads in the generation thread before the first request:
        # open its trie (and read the disk index) right then, not on the first request.
        load_default()
        if model_provider.model_key is not None:
            cache.prepare(model_provider.model_key)
    model_provider.load_default = load_then_open_cache
    generator = CheckpointingResponseGenerator(model_provider, cache)
    if agree.rank != 0:
        _follow(generator, cache)
        return
    _serve(host, port, generator, cache, server_class or ThreadingHTTPServer,
           handler_class or CacheAPIHandler)


def _follow(generator, cache) -> None:
    """A rank other than 0: no HTTP; its generation thread follows rank 0's requests. On
    SIGTERM / SIGINT (the launcher stops every rank) it flushes its cache writes and exits."""
    def stop(signum, frame):
        log.info("mlx_kvcache: rank stopping (signal %d): flushing cache writes", signum)
        cache.close(timeout=60)
        logging.shutdown()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while generator.generation_available():
        time.sleep(0.5)
    cache.close(timeout=60)
    logging.shutdown()
    os._exit(1)  # the generation thread ended without a signal: rank 0 is gone


def _serve(host, port, generator, cache, server_class, handler_class) -> None:
    from mlx_lm.server import get_system_fingerprint

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    server_class.address_family, _, _, _, address = next(iter(infos))
    fingerprint = get_system_fingerprint()
    httpd = server_class(address, lambda *a, **k: handler_class(
        generator, *a, system_fingerprint=fingerprint, **k))
    stopping = threading.Event()

    def stop(signum, frame):
        if not stopping.is_set():
            stopping.set()
            log.info("mlx_kvcache: stopping (signal %d): finishing requests and cache writes", signum)
            threading.Thread(target=httpd.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("Starting httpd at %s on port %d...", host, port)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        t = threading.Thread(target=generator.stop_and_join, daemon=True)
        t.start()
        t.join(timeout=10)  # a sequential request in flight does not look at the stop flag
        cache.close(timeout=60)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # MLX's per-thread state can abort a normal interpreter exit here; all is written.
        os._exit(0)


def main(argv) -> int:
    """Run mlx-lm's server with our prompt cache on ``argv`` (its options and ours; the
    model already an mlx-lm directory or hub id). Returns an exit code."""
    from mlx_lm import server as S

    from . import seam

    try:
        note = seam.check()
    except seam.SeamError as e:
        sys.stderr.write(f"error: mlx-kvcache serve cannot run on this mlx-lm: {e}\n")
        return 2
    if note:
        sys.stderr.write(f"note: {note}\n")
    with seam.patched(add_options, run, ["mlx-kvcache serve", *argv]):
        S.main()
    return 0
