"""The registry of output parsers: which one reads a model's answers, chosen per model.

`parser_for` looks at the model's tokenizer (mlx-lm's ``TokenizerWrapper``) and takes the
first entry of `ENTRIES` that fits:

1. ``mlx_lm:<name>`` — mlx-lm has a tool parser for the model (the tokenizer config's
   ``tool_parser_type``, or mlx-lm's own inference from the chat template and vocabulary,
   made when it loaded the tokenizer): mlx-lm's parsing, exactly as its chat route does it
   (`mlxlm`), except that a call it cannot read comes back as `UnreadCall`;
2. ``harmony`` — gpt-oss: the vocabulary has harmony's markup as tokens
   (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|call|>``, …; `harmony`);
3. ``deepseek`` — DeepSeek V3 / V3.1 / R1: the vocabulary has
   ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁sep｜>`` as tokens and the chat template (if any)
   writes calls with them (`deepseek`);
4. ``llama3`` — Llama 3.1 / 3.2 / 3.3: the vocabulary has ``<|python_tag|>``,
   ``<|eom_id|>``, ``<|eot_id|>`` and the chat template is Llama's (its ``ipython`` role;
   `llama3`);
5. ``mlx_lm`` — anything else: mlx-lm's parsing without tool calls (text, and reasoning
   where the tokenizer has thinking markup).

The choice is a `Chosen`: a `ParserFactory` that also says its ``name`` and ``why`` (for
the start log). ``parser_for(tokenizer, name)`` forces an entry by name (an error names
the entries when it does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from .base import OutputParser, ParserFactory
from .deepseek import CALL_BEGIN, DeepSeekEntry
from .deepseek import MARKUP as DEEPSEEK_MARKUP
from .harmony import MARKUP as HARMONY_MARKUP
from .harmony import HarmonyEntry
from .llama3 import MARKUP as LLAMA3_MARKUP
from .llama3 import Llama3Entry
from .markup import markup_ids
from .mlxlm import MlxLmEntry

__all__ = ["Entry", "ENTRIES", "Chosen", "parser_for", "entry_names", "prompt_state"]


@dataclass(frozen=True)
class Entry:
    """One kind of parser: ``fits(tokenizer)`` says why it reads that model's answers (or
    None when it does not); ``build(tokenizer)`` makes its `ParserFactory`."""

    name: str
    fits: Callable[[Any], Optional[str]]
    build: Callable[[Any], ParserFactory]


@dataclass(frozen=True)
class Chosen:
    """The parser chosen for a model: a `ParserFactory` with its ``name`` and ``why``."""

    name: str
    why: str
    factory: ParserFactory

    def __call__(self, tools: Optional[List[Any]] = None, initial_state: str = "normal",
                 stop_words: Sequence[str] = ()) -> OutputParser:
        return self.factory(tools, initial_state, stop_words)

    def describe(self) -> str:
        """One line for the start log."""
        return f"output parser: {self.name} ({self.why})"

    @property
    def mlx_lm(self) -> bool:
        """Whether this is mlx-lm's own parsing (its chat route reads the same)."""
        return self.name.startswith("mlx_lm")


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)  # foreign: HF tokenizers may lack it
    return template if isinstance(template, str) else ""


def _mlx_lm_tools(tokenizer: Any) -> Optional[str]:
    parse = tokenizer.tool_parser
    if parse is None:
        return None
    return (f"mlx-lm's {_mlx_lm_name(tokenizer)} tool parser, named by the tokenizer config's "
            "tool_parser_type or inferred by mlx-lm from the chat template")


def _mlx_lm_name(tokenizer: Any) -> str:
    parse = tokenizer.tool_parser
    return "" if parse is None else parse.__module__.rsplit(".", 1)[-1]


def _harmony(tokenizer: Any) -> Optional[str]:
    if markup_ids(tokenizer, HARMONY_MARKUP) is None:
        return None
    return "gpt-oss's harmony markup (<|channel|>, <|message|>, <|call|>, …) is in its vocabulary"


def _deepseek(tokenizer: Any) -> Optional[str]:
    if markup_ids(tokenizer, DEEPSEEK_MARKUP) is None:
        return None
    template = _template(tokenizer)
    if template and CALL_BEGIN not in template:
        return None  # the tokens, but calls written otherwise (V3.2's DSML)
    return "DeepSeek's <｜tool▁call▁begin｜> markup is in its vocabulary and chat template"


def _llama3(tokenizer: Any) -> Optional[str]:
    if markup_ids(tokenizer, LLAMA3_MARKUP) is None or "ipython" not in _template(tokenizer):
        return None
    return "Llama 3.x's <|python_tag|> / <|eom_id|> tokens and its chat template (ipython role)"


#: The entries, in the order `parser_for` tries them.
ENTRIES = (
    Entry("mlx_lm_tools", _mlx_lm_tools, MlxLmEntry),
    Entry("harmony", _harmony, HarmonyEntry),
    Entry("deepseek", _deepseek, DeepSeekEntry),
    Entry("llama3", _llama3, Llama3Entry),
    Entry("mlx_lm", lambda tokenizer: "no tool-call format known for this model: mlx-lm's "
                                       "text and reasoning split", MlxLmEntry),
)


def entry_names() -> List[str]:
    """The names ``parser_for`` takes (``mlx_lm:<parser>`` is mlx-lm's with a tool parser)."""
    return ["mlx_lm:<mlx-lm tool parser>" if e.name == "mlx_lm_tools" else e.name
            for e in ENTRIES]


def _chosen(entry: Entry, tokenizer: Any, why: str) -> Chosen:
    name = entry.name
    if name == "mlx_lm_tools":
        name = f"mlx_lm:{_mlx_lm_name(tokenizer)}"
    return Chosen(name, why, entry.build(tokenizer))


def parser_for(tokenizer: Any, name: Optional[str] = None) -> Chosen:
    """The parser for the model whose tokenizer (mlx-lm's ``TokenizerWrapper``) is
    ``tokenizer``: the first entry of `ENTRIES` that fits, or the entry ``name`` (a
    ``ValueError`` names the entries when it is unknown or does not fit this model)."""
    if name is None:
        for entry in ENTRIES:
            why = entry.fits(tokenizer)
            if why is not None:
                return _chosen(entry, tokenizer, why)
        raise AssertionError("the last entry fits every model")
    wanted = "mlx_lm_tools" if name.startswith("mlx_lm:") else name
    entry = next((e for e in ENTRIES if e.name == wanted), None)
    if entry is None:
        raise ValueError(f"no output parser {name!r}: the parsers are "
                         + ", ".join(entry_names()))
    why = entry.fits(tokenizer)
    if why is None or (wanted == "mlx_lm_tools" and name != f"mlx_lm:{_mlx_lm_name(tokenizer)}"):
        raise ValueError(f"the output parser {name!r} does not fit this model (its markup is "
                         "not in the tokenizer); the parsers are " + ", ".join(entry_names()))
    return _chosen(entry, tokenizer, why)


def prompt_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """The state a prompt leaves the model in, by mlx-lm's rule (its server's tokenizing):
    ``"reasoning"`` when the prompt's last thinking start comes after its last thinking end
    (the template opened the reasoning block), else ``"normal"``; a response format's
    initial state wins."""
    state = "normal"
    if tokenizer.has_thinking:
        prompt = list(prompt)
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            state = "reasoning"
    return tokenizer.response_initial_state or state
