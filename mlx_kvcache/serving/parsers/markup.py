"""What the token-level parsers share: a family's markup tokens looked up in the model's own
vocabulary (`markup_ids`), the content between them decoded with the model's own streaming
detokenizer (`Content`), the outputs of one answer with the request's stop words held back
(`Outputs`), a call's arguments streamed as they are written (`ArgumentStream`), where a
JSON value written piece by piece ends (`JsonScan`), and the names of the offered tools
(`offered_names`).

Markup is read by token id, never by its text: a model that writes ``<|call|>`` as
ordinary characters (say, quoting the format to a user) writes content, not markup — the
family's tokenizer encodes markup as one added token, and that token is the markup.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from mlx_lm.generate import TextStateMachine

from .base import Call, CallArguments, CallBegin, CallCut, Output, Reasoning, Text, UnreadCall

__all__ = ["markup_ids", "MarkupEntry", "Content", "Outputs", "ArgumentStream", "JsonScan", "offered_names",
           "json_object", "stop_machine", "WHITESPACE"]

WHITESPACE = " \t\r\n"


def markup_ids(tokenizer: Any, strings: Iterable[str]) -> Optional[Dict[str, int]]:
    """Each string's id where the tokenizer's vocabulary has it as one whole token (as a
    family's tokenizer has its markup); None if any is missing."""
    vocab = tokenizer.get_vocab()
    out = {}
    for s in strings:
        if s not in vocab:
            return None
        out[s] = vocab[s]
    return out


def offered_names(tools: Optional[Sequence[Any]]) -> Set[str]:
    """The function names among ``tools`` (OpenAI's ``{"type": "function", "function":
    {"name": …}}``, or the bare ``{"name": …}``)."""
    names = set()
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        f = t.get("function") if isinstance(t.get("function"), dict) else t
        if isinstance(f.get("name"), str):
            names.add(f["name"])
    return names


def json_object(text: str) -> Optional[Dict[str, Any]]:
    """``text`` read as one JSON object, or None (not JSON, or not an object)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@functools.lru_cache(maxsize=64)
def stop_machine(stop_words: Tuple[str, ...]) -> Optional[TextStateMachine]:
    """mlx-lm's text state machine with each stop word as a self-transition (as its
    ``make_text_state_machine`` adds them): text passes once it cannot begin a stop word,
    and a stop word's text is taken out. None without stop words."""
    words = tuple(w for w in stop_words if w)
    if not words:
        return None
    return TextStateMachine({"normal": [(w, "normal") for w in words]})


class Content:
    """The text of an answer's content tokens, decoded by the model's own streaming
    detokenizer (mlx-lm's, a copy per answer) and flushed at each markup token, so what
    the detokenizer holds back (a character's first bytes, a lone space) lands on the
    side of the markup it was written on. Markup tokens never enter it."""

    def __init__(self, tokenizer: Any) -> None:
        self._detokenizer = tokenizer.detokenizer

    def add(self, token: int) -> str:
        """The text ``token`` completes (may be empty)."""
        self._detokenizer.add_token(token)
        return self._detokenizer.last_segment

    def flush(self) -> str:
        """What is still held back."""
        self._detokenizer.finalize()
        return self._detokenizer.last_segment


class JsonScan:
    """Where a JSON object or array, written piece by piece from its opening bracket,
    closes: brackets counted outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """Reads ``text``; the index just past the bracket that closes the value, or -1."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1


class ArgumentStream:
    """One call's arguments as they are written. Leading whitespace is skipped and
    trailing characters of ``hold`` are kept back until something else follows, so the
    deltas given are always a prefix of `final` (which drops them)."""

    def __init__(self, index: int, hold: str = WHITESPACE) -> None:
        self.index = index
        self.text = ""
        self._sent = 0
        self._hold = hold

    def add(self, text: str) -> List[Output]:
        """The `CallArguments` delta ``text`` makes safe to send (none or one)."""
        if not self.text:
            text = text.lstrip(WHITESPACE)
        self.text += text
        safe = len(self.text.rstrip(self._hold))
        if safe <= self._sent:
            return []
        delta, self._sent = self.text[self._sent:safe], safe
        return [CallArguments(self.index, delta)]

    @property
    def final(self) -> str:
        return self.text.rstrip(self._hold)


class Outputs:
    """The outputs of one answer as a token-level parser makes them: text and reasoning
    pass through the stop-word hold (`stop_machine`), flushed whenever the kind changes
    or a call event comes, so events keep the order they were written in; calls are
    numbered from 0."""

    def __init__(self, stops: Optional[TextStateMachine]) -> None:
        self._machine = stops
        self._held: Optional[Any] = stops.make_state("normal") if stops is not None else None
        self._kind: Optional[type] = None
        self._out: List[Output] = []
        self.next_index = 0
        self.made_calls = False

    # -- text and reasoning --------------------------------------------------------------------
    def text(self, s: str) -> None:
        self._content(Text, s)

    def reasoning(self, s: str) -> None:
        self._content(Reasoning, s)

    def _content(self, kind: type, s: str) -> None:
        if not s:
            return
        if kind is not self._kind:
            self._flush()
            self._kind = kind
        if self._held is not None:
            self._held, segments = TextStateMachine.split(self._held, s)
            s = "".join(t for _, t in segments)
        if s:
            self._put(kind(s))

    def _put(self, item: Output) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(item, (Text, Reasoning)) and type(last) is type(item):
            self._out[-1] = type(item)(last.text + item.text)
        else:
            self._out.append(item)

    def _flush(self) -> None:
        if self._held is None or self._kind is None:
            return
        self._held, rest, _ = TextStateMachine.flush(self._held)
        if rest:
            self._put(self._kind(rest))

    # -- calls -----------------------------------------------------------------------------------
    def begin(self, name: str) -> int:
        """`CallBegin` for a new call; its index."""
        self._flush()
        index = self.next_index
        self.next_index += 1
        self._out.append(CallBegin(index, name))
        return index

    def arguments(self, stream: "ArgumentStream", text: str) -> None:
        """``text`` written into the arguments of ``stream``'s begun call."""
        self._out.extend(stream.add(text))

    def call(self, name: str, arguments: str, index: Optional[int] = None) -> None:
        """A complete call (``index``: the begun call it completes; None: a new one)."""
        self._flush()
        if index is None:
            index = self.next_index
            self.next_index += 1
        self._out.append(Call(index, name, arguments))
        self.made_calls = True

    def cut(self, index: int, name: str, arguments: str) -> None:
        self._flush()
        self._out.append(CallCut(index, name, arguments))

    def unread(self, raw: str, problem: str, index: Optional[int] = None) -> None:
        self._flush()
        self._out.append(UnreadCall(raw, problem, index))

    # -- the end -----------------------------------------------------------------------------------
    def end(self, stopped: bool) -> None:
        """The answer ended: a stop drops what the stop-word hold keeps, a cut gives it."""
        if stopped and self._held is not None:
            self._held, _ = TextStateMachine.discard(self._held)
        else:
            self._flush()

    def take(self) -> List[Output]:
        """The outputs since the last call."""
        out, self._out = self._out, []
        return out


class MarkupEntry:
    """A token-level family's `ParserFactory` for one tokenizer: its markup's ids read once
    from the vocabulary (`markup_ids`: a ValueError naming the family where one of
    `markup` is missing; `optional` added where the vocabulary has them), and a parser
    made for each answer (`parser`, each family's)."""

    #: The family as the error names it, its markup, and markup it may lack.
    family: str = ""
    markup: Tuple[str, ...] = ()
    optional: Tuple[str, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        ids = markup_ids(tokenizer, self.markup)
        if ids is None:
            raise ValueError(f"the tokenizer has no {self.family} markup tokens "
                             f"({', '.join(self.markup)})")
        if self.optional:
            ids.update(markup_ids(tokenizer, self.optional) or {})
        self.tokenizer, self.ids = tokenizer, ids

    def __call__(self, tools: Optional[List[Any]] = None, initial_state: str = "normal",
                 stop_words: Sequence[str] = ()) -> Any:
        return self.parser(stop_machine(tuple(stop_words)), tools, initial_state)

    def parser(self, stops: Optional[TextStateMachine], tools: Optional[List[Any]],
               initial_state: str) -> Any:
        """The family's parser of one answer (``stops``: the stop words' machine)."""
        raise NotImplementedError
