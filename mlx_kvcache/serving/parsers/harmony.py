"""gpt-oss's harmony format, read token by token with the model's own tokenizer.

An answer is a run of messages after the prompt's ``<|start|>assistant``: each a header,
``<|message|>``, a body, and its end — ``<|end|>``, ``<|call|>`` (a tool call's) or
``<|return|>`` (the answer's) — with ``<|start|>`` and a role between messages. The header
names the channel (``<|channel|>analysis``) and, for a call, the recipient
(``to=functions.NAME``, before or after ``<|channel|>``) and the arguments' format
(``<|constrain|>json``, optional). So:

* ``analysis`` → `Reasoning`; ``final`` → `Text`; ``commentary`` without a recipient (a
  preamble to the user) → `Text`;
* ``to=functions.NAME`` → a tool call: `CallBegin` at ``<|message|>``, its body streamed
  as `CallArguments`, `Call` once the body ends and reads as a JSON object (else
  `UnreadCall` naming its index), `CallCut` if the token limit ends the answer inside it;
* another recipient (a built-in tool the request did not offer: ``browser.search``,
  ``python``) → `UnreadCall` with the message's markup as generated;
* a header never closed by ``<|message|>`` → its text, when it carried no markup (the
  model wrote plain text), else nothing (markup alone carries no content).

gpt-oss's generation config counts ``<|call|>`` and ``<|return|>`` as end-of-sequence
tokens, so the last token arrives with ``finish_reason="stop"``: it is still read as markup.
No ``openai-harmony``: its parser needs the o200k vocabulary, which it fetches at run time;
the markup's ids come from the model's own tokenizer, whose detokenizer decodes the rest.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from mlx_lm.generate import TextStateMachine

from .base import Output
from .markup import ArgumentStream, Content, MarkupEntry, Outputs, json_object

__all__ = ["MARKUP", "HarmonyParser", "HarmonyEntry"]

#: harmony's markup, each one token of gpt-oss's tokenizer (o200k_harmony).
MARKUP = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
          "<|return|>")

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyParser:
    """One answer in harmony (see the module doc)."""

    _HEADER, _BODY, _BETWEEN = "header", "body", "between"

    def __init__(self, tokenizer: Any, ids: Dict[str, int], stops: Optional[TextStateMachine],
                 initial_state: str) -> None:
        self._tokenizer = tokenizer
        self._ids = ids
        self._markup = {v: k for k, v in ids.items()}
        self._content = Content(tokenizer)
        self._o = Outputs(stops)
        self._message: List[int] = []   # the current message's tokens, for its raw markup
        self._header = ""
        self._marked = False            # the header carries markup (a channel, a recipient)
        self._kind = ""                 # the body's: "reasoning", "text", "call", "other"
        self._name = ""
        self._body = ""                 # an unread call's body
        self._args: Optional[ArgumentStream] = None
        if initial_state == "reasoning":  # the prompt opened the analysis channel
            self._state, self._kind = self._BODY, "reasoning"
        else:
            self._state = self._HEADER

    @property
    def made_calls(self) -> bool:
        return self._o.made_calls

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        stopped = finish_reason is not None and finish_reason != "length"
        mark = self._markup.get(token)
        if mark is not None:
            self._route(self._content.flush())
            self._on_markup(mark, token)
        elif not stopped:
            if self._state == self._BETWEEN:  # content after an end: an unannounced message
                self._open(None)
            self._message.append(token)
            self._route(self._content.add(token))
        if finish_reason is not None:
            self._route(self._content.flush())
            self._finish(stopped)
        return self._o.take()

    # -- content -----------------------------------------------------------------------------------
    def _route(self, s: str) -> None:
        if not s:
            return
        if self._state == self._HEADER:
            self._header += s
        elif self._kind == "reasoning":
            self._o.reasoning(s)
        elif self._kind == "text":
            self._o.text(s)
        elif self._kind == "call":
            self._o.arguments(self._args, s)
        else:
            self._body += s

    # -- markup ------------------------------------------------------------------------------------
    def _on_markup(self, mark: str, token: int) -> None:
        if mark == "<|start|>":
            self._end_message()
            self._open(token)
            return
        if mark in ("<|channel|>", "<|constrain|>") and self._state != self._HEADER:
            self._end_message()  # a new header without <|end|><|start|>
            self._open(None)
        self._message.append(token)
        if mark in ("<|channel|>", "<|constrain|>"):
            self._header += mark
            self._marked = True
        elif mark == "<|message|>":
            if self._state == self._HEADER:
                self._read_header()
        else:  # <|end|>, <|call|>, <|return|>: the message's own end
            self._end_message()

    def _open(self, first: Optional[int]) -> None:
        """A new message begins (``first``: its opening markup token, if any)."""
        self._state, self._header, self._marked = self._HEADER, "", False
        self._message = [first] if first is not None else []

    def _read_header(self) -> None:
        recipient = _RECIPIENT.search(self._header)
        channel = _CHANNEL.search(self._header)
        self._state, self._body = self._BODY, ""
        if recipient is not None:
            self._name = recipient.group(1)
            if self._name.startswith(_FUNCTIONS) and len(self._name) > len(_FUNCTIONS):
                self._name = self._name[len(_FUNCTIONS):]
                self._kind = "call"
                self._args = ArgumentStream(self._o.begin(self._name))
            else:
                self._kind = "other"
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "text"

    def _end_message(self) -> None:
        """The current message ends (its end markup, if written, is in its tokens)."""
        if self._state == self._HEADER:
            if _RECIPIENT.search(self._header):
                self._o.unread(self._raw(), "a call's header was never followed by "
                                            "<|message|> and its arguments")
            elif not self._marked:
                self._o.text(self._header)
        elif self._state == self._BODY and self._kind == "call":
            args = self._args.final
            if json_object(args) is not None:
                self._o.call(self._name, args, self._args.index)
            else:
                self._o.unread(self._raw(), "its arguments are not a JSON object",
                               self._args.index)
        elif self._state == self._BODY and self._kind == "other":
            self._o.unread(self._raw(), f"it calls {self._name}, which is not a function "
                                        "the request offered")
        self._state, self._header, self._kind = self._BETWEEN, "", ""

    def _raw(self) -> str:
        return self._tokenizer.decode(self._message)

    def _finish(self, stopped: bool) -> None:
        if not stopped and self._state == self._BODY and self._kind == "call":
            self._o.cut(self._args.index, self._name, self._args.text)
        elif not stopped and self._state == self._BODY and self._kind == "other":
            self._o.unread(self._raw(), "the token limit cut it off")
        elif not stopped and self._state == self._HEADER and _RECIPIENT.search(self._header):
            self._o.unread(self._raw(), "the token limit cut it off")
        else:
            self._end_message()
        self._state = self._BETWEEN
        self._o.end(stopped)


class HarmonyEntry(MarkupEntry):
    """The `ParserFactory` of harmony for one tokenizer whose vocabulary has `MARKUP`."""

    family, markup = "harmony", MARKUP

    def parser(self, stops: Optional[TextStateMachine], tools: Optional[List[Any]],
               initial_state: str) -> Any:
        return HarmonyParser(self.tokenizer, self.ids, stops, initial_state)
