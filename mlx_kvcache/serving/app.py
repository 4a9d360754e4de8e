"""Running mlx-lm's server with our prompt cache: its options plus ours, its HTTP server
with our handler, and a clean stop (SIGTERM / SIGINT) on every rank.

mlx-lm's own ``run`` has no signal handling: SIGTERM kills it mid-answer and mid-write.
Ours (see `lifecycle`): the first signal stops admitting requests (503), lets the open
ones finish for ``--shutdown-grace`` seconds, then ends what is left properly (a second
signal ends them at once); then a stop command takes every rank's generation thread out of
its loop at the same turn, each rank flushes its cache writes and exits with status 0.
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


#: Listen backlog: a burst of clients connecting at once must not be reset (the standard
#: library's default is 5).
BACKLOG = 1024
#: Seconds the cut answers get to reach their clients.
CUT_WAIT = 5.0


def _gen_wait(grace: float) -> float:
    """Seconds the generation thread gets to take the stop command after the cut (a
    sequential prefill, or a sharded sequential request, runs to its end)."""
    return max(10.0, grace)


def non_negative_float(s: str) -> float:
    import argparse

    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def positive_int(s: str) -> int:
    import argparse

    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _regex(s: str) -> str:
    import argparse
    import re

    try:
        re.compile(s)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return s


def add_options(parser) -> None:
    """Our options, added to mlx-lm's server parser (they show in ``--help``)."""
    from mlx_lm.server import _parse_size

    from ..store import default_root
    from .admin import TOKEN_ENV
    from .lifecycle import DEFAULT_GRACE

    g = parser.add_argument_group(
        "mlx_kvcache", "the prefix-trie prompt cache (replaces mlx-lm's LRU prompt cache; "
        "--prompt-cache-bytes bounds every byte it holds in memory, default half of what the "
        "model leaves of the machine's memory, at most a quarter of it; the cache directory "
        "is a second tier that keeps what memory lets go)")
    g.add_argument("--cache-dir", default=None,
                   help=f"where the prompt cache persists between runs (default: "
                   f"{default_root()})")
    g.add_argument("--no-persist", action="store_true",
                   help="keep the prompt cache in memory only (no disk tier)")
    g.add_argument("--max-disk-bytes", type=_parse_size, default=None,
                   help="disk budget for this model's cache directory (default: a quarter of "
                   "the free disk, at most 32G)")
    g.add_argument("--cold-bits", type=int, choices=(4, 8), default=None,
                   help="write KV snapshots to disk compressed to this many bits: about "
                   "twice (8) or four times (4) the prefixes in the same disk budget, but "
                   "answers restored from disk may differ slightly from a cold run (lossy; "
                   "sliding-window and recurrent states stay exact). Default: exact")
    g.add_argument("--checkpoint-interval", type=positive_int, default=DEFAULT_CHECKPOINT_INTERVAL,
                   help="hybrid (SSM / gated delta net) and sliding-window models also store "
                   "their state every this many prompt tokens, so a prompt that diverges inside "
                   f"a long message restores close to the divergence (default: "
                   f"{DEFAULT_CHECKPOINT_INTERVAL}, one per default prefill chunk)")
    g.add_argument("--dequantize", action="store_true", default=None,
                   help="GGUF models only: dequantize to float (default: on MLX's CPU build)")
    g.add_argument("--shutdown-grace", type=non_negative_float, default=DEFAULT_GRACE,
                   metavar="SECONDS",
                   help="on SIGTERM / SIGINT, open requests get this long to finish before "
                   "their answers are ended (finish_reason \"length\"); a second signal ends "
                   f"them at once (default: {DEFAULT_GRACE:g})")
    g.add_argument("--keep-billing-header", action="store_true",
                   help="agent routes: keep Claude Code's 'x-anthropic-billing-header:' line "
                   "at the top of the system prompt (default: dropped before rendering; it "
                   "differs on every request, so nothing behind it could be reused)")
    g.add_argument("--drop-lines", default=None, metavar="REGEX", type=_regex,
                   help="agent routes: also drop every line of system text that this regular "
                   "expression matches at the line's start (volatile lines: timestamps, "
                   "session ids)")
    g.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="require 'Authorization: Bearer TOKEN' on /v1/cache (default: "
                   f"${TOKEN_ENV}, else none: only requests addressed to this machine, never "
                   "from a web page)")


def run(host: str, port: int, model_provider, server_class=None, handler_class=None) -> None:
    """Stands in for ``mlx_lm.server.run``: same arguments, our cache and handler."""
    from mlx_lm.server import ThreadingHTTPServer

    from ..store import default_root
    from .admin import AdminPolicy
    from .distributed import agreement
    from .generator import ServerResponseGenerator
    from .handler import CacheAPIHandler
    from .lifecycle import Lifecycle
    from .prompt_cache import TriePromptCache
    from .profile import from_env as profile_from_env

    args = model_provider.cli_args
    life = Lifecycle(args.shutdown_grace)
    # Before the model loads: a signal during the load is a stop like any other.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: life.on_signal())
    cache_dir = None if args.no_persist else str(args.cache_dir or default_root())
    profile = profile_from_env()
    agree = agreement(profile)
    sharding = (f"{'pipeline' if args.pipeline else 'tensor'}-{agree.size}-rank{agree.rank}"
                if agree.size > 1 else "")
    cache = TriePromptCache(model_provider, max_bytes=args.prompt_cache_bytes,
                            checkpoint_interval=args.checkpoint_interval, cache_dir=cache_dir,
                            max_disk_bytes=args.max_disk_bytes, max_entries=args.prompt_cache_size,
                            agree=agree, sharding=sharding, cold_bits=args.cold_bits,
                            profile=profile)
    load_default = model_provider.load_default

    def load_then_open_cache():
        # The default model loads in the generation thread before the first request:
        # open its trie (and read the disk index) right then, not on the first request.
        load_default()
        if model_provider.model_key is not None:
            cache.prepare(model_provider.model_key)
    model_provider.load_default = load_then_open_cache
    generator = ServerResponseGenerator(model_provider, cache, lifecycle=life, agree=agree)
    if agree.rank != 0:
        _follow(generator, cache, life)
        return
    handler = type("CacheAPIHandler", (handler_class or CacheAPIHandler,),
                   {"admin": AdminPolicy.make(args.admin_token, host)})
    _serve(host, port, generator, cache, server_class or ThreadingHTTPServer, handler, life)


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # MLX's per-thread state can abort a normal interpreter exit here; all is written.
    os._exit(code)


def _follow(generator, cache, life) -> None:
    """A rank other than 0: no HTTP; its generation thread follows rank 0's requests and
    leaves its loop on rank 0's stop command (a signal here is forwarded to rank 0). Then
    it flushes its cache writes and exits 0; 1 when rank 0 went away or never stopped it."""
    limit = None
    while generator.generation_available():
        time.sleep(0.1)
        if life.signalled_at is not None and limit is None:
            limit = life.signalled_at + life.grace + CUT_WAIT + _gen_wait(life.grace) + 10.0
            log.info("mlx_kvcache: rank stopping (signal): waiting for rank 0's stop")
        if limit is not None and time.monotonic() > limit:
            log.error("mlx_kvcache: rank 0 did not stop this rank in time")
            break
    cache.close(timeout=60)
    code = 0 if life.stopped.is_set() else 1
    log.info("mlx_kvcache: rank %d stopped (exit %d)", generator._rank, code)
    _exit(code)


def _serve(host, port, generator, cache, server_class, handler_class, life) -> None:
    from mlx_lm.server import get_system_fingerprint

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next(iter(infos))
    server_class = type("HTTPServer", (server_class,),
                        {"address_family": family, "request_queue_size": BACKLOG})
    fingerprint = get_system_fingerprint()
    httpd = server_class(address, lambda *a, **k: handler_class(
        generator, *a, system_fingerprint=fingerprint, **k))
    threading.Thread(target=httpd.serve_forever, name="mlx_kvcache-http", daemon=True).start()
    log.info("Starting httpd at %s on port %d...", host, port)
    while not life.asked:
        time.sleep(0.1)
    code = _stop(httpd, generator, cache, life)
    log.info("mlx_kvcache: %sstopped (exit %d)", "rank 0 " if generator._is_distributed else "", code)
    _exit(code)


def _stop(httpd, generator, cache, life) -> int:
    """The stop on rank 0 (see the module doc); returns the exit status."""
    life.stopping.set()
    log.info("mlx_kvcache: stopping: new requests get 503; %d open, %g s to finish "
             "(a second signal ends them now)", life.inflight, life.grace)
    if not life.wait_idle(time.monotonic() + life.grace, interrupt=lambda: life.signals >= 2):
        log.info("mlx_kvcache: ending %d open answers", life.inflight)
        life.cut.set()
        life.wait_idle(time.monotonic() + CUT_WAIT)
    stopped = True
    try:
        generator.command("stop", timeout=_gen_wait(life.grace))
    except TimeoutError:
        stopped = False
        log.warning("mlx_kvcache: the generation thread did not stop in time; exiting")
    except RuntimeError:
        pass  # it had already ended
    httpd.shutdown()
    httpd.server_close()
    log.info("mlx_kvcache: flushing cache writes")
    cache.close(timeout=60)
    sharded = getattr(generator, "_is_distributed", False)
    return 0 if stopped or not sharded else 1  # a rank left behind: the launcher stops it


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
