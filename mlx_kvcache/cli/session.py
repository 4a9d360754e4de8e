"""`ChatSession`: a conversation on a `PrefixCache` — message list, exact token history,
streaming, interrupts — and the status line printed after each answer.

How each turn's prompt is built (why the prefix always matches)
---------------------------------------------------------------
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

import signal
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, TextIO

from .common import human_bytes

__all__ = ["ChatSession", "HELP", "format_status"]

_SENTINEL = "MLXKVCACHESENTINEL7f3a9c"
HELP = """\
commands:
  /reset   start a new conversation (the cache is kept: a repeated system prompt still hits)
  /undo    drop the last exchange (the next turn restores from the cache)
  /stats   cumulative cache statistics
  /help    this text
  /quit    leave (also /exit, Ctrl-D; Ctrl-C stops an answer)"""


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
    if getattr(st, "disk_tokens", 0):
        parts.append(f"from disk {st.disk_tokens}")
    parts += _proposals(st)
    line = "[cache] " + " | ".join(parts)
    if st.matched_tokens > st.restored_tokens + 1 and st.reason:
        line += f" (matched {st.matched_tokens}: {st.reason})"
    return line


def _proposals(st) -> List[str]:
    """What prompt lookup and a draft model proposed and the model accepted, and the
    forward passes that saved (nothing where neither proposed)."""
    out = []
    if st.passes_saved:
        out.append(f"saved {st.passes_saved} passes")
    for name, drafted, accepted in (
            ("lookup drafted", st.lookup_drafted_tokens, st.lookup_accepted_tokens),
            ("drafted", st.drafted_tokens - st.lookup_drafted_tokens,
             st.accepted_tokens - st.lookup_accepted_tokens)):
        if drafted:
            out.append(f"{name} {drafted} accepted {accepted} ({100 * accepted / drafted:.0f}%)")
    return out


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
        if getattr(s, "max_disk_bytes", None) is not None:
            lines.append(f"[stats] disk {human_bytes(s.disk_bytes)} of "
                         f"{human_bytes(s.max_disk_bytes)} | nodes on disk only {s.disk_nodes} | "
                         f"reused from disk {s.disk_tokens} tokens")
        if s.lookup_drafted_tokens:
            share = 100 * s.lookup_accepted_tokens / s.lookup_drafted_tokens
            lines.append(f"[stats] lookup drafted {s.lookup_drafted_tokens} | accepted "
                         f"{s.lookup_accepted_tokens} ({share:.0f}%) | passes saved "
                         f"{s.passes_saved}")
        drafted = s.drafted_tokens - s.lookup_drafted_tokens
        if drafted:
            accepted = s.accepted_tokens - s.lookup_accepted_tokens
            lines.append(f"[stats] drafted {drafted} | accepted {accepted} "
                         f"({100 * accepted / drafted:.0f}%)")
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()

