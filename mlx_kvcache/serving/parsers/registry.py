"""TEMPORARY (front-door branch): mlx-lm's parsing as one entry; replaced by the parsers
branch's registry at merge."""

from __future__ import annotations

from typing import Any, List, Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from .base import Call, Output, Reasoning, Text, UnreadCall


class MlxLmParser:
    def __init__(self, tokenizer, tools, initial_state: str, stop_words: List[str]) -> None:
        self._tok = tokenizer
        self._tools = tools
        self._sm = make_text_state_machine(tokenizer, stop_words).make_state(initial_state)
        self._prev = initial_state
        self._tool = ""
        self._calls = 0
        self._last: List[int] = []

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        self._last.append(token)
        del self._last[:-64]
        if finish_reason == "stop":
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
            if state == "reasoning" and clean:
                out.append(Reasoning(clean))
            elif state == "tool":
                self._tool += clean
            elif state == "normal":
                if self._prev == "tool":
                    out += self._call(closed=True)
                if clean:
                    out.append(Text(clean))
            self._prev = state
        if finish_reason is not None and self._prev == "tool" and self._tool:
            out += self._call(closed=self._closed())
        return out

    def _closed(self) -> bool:
        end = tuple(self._tok.tool_call_end_tokens or ())
        return bool(end) and tuple(self._last[-len(end):]) == end

    def _call(self, closed: bool) -> List[Output]:
        text, self._tool = self._tool, ""
        parse = self._tok.tool_parser
        try:
            parsed = parse(text, self._tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                             and "arguments" in c for c in calls):
                out: List[Output] = []
                import json
                for c in calls:
                    args = c["arguments"]
                    out.append(Call(self._calls, c["name"], args if isinstance(args, str)
                                    else json.dumps(args, ensure_ascii=False)))
                    self._calls += 1
                return out
            problem = "it names no function and arguments"
        except Exception as e:  # noqa: BLE001
            problem = f"{type(e).__name__}: {e}"
        start, end = self._tok.tool_call_start or "", self._tok.tool_call_end or ""
        return [UnreadCall(start + text + (end if closed else ""), problem)]


def parser_for(tokenizer):
    def make(tools: Optional[List[Any]], initial_state: str, stop_words: List[str] = ()):
        return MlxLmParser(tokenizer, tools, initial_state, list(stop_words))
    make.name = "mlx-lm"
    return make
