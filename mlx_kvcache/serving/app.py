"""Running mlx-lm's server with our prompt cache: its options plus ours, its HTTP server
with our handler, and a clean stop (SIGTERM / SIGINT) on every rank.

mlx-lm's own ``run`` has no signal handling: SIGTERM kills it mid-answer and mid-write.
Ours (see `lifecycle`): the first signal stops admitting requests (503), lets the open
ones finish for ``--shutdown-grace`` seconds, then ends what is left properly (a second
signal ends them at once); then a stop command takes every rank's generation thread out of
its loop at the same turn, each rank flushes its cache writes and exits with status 0.

Before that, while the model loads, a signal ends the process at once (the system's
default action): the load runs in MLX's C++ holding Python's lock (a weights read that
blocks blocks every Python thread), so a Python handler would run only once the load
ended, and nothing has been served or is being written that a stop would have to finish.
The address is bound before the load (`listen`): a port in use is one line and exit 1
then, and any failure from there on exits too, never leaving the process to mlx-lm's
generation thread, which would keep it alive for good.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

from .guards.lifecycle import exit_now

log = logging.getLogger("mlx_kvcache")

#: Default checkpoint interval: one per default prefill chunk (2048 tokens) — a recurrent
#: state is megabytes per layer on real hybrid models, so denser is rarely worth it.
DEFAULT_CHECKPOINT_INTERVAL = 2048


#: Listen backlog: a burst of clients connecting at once must not be reset (the standard
#: library's default is 5).
BACKLOG = 1024
#: Seconds the cut answers get to reach their clients.
CUT_WAIT = 5.0


class QuietProgress(logging.Filter):
    """Leaves out mlx-lm's "Prompt processing progress: n/m" (INFO, one line per prefill
    chunk of every request), which buries the server's own lines; ``--log-level DEBUG``
    shows them again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root"
                    and str(record.msg).startswith("Prompt processing progress"))


class ToolsWarning(logging.Filter):
    """Leaves out mlx-lm's "Received tools but model does not support tool calling" where
    the served model's calls are read by one of our parsers (harmony, Llama 3, DeepSeek):
    mlx-lm's tokenizer knows no tool-call markup for them, ours does."""

    def __init__(self, generator) -> None:
        super().__init__()
        self._generator = generator

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "root" or not str(record.msg).startswith(
                "Received tools but model does not support tool calling"):
            return True
        served = self._generator.served()
        return served is None or served.parser.mlx_lm


def _gen_wait(grace: float) -> float:
    """Seconds the generation thread gets to take the stop command after the cut and end
    (a sequential prefill, or a sharded sequential request, runs to its end)."""
    return max(10.0, grace)


def non_negative_float(s: str) -> float:
    import argparse

    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def admin_token(s: str) -> str:
    """``--admin-token`` (and ``$MLX_KVCACHE_ADMIN_TOKEN``, its default): never empty."""
    import argparse

    from .guards.admin import checked_token

    try:
        return checked_token(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(low: int):
    """An argparse type: an integer, at least ``low``."""
    def parse(s: str) -> int:
        import argparse

        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def _regex(s: str) -> str:
    import argparse
    import re

    try:
        re.compile(s)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return s


def add_options(parser) -> None:
    """Our options, added to mlx-lm's server parser (they show in ``--help``). Every byte
    size, mlx-lm's ``--prompt-cache-bytes`` included, is read as the chat command reads it
    (`parse_bytes`: 512M, 4G, 4GB, 2GiB; mlx-lm's own reader knows only M/G/MB/GB, all
    decimal, and raises a traceback on anything else)."""
    from ..generation.draft_length import POLICIES
    from ..generation.lookup import DEFAULT_MOST
    from ..prefix.stats import parse_bytes
    from ..store import default_root
    from .guards.admin import TOKEN_ENV
    from .guards.context import mark_default_max_tokens
    from .guards.lifecycle import DEFAULT_GRACE
    from .guards.images import DEFAULT_MAX_PIXELS
    from .guards.memory import DEFAULT_WAIT, SHARE
    from .guards.connections import HEADER_TIMEOUT
    from .routes.body import BODY_TIMEOUT, MAX_BODY_BYTES

    g = parser.add_argument_group(
        "mlx_kvcache", "the prefix-trie prompt cache (replaces mlx-lm's LRU prompt cache; "
        "--prompt-cache-bytes bounds every byte it holds in memory, default half of what the "
        "model leaves of the machine's memory, at most a quarter of it; the cache directory "
        "is a second tier that keeps what memory lets go; --kv-bits quantizes only the tokens "
        "from --quantized-kv-start on, 5000 by default: shorter prompts stay full precision)")
    # argparse has no public lookup of an option's action; mlx-lm's must read sizes as ours.
    theirs = parser._option_string_actions.get("--prompt-cache-bytes")
    if theirs is not None:
        theirs.type, theirs.metavar = parse_bytes, "SIZE"
        theirs.help = ("memory budget for the prompt cache, e.g. 512M or 4G (K/M/G: powers of "
                       "1024; KB/MB/GB: of 1000)")
    g.add_argument("--max-cache-bytes", dest="prompt_cache_bytes", type=parse_bytes,
                   default=None, metavar="SIZE",
                   help="same as --prompt-cache-bytes (the chat command's other name for it)")
    g.add_argument("--cache-dir", default=None,
                   help=f"where the prompt cache persists between runs (default: "
                   f"{default_root()})")
    g.add_argument("--no-persist", action="store_true",
                   help="keep the prompt cache in memory only (no disk tier)")
    g.add_argument("--max-disk-bytes", type=parse_bytes, default=None, metavar="SIZE",
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
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the id GET /v1/models lists for the served model (default: the "
                   "--model repo id or directory; the embedded model: SmolLM2-135M-Instruct). "
                   "A request naming any other model without a '/' is answered by the served "
                   "model")
    g.add_argument("--allow-model-switch", action="store_true",
                   help="let a request name another model to load in place of the served one "
                   "(a local path or a Hugging Face repo id, as 'model' or 'draft_model'): it "
                   "never runs its own code, whatever --trust-remote-code says, and such a "
                   "name tells the client which directories hold models. Default: a request "
                   "naming a model with a '/' that is not the served one gets a 404")
    g.add_argument("--switch-model", action="append", default=None, metavar="MODEL",
                   help="a model requests may switch to by naming it exactly as given here "
                   "(repeatable; GET /v1/models lists it); like --model and --draft-model it "
                   "runs its own code under --trust-remote-code")
    g.add_argument("--context-length", type=positive_int, default=None, metavar="TOKENS",
                   help="the model's context length: a longer prompt gets a 400, an answer "
                   "never runs past it, and an agent request without max_tokens (Codex sends "
                   "none) may answer up to what the prompt leaves of it, unless --max-tokens "
                   "is given (default: the model config's max_position_embeddings or alike)")
    mark_default_max_tokens(parser)
    g.add_argument("--keep-billing-header", action="store_true",
                   help="agent routes: keep Claude Code's 'x-anthropic-billing-header:' line "
                   "at the top of the system prompt (default: dropped before rendering; it "
                   "differs on every request, so nothing behind it could be reused)")
    g.add_argument("--drop-lines", default=None, metavar="REGEX", type=_regex,
                   help="agent routes: also drop every line of system text that this regular "
                   "expression matches at the line's start (volatile lines: timestamps, "
                   "session ids)")
    g.add_argument("--no-foresight", dest="foresight", action="store_false",
                   help="agent routes: do not compute a session's next prompt (this answer "
                   "as the client returns it, then the opening of a tool result or user "
                   "message, as the chat template renders them) while the server is idle "
                   "(default: computed ahead, lowest priority; docs/agents.md)")
    g.add_argument("--no-share-in-flight", dest="share_in_flight", action="store_false",
                   help="compute every request's prompt for itself, even where another request "
                   "is computing the same prefix right now (default: a request sharing a prefix "
                   "in flight waits for it to be stored and reads it; docs/request-path.md)")
    g.add_argument("--keep-reasoning", action="store_true",
                   help="agent routes: render earlier assistant turns with their reasoning "
                   "as generated (the template's preserve_thinking / clear_thinking switches "
                   "where it has them); this changes what the model sees (docs/agents.md). "
                   "Per request: keep_reasoning")
    # The variable is the default, so argparse checks it like the flag (an empty one is
    # refused at start, with the flag's error).
    g.add_argument("--admin-token", type=admin_token, default=os.environ.get(TOKEN_ENV),
                   metavar="TOKEN",
                   help="require 'Authorization: Bearer TOKEN' on /v1/cache (default: "
                   f"${TOKEN_ENV}, else none: only clients on this machine's loopback, never "
                   "a web page)")
    g.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="keep MLX's active memory (weights, the batch's caches, the prompt "
                   "cache) under this: a request is admitted on its prompt and its first "
                   "answer tokens, its reservation grows as it decodes (the newest answer "
                   "ends with finish_reason length where memory does); one that would cross "
                   "it waits (the prompt cache gives way first; a smaller one may go first), "
                   "or gets 503 after --memory-wait; one that can never fit gets 400 at "
                   "once. 0: no limit. "
                   f"Default: {SHARE * 100:.0f}%% of the machine's memory (more when the model takes "
                   "more: the model and half of what it leaves)")
    g.add_argument("--memory-wait", type=non_negative_float, default=DEFAULT_WAIT,
                   metavar="SECONDS",
                   help="how long a request waits for memory before its 503 (default: "
                   f"{DEFAULT_WAIT:g})")
    g.add_argument("--draft-policy", choices=POLICIES, default="adaptive",
                   help="with --draft-model: adaptive (default) drafts each step only as many "
                   "of --num-draft-tokens as pay for themselves, given the draft's size and "
                   "how often the model accepts its tokens (a draft as large as the model "
                   "is not used at all); fixed: --num-draft-tokens every step, as mlx-lm. "
                   "Answers are the same")
    g.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                   help="decode without prompt lookup (on by default: where an answer repeats "
                   "text of its context — an edit quoting code, a file rewritten — the model "
                   "verifies several copied tokens in one pass; answers are the same, and a "
                   "request whose text is not copied decodes as without it). A request may "
                   "set its own prompt_lookup_num_tokens (0: off)")
    g.add_argument("--prompt-lookup-num-tokens", type=non_negative_int, default=DEFAULT_MOST,
                   metavar="N",
                   help=f"the most tokens prompt lookup proposes per step (default {DEFAULT_MOST}; "
                   "fewer where they would not pay)")
    g.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs that clients send (default: refused with a "
                   "400; data: URLs are always read). A server that fetches client URLs can be "
                   "made to reach any address it can")
    g.add_argument("--max-image-pixels", type=non_negative_int, default=DEFAULT_MAX_PIXELS,
                   metavar="N",
                   help="refuse an image whose header says more pixels than this, before "
                   f"decoding it (default: {DEFAULT_MAX_PIXELS}; 0: no cap)")
    g.add_argument("--max-body-bytes", type=parse_bytes, default=MAX_BODY_BYTES, metavar="SIZE",
                   help="refuse a request body larger than this with a 413 "
                   f"({MAX_BODY_BYTES >> 20} MiB by default)")
    g.add_argument("--body-timeout", type=non_negative_float, default=BODY_TIMEOUT,
                   metavar="SECONDS",
                   help="a request's whole body must arrive within this many seconds of its "
                   f"headers, else a 408 (a deadline, not a timeout per read; default: "
                   f"{BODY_TIMEOUT:g}; 0: none)")
    g.add_argument("--header-timeout", type=non_negative_float, default=HEADER_TIMEOUT,
                   metavar="SECONDS",
                   help="a connection's request line and headers must arrive within this many "
                   f"seconds, else a 408 and it is closed (default: {HEADER_TIMEOUT:g}; 0: none)")
    g.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="the most connections open at once; past it a new connection takes "
                   "the place of the one that has waited longest for its request line and "
                   "headers, or gets a 503; clients off loopback hold at most seven eighths "
                   "(default: the open-file limit, raised to its hard limit at start, less "
                   "512, at most 1024)")
    g.add_argument("--body-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory for request bodies: their bytes as they arrive and an upper "
                   "bound of what parsing each can build (its size, its characters' width and "
                   "how many JSON values it can hold), held until each request ends. A body "
                   "that alone needs more gets a 413, one that does not fit beside the others "
                   "before --body-timeout a 503; clients off loopback hold at most seven "
                   "eighths (by default 1G, at most an eighth of the machine's memory)")
    g.add_argument("--prompt-excerpts", choices=("auto", "on", "off"), default="auto",
                   help="show prompt text around where reuse stopped (GET /v1/cache 'recent' "
                   "and the log lines); off: offsets and reasons only. auto (default): off when "
                   "--host reaches beyond loopback without an admin token")
    g.add_argument("--cache-namespace-by", choices=("request", "api-key"), default="request",
                   help="keep clients' cached prompts apart (no client's cache then shortens "
                   "another's prompt, so cached_tokens cannot reveal it): request (default): "
                   "a request's 'cache_salt' field or X-Cache-Namespace header names its "
                   "namespace, none: the shared cache; api-key: also, without those, its API "
                   "key (Authorization: Bearer / x-api-key, hashed, never stored)")


def excerpts_shown(choice: str, host: str, token: Optional[str]) -> bool:
    """``--prompt-excerpts``: ``auto`` shows them unless the server listens beyond loopback
    without an admin token (then ``GET /v1/cache`` is closed to other machines, but its
    log may be read by others on a shared host or collected off it)."""
    from .guards.admin import listens_beyond_loopback

    if choice != "auto":
        return choice == "on"
    return token is not None or not listens_beyond_loopback(host)


def run(host: str, port: int, model_provider, server_class=None, handler_class=None) -> None:
    """Stands in for ``mlx_lm.server.run``: same arguments, our cache and handler."""
    from mlx_lm.server import ThreadingHTTPServer

    from ..store import default_root
    from .guards.admin import AdminPolicy, listens_beyond_loopback
    from .routes.namespace import sharing_note
    from .cache.agreement import agreement
    from .engine.draft_use import install as install_draft_use
    from .engine.generator import ServerResponseGenerator
    from .routes.agents import post_routes
    from .routes.handler import CacheAPIHandler
    from .guards.lifecycle import Lifecycle
    from .routes.model_names import batch_key, install as install_model_names, switch_note
    from .cache.prompt_cache import TriePromptCache
    from .cache.profile import from_env as profile_from_env
    from .guards.sharding import sharding_problem
    from ..caches import make_prompt_cache
    from ..generation.sizing import memory_bytes
    from .guards.images import image_probe
    from .guards.counters import GuardCounters
    from .guards.footprint import measure
    from .guards.memory import MemoryGuard
    from .seam import DraftLoadError
    from .guards.startup import StartCheck, first_line, kv_quant_problem
    from .guards import listen as listener
    from .guards.log_text import escape_handlers

    args = model_provider.cli_args
    counted = GuardCounters()  # the guards' refusals and queue wait (GET /metrics)
    life = Lifecycle(args.shutdown_grace, counted)
    if str(getattr(args, "log_level", "INFO")).upper() != "DEBUG":
        logging.getLogger().addFilter(QuietProgress())
    escape_handlers(logging.getLogger())  # client text never forges a line (`log_text`)
    # Until the model is ready a signal ends the process at once (see the module doc).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    cache_dir = None if args.no_persist else str(args.cache_dir or default_root())
    profile = profile_from_env()
    agree = agreement(profile)
    if agree.size > 1:  # every rank reads the same config: all refuse alike, before serving
        problem = sharding_problem(args.model, agree.size, bool(args.pipeline),
                                   bool(getattr(args, "trust_remote_code", False)))
        if problem:
            sys.stderr.write(f"error: rank {agree.rank}: {problem}\n")
            sys.stderr.flush()
            # Every rank found the same problem: meet once before exiting, or the first
            # rank to exit has mlx.launch stop the others before they have said why.
            agree.all_min([1])
            exit_now(1)
    sharding = (f"{'pipeline' if args.pipeline else 'tensor'}-{agree.size}-rank{agree.rank}"
                if agree.size > 1 else "")
    httpd = None
    if agree.rank == 0:  # the only rank that serves HTTP
        try:
            httpd = listener.bind(host, port, _limited_server(args, server_class
                                                               or ThreadingHTTPServer), BACKLOG)
        except listener.ListenError as e:
            sys.stderr.write(f"error: mlx-kvcache serve: {e}\n")
            exit_now(1)
    memory = MemoryGuard(None if args.memory_limit == 0 else args.memory_limit,
                         args.memory_wait, counters=counted)
    cache = TriePromptCache(model_provider, max_bytes=args.prompt_cache_bytes,
                            checkpoint_interval=args.checkpoint_interval, cache_dir=cache_dir,
                            max_disk_bytes=args.max_disk_bytes, max_entries=args.prompt_cache_size,
                            agree=agree, sharding=sharding, cold_bits=args.cold_bits,
                            profile=profile,
                            excerpts=excerpts_shown(args.prompt_excerpts, host, args.admin_token),
                            # the prompt cache gives way to requests
                            memory=memory if args.memory_limit != 0 else None,
                            foresight=args.foresight, share_in_flight=args.share_in_flight,
                            guard_counters=counted)
    log.info("mlx_kvcache: prompt excerpts in the log and GET /v1/cache: %s (--prompt-excerpts "
             "%s); /v1/cache: %s", "shown" if cache.excerpts else "left out",
             args.prompt_excerpts, "admin token required" if args.admin_token else
             "clients on this machine's loopback only")
    log.info("mlx_kvcache: model names: %s", switch_note(args))
    beyond = listens_beyond_loopback(host)
    (log.warning if beyond and args.cache_namespace_by == "request" else log.info)(
        "mlx_kvcache: cache namespaces (--cache-namespace-by %s): %s", args.cache_namespace_by,
        sharing_note(args.cache_namespace_by, beyond))
    load_default = model_provider.load_default
    started = StartCheck()

    def load_then_open_cache():
        # The default model loads in the generation thread before the first request:
        # check it, measure it for the memory guard and open its trie (and read the
        # disk index) right then.
        try:
            log.info("mlx_kvcache: loading the model %s", args.model)
            load_default()
            problem = kv_quant_problem(args, model_provider.model, model_provider.draft_model)
        except Exception as e:  # noqa: BLE001 - said in one line by the main thread
            problem = (first_line(e) if isinstance(e, DraftLoadError)
                       else f"the model {args.model} does not load: {first_line(e)}")
        if not problem and args.memory_limit != 0 and model_provider.model is not None:
            try:
                processor = model_provider.processor
                log.info("mlx_kvcache: %s", memory.configure(
                    measure([model_provider.model, model_provider.draft_model],
                            make_prompt_cache, args.prefill_step_size,
                            image_probe(processor, model_provider.tokenizer)
                            if processor is not None else None), memory_bytes()))
            except Exception as e:  # noqa: BLE001 - the server runs, unguarded, and says so
                log.warning("mlx_kvcache: no memory guard: this model could not be measured "
                            "(%s)", first_line(e))
        if problem:
            started.fail(problem)
            raise SystemExit(1)  # ends the generation thread quietly; the main thread exits
        if model_provider.model_key is not None:
            cache.prepare(model_provider.model_key)
        started.ready()
    model_provider.load_default = load_then_open_cache
    install_model_names(model_provider)
    install_draft_use(model_provider, args.draft_policy)
    generator = ServerResponseGenerator(model_provider, cache, lifecycle=life, agree=agree,
                                        memory=memory,
                                        same_model=functools.partial(batch_key, args))
    logging.getLogger().addFilter(ToolsWarning(generator))
    # Nothing is served before the model is loaded and checked (a signal still stops).
    if not started.wait(lambda: generator.generation_available() and not life.asked) \
            and not life.asked:
        started.fail("the generation thread ended while loading the model (see the log)")
    if started.problem is not None:
        sys.stderr.write(f"error: mlx-kvcache serve: {started.problem}\n")
        exit_now(1)
    for sig in (signal.SIGTERM, signal.SIGINT):  # from here on, a stop (see the module doc)
        signal.signal(sig, lambda signum, frame: life.on_signal())
    try:
        if agree.rank != 0:
            _follow(generator, cache, life)
            return
        _log_context(args, model_provider, generator)
        handler = functools.partial(handler_class or CacheAPIHandler, routes=post_routes(),
                                    admin=AdminPolicy.make(args.admin_token, host))
        try:
            _serve(host, port, httpd, generator, cache, handler, life)
        except listener.ListenError as e:
            sys.stderr.write(f"error: mlx-kvcache serve: {e}\n")
            exit_now(1)
    except Exception:  # noqa: BLE001 - mlx-lm's generation thread would keep us alive
        log.exception("mlx_kvcache: the server failed")
        exit_now(1)


def _limited_server(args, server_class):
    """``server_class`` with the connection limits and the body budget of ``args``
    (`connections`, `body_budget`), the open-file limit raised first; said in the log."""
    from ..generation.sizing import memory_bytes
    from ..prefix.stats import human_bytes
    from .guards.body_budget import BodyBudget, default_body_budget
    from .guards.connections import (ConnectionLimits, default_max_connections, limited,
                                     raise_descriptor_limit)

    soft, _ = raise_descriptor_limit()
    limits = ConnectionLimits(args.max_connections or default_max_connections(soft),
                              args.header_timeout or None)
    if limits.max_connections >= soft:
        log.warning("mlx_kvcache: --max-connections %d is not below the open-file limit "
                    "(%d): accept() may run out of descriptors", limits.max_connections, soft)
    budget = BodyBudget(args.body_budget or default_body_budget(memory_bytes()))
    log.info("mlx_kvcache: connections: at most %d open (%d kept for loopback; open-file "
             "limit %d); request line and headers within %s, body within %s; request "
             "bodies may take %s of memory (--body-budget)", limits.max_connections,
             limits.max_connections - limits.others_max, soft,
             f"{limits.header_timeout:g} s" if limits.header_timeout else "no limit",
             f"{args.body_timeout:g} s" if args.body_timeout else "no limit",
             human_bytes(budget.total))
    return limited(server_class, limits, budget)


def _log_context(args, model_provider, generator) -> None:
    """The served model's context length and the coding clients' settings that match it."""
    from .guards.context import client_settings, context_length, served_context

    key = model_provider.model_key
    n = context_length(args, key[0] if key else None, model_provider.model)
    for what, settings in client_settings(served_context(generator), args, n):
        log.info("mlx_kvcache: %s: %s", what, settings)


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
    exit_now(code)


def _serve(host, port, httpd, generator, cache, handler_class, life) -> None:
    from mlx_lm.server import get_system_fingerprint

    from .guards.listen import listen

    fingerprint = get_system_fingerprint()
    listen(httpd, lambda *a, **k: handler_class(
        generator, *a, system_fingerprint=fingerprint, **k), host, port)
    threading.Thread(target=httpd.serve_forever, name="mlx_kvcache-http", daemon=True).start()
    log.info("Starting httpd at %s on port %d...", host, port)
    while not life.asked:
        time.sleep(0.1)
    code = _stop(httpd, generator, cache, life)
    log.info("mlx_kvcache: %sstopped (exit %d)", "rank 0 " if generator._is_distributed else "", code)
    exit_now(code)


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
