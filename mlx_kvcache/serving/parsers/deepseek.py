"""DeepSeek V3 / V3.1 / R1 tool calls and reasoning, read token by token with the model's
own tokenizer.

The calls come in a section, ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁calls▁end｜>``, one per
``<｜tool▁call▁begin｜>`` … ``<｜tool▁call▁end｜>``, in one of two forms:

* V3 and R1: ``TYPE<｜tool▁sep｜>NAME`` then the arguments fenced as
  ``\\n```json\\n{…}\\n```\\n`` (TYPE is ``function``);
* V3.1: ``NAME<｜tool▁sep｜>{…}``.

The form shows in what follows ``<｜tool▁sep｜>``: a JSON object at once is V3.1's. The
name is known at ``<｜tool▁sep｜>`` (V3.1) or at the end of its line (V3): `CallBegin`, and
the arguments stream as `CallArguments` (the closing fence never among them); `Call` at
``<｜tool▁call▁end｜>`` if they read as a JSON object, else `UnreadCall` (with the call's
markup as generated). R1's and V3.1's reasoning, ``<think>`` … ``</think>``, is
`Reasoning`; a prompt that ends inside it (R1's ``<think>\\n``) starts the parser in the
``"reasoning"`` state. Everything else is `Text`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from mlx_lm.generate import TextStateMachine

from .base import Output
from .markup import WHITESPACE, ArgumentStream, Content, MarkupEntry, Outputs, json_object

__all__ = ["MARKUP", "THINK", "DeepSeekParser", "DeepSeekEntry"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
#: DeepSeek's tool-call markup, each one token of its tokenizer.
MARKUP = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
#: Its reasoning markup (R1, V3.1), where the vocabulary has it.
THINK = ("<think>", "</think>")
#: V3's fence around the arguments, and what is held back at their end while it may be it.
_FENCE_HOLD = WHITESPACE + "`"


class DeepSeekParser:
    """One answer of a DeepSeek V3 / V3.1 / R1 model (see the module doc)."""

    _TEXT, _THINK, _SECTION, _HEAD, _BODY = "text", "think", "section", "head", "body"

    def __init__(self, tokenizer: Any, ids: Dict[str, int], stops: Optional[TextStateMachine],
                 initial_state: str) -> None:
        self._tokenizer = tokenizer
        self._markup = {v: k for k, v in ids.items()}
        self._content = Content(tokenizer)
        self._o = Outputs(stops)
        self._state = self._THINK if initial_state == "reasoning" else self._TEXT
        self._in_section = False
        self._call: List[int] = []      # the open call's tokens, for its raw markup
        self._head = ""                 # before <｜tool▁sep｜>
        self._body = ""                 # after it, until the arguments begin
        self._name = ""
        self._args: Optional[ArgumentStream] = None

    @property
    def made_calls(self) -> bool:
        return self._o.made_calls

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        stopped = finish_reason is not None and finish_reason != "length"
        mark = self._markup.get(token)
        if mark is not None:
            self._write(self._content.flush())
            self._on_markup(mark, token)
        elif not stopped:
            if self._state in (self._HEAD, self._BODY):
                self._call.append(token)
            self._write(self._content.add(token))
        if finish_reason is not None:
            self._write(self._content.flush())
            if self._state in (self._HEAD, self._BODY):
                if stopped:
                    self._end_call()
                elif self._args is not None:
                    self._o.cut(self._args.index, self._name, self._args.text)
                else:
                    self._o.unread(self._raw(), "the token limit cut it off")
            self._state = self._TEXT
            self._o.end(stopped)
        return self._o.take()

    # -- markup ------------------------------------------------------------------------------------
    def _on_markup(self, mark: str, token: int) -> None:
        in_call = self._state in (self._HEAD, self._BODY)
        if mark == CALL_BEGIN:
            if in_call:
                self._end_call()
            self._state, self._call = self._HEAD, [token]
            self._head, self._body, self._name, self._args = "", "", "", None
        elif mark == SEP and self._state == self._HEAD:
            self._call.append(token)
            self._state = self._BODY
        elif mark == CALL_END and in_call:
            self._call.append(token)
            self._end_call()
        elif mark == CALLS_BEGIN:
            if in_call:
                self._end_call()
            self._state, self._in_section = self._SECTION, True
        elif mark == CALLS_END:
            if in_call:
                self._end_call()
            self._state, self._in_section = self._TEXT, False
        elif mark == "<think>" and self._state == self._TEXT:
            self._state = self._THINK
        elif mark == "</think>" and self._state == self._THINK:
            self._state = self._TEXT
        elif in_call:  # markup out of place inside a call: part of what cannot be read
            self._call.append(token)

    # -- content -----------------------------------------------------------------------------------
    def _write(self, s: str) -> None:
        if not s:
            return
        if self._state == self._TEXT:
            self._o.text(s)
        elif self._state == self._THINK:
            self._o.reasoning(s)
        elif self._state == self._SECTION:
            if s.strip(WHITESPACE):  # between calls: only whitespace is markup's
                self._o.text(s)
        elif self._state == self._HEAD:
            self._head += s
        elif self._args is not None:
            self._o.arguments(self._args, s)
        else:
            self._body += s
            self._begin_arguments()

    def _begin_arguments(self) -> None:
        """Once the form shows: the name, `CallBegin`, and the arguments written so far."""
        body = self._body.lstrip(WHITESPACE)
        if not body:
            return
        if body[0] in "{[":  # V3.1: NAME<｜tool▁sep｜>{…}
            self._start(self._head.strip(WHITESPACE), WHITESPACE, body)
            return
        if "\n" not in body:  # V3: TYPE<｜tool▁sep｜>NAME\n```json\n{…}
            return
        if not self._name:
            self._name = body.split("\n", 1)[0].strip(WHITESPACE)
            self._args = None
        rest = body.split("\n", 1)[1].lstrip(WHITESPACE)
        if rest.startswith("```"):
            if "\n" not in rest:
                return
            rest = rest.split("\n", 1)[1]
        elif "```".startswith(rest):  # nothing yet, or the fence's first backticks
            return
        self._start(self._name, _FENCE_HOLD, rest)

    def _start(self, name: str, hold: str, written: str) -> None:
        self._name = name
        self._args = ArgumentStream(self._o.begin(name), hold)
        self._o.arguments(self._args, written)

    def _end_call(self) -> None:
        """The open call ends (its end markup, if written, is in its tokens)."""
        if self._args is not None and json_object(self._args.final) is not None:
            self._o.call(self._name, self._args.final, self._args.index)
        elif self._args is not None:
            self._o.unread(self._raw(), "its arguments are not a JSON object", self._args.index)
        else:
            self._o.unread(self._raw(), "no function name and arguments after "
                                        "<｜tool▁call▁begin｜>")
        self._state = self._SECTION if self._in_section else self._TEXT
        self._call, self._args = [], None

    def _raw(self) -> str:
        return self._tokenizer.decode(self._call)


class DeepSeekEntry(MarkupEntry):
    """The `ParserFactory` of DeepSeek's calls for one tokenizer whose vocabulary has
    `MARKUP` (and `THINK` where it has them)."""

    family, markup = "DeepSeek tool-call", MARKUP
    optional = THINK

    def parser(self, stops: Optional[TextStateMachine], tools: Optional[List[Any]],
               initial_state: str) -> Any:
        return DeepSeekParser(self.tokenizer, self.ids, stops, initial_state)
