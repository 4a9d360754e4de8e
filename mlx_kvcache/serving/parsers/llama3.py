"""Llama 3.1 / 3.2 / 3.3 tool calls, read token by token with the model's own tokenizer.

Llama 3.x calls a custom tool by answering with JSON — ``{"name": NAME, "parameters":
{…}}`` (``"arguments"`` too), several separated by ``;`` in 3.2 — and a built-in tool after
``<|python_tag|>`` (``brave_search.call(query="…")``, or JSON there too); ``<|eom_id|>``
ends a message that awaits a tool's result, ``<|eot_id|>`` a turn (both end-of-sequence
tokens in its generation config). So:

* an answer that begins with ``{`` is held back while it can still be a call: once
  ``{"name": "NAME", "parameters": {`` is written and NAME is a tool the request offered,
  `CallBegin` and its arguments stream as `CallArguments`; a call in another key order is
  read whole when its object closes. JSON that is not a call of an offered tool stays text
  (an answer the user asked in JSON);
* after ``<|python_tag|>`` the JSON calls are read the same way whatever their name (the
  tag is markup), and ``NAME.call(k=v, …)`` is a call of NAME if the request offered it;
  anything else there is an `UnreadCall` with its markup (``<|python_tag|>`` and its text);
* a call begun and then not closed: `CallCut` at the token limit, `UnreadCall` (with its
  index) at a stop.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Dict, List, Optional, Set, Tuple

from mlx_lm.generate import TextStateMachine

from .base import Output
from .markup import (WHITESPACE, ArgumentStream, Content, JsonScan, MarkupEntry, Outputs,
                     json_object, offered_names)

__all__ = ["MARKUP", "Llama3Parser", "Llama3Entry"]

#: Llama 3.1's markup that this parser reads, each one token of its tokenizer.
MARKUP = ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>")

#: A call's head with its name first: the arguments' object opens at the match's end - 1.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"'
                   r'\s*:\s*\{')
#: The object's first key, once written; or a first character that is not a key's.
_FIRST_KEY = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"')
_NOT_A_KEY = re.compile(r'\{\s*[^\s"]')
_CALL_KEYS = ("name", "type", "function", "parameters", "arguments")


class _JsonCall:
    """One JSON object that may be a call, as it is written (from its ``{``)."""

    def __init__(self) -> None:
        self.text = ""
        self.scan = JsonScan()
        self.name = ""
        self.args: Optional[ArgumentStream] = None
        self._args_scan: Optional[JsonScan] = None
        self.args_done = False

    def head(self) -> Optional[Tuple[str, int]]:
        """The name and where its arguments' object opens, once the head is written."""
        m = _HEAD.match(self.text)
        if m is None:
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        return name, m.end() - 1

    def not_a_call(self) -> bool:
        """Whether what is written already rules a call out."""
        if _NOT_A_KEY.match(self.text):
            return True
        key = _FIRST_KEY.match(self.text)
        return key is not None and key.group(1) not in _CALL_KEYS

    def start_arguments(self, at: int) -> str:
        """The arguments begin at ``at`` of the text: returns the part already written."""
        self._args_scan = JsonScan()
        return self.arguments(self.text[at:])

    def arguments(self, piece: str) -> str:
        """Of ``piece`` (text after the arguments began), the part inside them."""
        if self.args_done or self._args_scan is None:
            return ""
        end = self._args_scan.feed(piece)
        if end >= 0:
            self.args_done = True
            return piece[:end]
        return piece


class Llama3Parser:
    """One answer of a Llama 3.x model (see the module doc)."""

    _START, _TEXT, _JSON, _AFTER, _CODE = "start", "text", "json", "after", "code"

    def __init__(self, tokenizer: Any, ids: Dict[str, int], stops: Optional[TextStateMachine],
                 tools: Optional[List[Any]]) -> None:
        self._tokenizer = tokenizer
        self._markup = {v: k for k, v in ids.items()}
        self._content = Content(tokenizer)
        self._o = Outputs(stops)
        self._offered: Set[str] = offered_names(tools)
        self._mode = self._START
        self._lead = ""              # whitespace (and ``;``) held before a possible call
        self._tagged = False         # after <|python_tag|>
        self._call: Optional[_JsonCall] = None
        self._code = ""

    @property
    def made_calls(self) -> bool:
        return self._o.made_calls

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        stopped = finish_reason is not None and finish_reason != "length"
        mark = self._markup.get(token)
        if mark is not None:
            self._write(self._content.flush())
            self._on_markup(mark)
        elif not stopped:
            self._write(self._content.add(token))
        if finish_reason is not None:
            self._write(self._content.flush())
            self._close(ended_by="", limit=not stopped)
            self._o.end(stopped)
        return self._o.take()

    # -- markup ------------------------------------------------------------------------------------
    def _on_markup(self, mark: str) -> None:
        if mark == "<|python_tag|>":
            self._close(ended_by="", limit=False)
            self._tagged = True
        else:  # <|eom_id|>, <|eot_id|>: the message ends
            self._close(ended_by=mark, limit=False)
            self._tagged = False

    # -- content -----------------------------------------------------------------------------------
    def _write(self, s: str) -> None:
        i = 0
        while i < len(s):
            if self._mode == self._TEXT:
                self._o.text(s[i:])
                return
            if self._mode == self._CODE:
                self._code += s[i:]
                return
            if self._mode == self._JSON:
                i += self._json(s[i:])
                continue
            ch = s[i]  # _START or _AFTER: whitespace (and, between calls, ``;``) is held
            if ch in WHITESPACE or (ch == ";" and self._mode == self._AFTER):
                self._lead += ch
                i += 1
            elif ch == "{":
                self._mode, self._call = self._JSON, _JsonCall()
            elif self._tagged and self._mode == self._START:
                self._mode, self._code = self._CODE, self._lead
                self._lead = ""
            else:
                self._as_text(self._lead)
                self._lead = ""

    def _as_text(self, s: str) -> None:
        self._mode = self._TEXT
        self._o.text(s)

    def _json(self, s: str) -> int:
        """Reads ``s`` into the current object; returns how much of it was used."""
        call = self._call
        end = call.scan.feed(s)
        piece = s if end < 0 else s[:end]
        call.text += piece
        if call.args is not None:
            self._o.arguments(call.args, call.arguments(piece))
        elif not self._tagged and call.not_a_call():
            self._call, self._mode = None, self._TEXT
            self._o.text(self._lead + call.text)
            self._lead = ""
            return len(piece)
        else:
            head = call.head()
            if head is not None and (self._tagged or head[0] in self._offered):
                call.name = head[0]
                call.args = ArgumentStream(self._o.begin(call.name))
                self._o.arguments(call.args, call.start_arguments(head[1]))
            elif head is not None and not self._tagged:  # a call of a tool not offered
                self._call, self._mode = None, self._TEXT
                self._o.text(self._lead + call.text)
                self._lead = ""
                return len(piece)
        if end >= 0:
            self._object_closed()
        return len(piece)

    def _object_closed(self) -> None:
        call, self._call = self._call, None
        obj = json_object(call.text)
        name = obj.get("name") if obj is not None else None
        args = None if obj is None else obj.get("parameters", obj.get("arguments"))
        is_call = isinstance(name, str) and isinstance(args, dict)
        if call.args is not None:
            if is_call and json_object(call.args.final) is not None:
                self._o.call(call.name, call.args.final, call.args.index)
            else:
                self._o.unread(self._raw(call.text), "its arguments are not a JSON object",
                               call.args.index)
        elif is_call and (self._tagged or name in self._offered):
            self._o.call(name, json.dumps(args, ensure_ascii=False))
        elif self._tagged:
            self._o.unread(self._raw(call.text), "it is not a call: a JSON object with a "
                                                 "name and parameters")
        else:
            self._as_text(self._lead + call.text)
            self._lead = ""
            return
        self._mode, self._lead = self._AFTER, ""

    def _raw(self, body: str, end: str = "") -> str:
        return ("<|python_tag|>" if self._tagged else "") + body + end

    def _close(self, ended_by: str, limit: bool) -> None:
        """What is open when a message ends (``ended_by``: its end markup, if any) or the
        answer does (``limit``: cut by the token limit)."""
        if self._mode == self._JSON:
            call, self._call = self._call, None
            if call.args is not None and limit:
                self._o.cut(call.args.index, call.name, call.args.text)
            elif call.args is not None:
                self._o.unread(self._raw(call.text, ended_by), "the call's JSON never closed",
                               call.args.index)
            elif self._tagged:
                self._o.unread(self._raw(call.text, ended_by),
                               "the token limit cut it off" if limit
                               else "the call's JSON never closed")
            else:
                self._o.text(self._lead + call.text)
        elif self._mode == self._CODE:
            self._code_call(self._code, ended_by, limit)
        elif self._mode == self._START and self._tagged and self._lead.strip():
            self._o.unread(self._raw(self._lead, ended_by), "no call after <|python_tag|>")
        elif self._mode == self._START and not self._tagged:
            self._o.text(self._lead)
        self._mode, self._lead, self._code = self._START, "", ""

    def _code_call(self, code: str, ended_by: str, limit: bool) -> None:
        """``NAME.call(k=v, …)`` after ``<|python_tag|>``, a call of an offered NAME."""
        parsed = None if limit else _python_call(code)
        if parsed is not None and parsed[0] in self._offered:
            self._o.call(parsed[0], json.dumps(parsed[1], ensure_ascii=False))
            return
        problem = ("the token limit cut it off" if limit else
                   "it is not NAME.call(…) of a tool the request offered")
        self._o.unread(self._raw(code, ended_by), problem)


def _python_call(code: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``NAME.call(k=literal, …)`` read: (NAME, its keyword arguments), or None."""
    try:
        node = ast.parse(code.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "call" and isinstance(node.func.value, ast.Name)
            and not node.args and all(k.arg is not None for k in node.keywords)):
        return None
    try:
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        return None
    return node.func.value.id, kwargs


class Llama3Entry(MarkupEntry):
    """The `ParserFactory` of Llama 3.x for one tokenizer whose vocabulary has `MARKUP`."""

    family, markup = "Llama 3.x", MARKUP

    def parser(self, stops: Optional[TextStateMachine], tools: Optional[List[Any]],
               initial_state: str) -> Any:
        return Llama3Parser(self.tokenizer, self.ids, stops, tools)
