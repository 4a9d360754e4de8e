"""mlx-lm's own output parsing as one entry: what mlx-lm 0.32's chat route
(``APIHandler.handle_completion``) makes of a generated stream, event for event.

Its pieces, reused through their public functions: the text state machine
``make_text_state_machine(tokenizer, stop_words)`` builds (reasoning between the
tokenizer's ``think_start`` / ``think_end``, a call between ``tool_call_start`` /
``tool_call_end``, the response format's transitions and structural markers, each stop
word taken out), run as the route runs it — ``split`` on each segment, ``split`` then
``flush`` on a ``"length"`` token, ``discard`` on a ``"stop"`` token (whose text is
dropped) — the tokenizer's ``tool_parser`` on each call's text, and ``ToolCallFormatter``
for the call's arguments (``json.dumps``, ``ensure_ascii=False``) and the id a parser names.

One difference, on purpose: a call the parser cannot read (it raises, or gives no name and
arguments) is not dropped with a warning as mlx-lm drops it — it comes out as `UnreadCall`
with its markup as generated: the start marker, its text, and the end marker where the
model wrote it (the state machine left the call, or the answer's last tokens are the end
marker's, when the end marker was its stop).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter

from .base import Call, Output, Reasoning, Text, UnreadCall

__all__ = ["MlxLmParser", "MlxLmEntry"]


class MlxLmParser:
    """One answer, as mlx-lm's chat route reads it (see the module doc)."""

    def __init__(self, tokenizer: Any, machine: TextStateMachine, tools: Optional[List[Any]],
                 initial_state: str) -> None:
        self._parse = tokenizer.tool_parser
        self._tools = tools
        self._start = tokenizer.tool_call_start or ""
        self._end = tokenizer.tool_call_end or ""
        self._end_tokens: Tuple[int, ...] = tuple(tokenizer.tool_call_end_tokens or ())
        self._last: Deque[int] = deque(maxlen=max(1, len(self._end_tokens)))
        self._sm = machine.make_state(initial_state)
        self._prev: Optional[str] = initial_state
        self._call_text = ""
        self._index = 0
        self._made = False

    @property
    def made_calls(self) -> bool:
        return self._made

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        self._last.append(token)
        if self._sm[0] is None:  # a response format's end state: nothing more is read
            segments: List[Tuple[Optional[str], str]] = []
        elif finish_reason == "stop":
            self._sm, state = TextStateMachine.discard(self._sm)
            segments = [(state, "")]
        elif finish_reason == "length":
            self._sm, segments = TextStateMachine.split(self._sm, text)
            self._sm, flushed, state = TextStateMachine.flush(self._sm)
            segments.append((state, flushed))
        else:
            self._sm, segments = TextStateMachine.split(self._sm, text)
        out: List[Output] = []
        for state, clean in segments:
            if state == "reasoning":
                if clean:
                    out.append(Reasoning(clean))
            elif state == "tool":
                self._call_text += clean
            elif state == "normal":
                if self._prev == "tool":  # the end marker closed the call
                    out.extend(self._read(closed=True))
                if clean:
                    out.append(Text(clean))
            self._prev = state
        if finish_reason is not None and self._prev == "tool" and self._call_text:
            closed = bool(self._end_tokens) and tuple(self._last) == self._end_tokens
            out.extend(self._read(closed=closed))
        return out

    def _read(self, closed: bool) -> List[Output]:
        """The call written so far, read by the model's parser (its text is consumed)."""
        text, self._call_text = self._call_text, ""
        try:
            parsed = self._parse(text, self._tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                             and "arguments" in c for c in calls):
                ids = [c.get("id") for c in calls]  # (the parser's own, not one made up)
                formatted = ToolCallFormatter(lambda _text, _tools: parsed, self._tools)([text])
                out: List[Output] = []
                for f, cid in zip(formatted, ids):
                    fn = f["function"]
                    out.append(Call(self._index, fn["name"], fn["arguments"], cid))
                    self._index += 1
                self._made = True
                return out
            problem = "it names no function and arguments"
        except Exception as e:  # noqa: BLE001 - whatever the model's parser raises
            problem = f"{type(e).__name__}: {e}"
        return [UnreadCall(self._start + text + (self._end if closed else ""), problem)]


class MlxLmEntry:
    """The `ParserFactory` of mlx-lm's parsing for one tokenizer (mlx-lm's
    ``TokenizerWrapper``): the state machine for a set of stop words is built once, as
    mlx-lm's ``ResponseGenerator`` keeps it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._machines: Dict[Tuple[str, ...], TextStateMachine] = {}
        self._lock = threading.Lock()

    def machine(self, stop_words: Sequence[str] = ()) -> TextStateMachine:
        key = tuple(stop_words)
        with self._lock:
            m = self._machines.get(key)
            if m is None:
                if len(self._machines) > 100:
                    self._machines.clear()
                m = self._machines[key] = make_text_state_machine(self._tokenizer, list(key))
            return m

    def __call__(self, tools: Optional[List[Any]] = None, initial_state: str = "normal",
                 stop_words: Sequence[str] = ()) -> MlxLmParser:
        return MlxLmParser(self._tokenizer, self.machine(stop_words), tools, initial_state)
