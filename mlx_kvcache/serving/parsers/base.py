"""What every output parser is: fed an answer's tokens (and their text) as they are
generated, it says what they are — the answer's text, its reasoning, tool calls — as typed
`Output` events, and at the end what is left.

One parser object per answer (`ParserFactory` makes them): parsers keep state (the channel
the model writes in, a call's arguments so far) and are never shared between answers.

The contract every entry keeps:

* **Nothing is lost.** Every character the model wrote that is not markup comes out as
  `Text`, `Reasoning` or inside a `Call`. A call the parser cannot read comes out as
  `UnreadCall` with its raw markup (the front door turns it into text and logs it).
* **A call streams where it can.** A parser that knows a call's name before its
  arguments are complete may say `CallBegin` and then `CallArguments` deltas; the
  concatenated deltas are a prefix of the final `Call.arguments` when the call completes.
  A begun call always ends with `Call` (complete), `CallCut` (the answer stopped inside
  it: the token limit) or `UnreadCall` with the begun call's ``index`` (its markup closed
  but what was written cannot be read: arguments that are not a JSON object). A parser
  that cannot stream gives the whole `Call` at once.
* **Stop reasons follow what came out**: `made_calls` is true once a `Call` was given.
* **The last token ends the answer**: it carries ``finish_reason``. With ``"stop"`` it is
  the stop token — an end-of-sequence token or a stop word's last token — and only read
  where it is the family's own markup (harmony's ``<|call|>``); text held back because it
  might begin a stop word is dropped, as mlx-lm drops it. With ``"length"`` everything held
  back comes out, and a call still open is cut: `CallCut` once it began streaming, else
  `UnreadCall` (mlx-lm's entry reads it as mlx-lm does: a `Call` if its parser can).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Sequence, Tuple, Union

__all__ = ["Text", "Reasoning", "CallBegin", "CallArguments", "Call", "CallCut", "UnreadCall",
           "Output", "OutputParser", "ParserFactory", "partial_arguments"]


@dataclass(frozen=True)
class Text:
    """Answer text for the client (a delta)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text (a delta): Qwen3's ``<think>``, harmony's ``analysis`` channel, …"""

    text: str


@dataclass(frozen=True)
class CallBegin:
    """A tool call's name is known; its arguments follow as `CallArguments`.
    ``index``: the call's number in this answer, from 0."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of call ``index``'s arguments (JSON text)."""

    index: int
    delta: str


@dataclass(frozen=True)
class Call:
    """One complete tool call: ``name`` and ``arguments`` (a JSON object, as text).
    ``index`` as in `CallBegin` (a call that streamed keeps its index). ``id``: the call's
    id where the model's markup names one (mlx-lm's ``mistral`` parser reads it), else
    None (the front door makes one)."""

    index: int
    name: str
    arguments: str
    id: Optional[str] = None


@dataclass(frozen=True)
class CallCut:
    """Call ``index`` began but the answer stopped inside it (the token limit):
    ``arguments`` is what was written of them (not complete JSON)."""

    index: int
    name: str
    arguments: str


@dataclass(frozen=True)
class UnreadCall:
    """Markup of a tool call the parser cannot read (``raw``: as generated, start and end
    markers included where they were written); ``problem`` says why. ``index``: the call
    it ends when `CallBegin` was given for it (the name was read, the arguments were not),
    else None."""

    raw: str
    problem: str
    index: Optional[int] = None


Output = Union[Text, Reasoning, CallBegin, CallArguments, Call, CallCut, UnreadCall]


class OutputParser(Protocol):
    """One answer's parser."""

    def feed(self, token: int, text: str, finish_reason: Optional[str] = None) -> List[Output]:
        """The next generated ``token`` and its ``text`` (mlx-lm's detokenizer segment, as
        its server makes them: may be empty while a character is incomplete, may carry an
        earlier token's held-back text; on a ``"stop"`` token, whatever mlx-lm gives — it is
        dropped). mlx-lm's own entry reads the text; the token-level entries read the token
        and decode their content with the model's tokenizer themselves. ``finish_reason``
        (``"stop"``, ``"length"``) on the answer's last token: the parser gives everything
        that is left (see the module doc)."""

    @property
    def made_calls(self) -> bool:
        """Whether a complete `Call` came out."""


class ParserFactory(Protocol):
    """Makes the parser of one answer."""

    def __call__(self, tools: Optional[List[Any]] = None, initial_state: str = "normal",
                 stop_words: Sequence[str] = ()) -> OutputParser:
        """``tools``: the tools the request offered (OpenAI function tools, or None);
        ``initial_state``: the state the prompt leaves the model in (``"normal"``,
        ``"reasoning"``: the prompt opened a reasoning block; mlx-lm's rule,
        `registry.prompt_state`); ``stop_words``: the request's stop strings (their text
        is held back until it cannot be one, and never comes out)."""


def partial_arguments(text: str) -> dict:
    """What a call's arguments cut off mid-way (`CallCut`) say so far, as an object: the
    JSON prefix ``text`` closed where it stopped (an open string, array or object closed; a
    dangling key, colon or comma dropped) — as the Anthropic API gives the input of a
    ``tool_use`` block the token limit cut. ``{}`` where nothing can be read."""
    import json

    _, in_string, escaped = _scan(text)
    body = (text[:-1] if escaped else text) + ('"' if in_string else "")
    # the shortest tail dropped that leaves valid JSON (bounded: a value is rarely longer)
    for cut in range(len(body), max(0, len(body) - 256), -1):
        head = body[:cut].rstrip()
        if head.endswith((",", ":")):
            continue
        stack, open_string, _ = _scan(head)
        try:
            value = json.loads(head + ('"' if open_string else "") + "".join(reversed(stack)))
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _scan(text: str) -> Tuple[List[str], bool, bool]:
    """The closers JSON ``text`` still needs (innermost last), whether it ends inside a
    string, and whether that string ends on a lone backslash."""
    stack: List[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return stack, in_string, escaped
