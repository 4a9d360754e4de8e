"""The chat template's questions the server asks, each answered once by rendering probes.

* `answer_extends_prompt` — where a chat client's next request goes on from this one: past
  the answer, or back at the generation prompt. A chat client sends the conversation with
  the model's answer appended. Whether that next prompt extends this prompt and the answer
  depends on the chat template: a ChatML-style template renders its generation prompt
  (``<|im_start|>assistant\\n``) exactly as the answer's turn opens in the history, so the
  next request diverges only after the answer ends (where the prompt cache stores the
  caches anyway). A thinking template renders a generation prompt the history does not
  repeat (an empty ``<think></think>`` pair, or the answer's reasoning dropped from the
  history), so the next request diverges right after the input: hybrid and sliding-window
  models then restore only where a state was stored before that point, which is what the
  prompt cache's stop a few tokens before the end is for (`prefix.planner.stops`,
  ``guess_end``).
* `system_policy` — whether it renders later system messages in place (the agent routes'
  `conversation` folds them into the adjacent user turn where it does not).
* `honours_thinking` — whether it honours ``enable_thinking``.
* `reasoning_switches` — what makes it render earlier turns' reasoning (``--keep-reasoning``):
  nothing, its own switches, or no switch at all.
* `one_call_per_message` — whether it renders only one tool call of an assistant message
  (Llama 3's raises on more, gpt-oss's renders the first): answers are given back one call
  per message.
* `arguments_as_text` — whether it takes tool call arguments as JSON text and refuses the
  objects mlx-lm makes of them (DeepSeek's).
* `reasoning_or_content` — whether it refuses an assistant message with tool calls that has
  both text and reasoning (gpt-oss's).

Each answer depends only on the template and its arguments, so it is decided once and
remembered (`decided`), keyed by the tokenizer, its template's text and the arguments (a
reloaded model with another template is asked again). Deterministic probes, so every rank
of a sharded model decides the same.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from ...prefix.tokens import common_prefix

__all__ = ["decided", "answer_extends_prompt", "answer_turn_differs", "system_policy",
           "honours_thinking", "reasoning_switches", "REASONING_SWITCHES", "one_call_per_message",
           "reasoning_or_content", "arguments_as_text"]

log = logging.getLogger("mlx_kvcache")

T = TypeVar("T")

_lock = threading.Lock()
_answers: Dict[Tuple[int, str, str, str], Any] = {}


def decided(tokenizer, question: str, template_args: Optional[Dict[str, Any]],
            probe: Callable[[], T]) -> T:
    """``probe()``'s answer to ``question`` for ``tokenizer``'s chat template with
    ``template_args``: computed the first time (outside the lock: a probe renders the
    template, and two threads asking at once both get the same answer), remembered after."""
    template = getattr(tokenizer, "chat_template", None)
    digest = hashlib.blake2b(str(template).encode(), digest_size=8).hexdigest()
    key = (id(tokenizer), digest, question, repr(sorted((template_args or {}).items())))
    with _lock:
        if key in _answers:
            return _answers[key]
    answer = probe()
    with _lock:
        return _answers.setdefault(key, answer)


# -- the questions ---------------------------------------------------------------------------
_PROBE_USER, _PROBE_ANSWER, _PROBE_NEXT = "Ping 7", "Pong 7.", "Again"


def answer_extends_prompt(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the next request of a conversation extends this prompt and its answer:
    the template's rendering of ``[user]`` with the generation prompt, followed by the
    answer's text, starts the rendering of ``[user, assistant, user]``, and the model does
    not reason first (a reasoning model's answer comes back without its reasoning).
    False where it cannot be told (no chat template, a template that raises).
    ``template_args``: the chat template's arguments (``enable_thinking``, …)."""
    def probe() -> bool:
        extends = _probe(tokenizer, dict(template_args or {}))
        log.info("mlx_kvcache: the chat template %s",
                 "re-renders its generation prompt as the answer's turn: a conversation's "
                 "next request goes on past the answer" if extends else
                 "does not re-render its generation prompt as the answer's turn (or the "
                 "model reasons first): hybrid and sliding-window models also store the "
                 "caches a few tokens before each prompt's end")
        return extends
    return decided(tokenizer, "answer_extends_prompt", template_args, probe)


#: The most tokens of a generation prompt the answer's turn may not re-render and still be
#: told: past it the probe is reading something else (a template that renders the last
#: user turn differently once it is not the last).
TURN_DIFFERS_MOST = 64


def answer_turn_differs(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> int:
    """How many of the generation prompt's last tokens the conversation's next request
    does not render again as the answer's turn (Qwen3 without thinking: the empty
    reasoning block, rendered only for the turn being answered): the next request leaves
    this prompt that many tokens before its end, where a hybrid or sliding-window model
    needs a checkpoint to restore. 0 where the turn renders as the prompt ended, or it
    cannot be told (no chat template, a template that raises, more than
    `TURN_DIFFERS_MOST`)."""
    args = dict(template_args or {})

    def probe() -> int:
        if not getattr(tokenizer, "has_chat_template", False):
            return 0
        user = {"role": "user", "content": _PROBE_USER}
        try:
            prompt = list(tokenizer.apply_chat_template(
                [user], add_generation_prompt=True, tokenize=True, **args))
            after = list(tokenizer.apply_chat_template(
                [user, {"role": "assistant", "content": _PROBE_ANSWER},
                 {"role": "user", "content": _PROBE_NEXT}],
                add_generation_prompt=True, tokenize=True, **args))
        except Exception:  # noqa: BLE001 - a template that refuses the probe: nothing known
            return 0
        differs = len(prompt) - common_prefix(prompt, after)
        return differs if differs <= TURN_DIFFERS_MOST else 0
    return decided(tokenizer, "answer_turn_differs", template_args, probe)


def _probe(tokenizer, template_args: Dict[str, Any]) -> bool:
    if not getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "has_thinking",
                                                                     False):
        return False
    user = {"role": "user", "content": _PROBE_USER}
    try:
        prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True,
                                               tokenize=False, **template_args)
        after = tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": _PROBE_ANSWER},
             {"role": "user", "content": _PROBE_NEXT}],
            add_generation_prompt=True, tokenize=False, **template_args)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: keep the stop
        return False
    return isinstance(prompt, str) and isinstance(after, str) and after.startswith(
        prompt + _PROBE_ANSWER)


_PROBE_MARK = "zq7-probe-system"


def system_policy(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> str:
    """``"in_place"`` when the chat template renders a system message after the first where
    it stands, ``"fold_all"`` when it renders no system message at all, else ``"fold"``.
    Probed once per template (and template arguments: `decided`)."""
    probes = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
         {"role": "assistant", "content": "A"}, {"role": "system", "content": _PROBE_MARK},
         {"role": "user", "content": "V"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
         {"role": "system", "content": _PROBE_MARK}],
    ]

    def renders(msgs) -> bool:
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                 **(template_args or {}))
        except Exception:
            return False
        return isinstance(text, str) and _PROBE_MARK in text

    def probe() -> str:
        if not renders([{"role": "system", "content": _PROBE_MARK},
                        {"role": "user", "content": "U"}]):
            policy = "fold_all"
        elif all(renders(msgs) for msgs in probes):
            policy = "in_place"
        else:
            policy = "fold"
        log.info("mlx_kvcache: the chat template %s; system messages inside the conversation "
                 "are rendered %s", "renders later system messages in place"
                 if policy == "in_place" else "refuses later system messages",
                 "where they are" if policy == "in_place" else "inside the adjacent user turn")
        if policy == "fold_all":
            log.info("mlx_kvcache: the chat template renders no system message: the first one "
                     "goes into the first user turn too")
        return policy
    return decided(tokenizer, "system_policy", template_args, probe)


def honours_thinking(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the chat template renders differently with ``enable_thinking`` on and off
    (mlx-lm's tokenizer passes it under the name the template reads). Probed once per
    template (and template arguments: `decided`)."""
    def probe() -> bool:
        msgs = [{"role": "user", "content": "U"}]
        try:
            on, off = (tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=False,
                                                     **{**(template_args or {}),
                                                        "enable_thinking": flag})
                       for flag in (True, False))
        except Exception:  # a template that refuses the flag does not honour it
            return False
        return on != off
    return decided(tokenizer, "honours_thinking", template_args, probe)


#: The switches templates that can keep earlier turns' reasoning read (Qwen3.6+'s
#: ``preserve_thinking``, GLM-4.6+'s ``clear_thinking``).
REASONING_SWITCHES = {"preserve_thinking": True, "clear_thinking": False}
_PROBE_THOUGHT = "zq7-probe-thought"


def reasoning_switches(tokenizer, template_args: Optional[Dict[str, Any]] = None
                       ) -> Optional[Dict[str, Any]]:
    """What the chat template needs to render the reasoning of an assistant turn before the
    last user message: ``{}`` (it does already), `REASONING_SWITCHES` (its own switches do
    it), or None (it cannot: the caller puts the reasoning into the turn's text). Probed
    once per template (and template arguments: `decided`)."""
    msgs = [{"role": "user", "content": "U"},
            {"role": "assistant", "content": "A", "reasoning_content": _PROBE_THOUGHT},
            {"role": "user", "content": "V"}]

    def shows(args: Dict[str, Any]) -> bool:
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tokenize=False, **args)
        except Exception:  # a template that refuses the probe: it does not show it
            return False
        return isinstance(text, str) and _PROBE_THOUGHT in text

    def probe() -> Optional[Dict[str, Any]]:
        base = dict(template_args or {})
        if shows(base):
            return {}
        if shows({**base, **REASONING_SWITCHES}):
            return dict(REASONING_SWITCHES)
        return None
    return decided(tokenizer, "reasoning_switches", template_args, probe)


# -- how the template wants an answer given back ---------------------------------------------
_PROBE_CALLS = [{"id": "c1", "type": "function",
                 "function": {"name": "zq7_first", "arguments": {"a": 1}}},
                {"id": "c2", "type": "function",
                 "function": {"name": "zq7_second", "arguments": {"b": 2}}}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": n, "description": "zq7",
                                                  "parameters": {"type": "object",
                                                                 "properties": {}}}}
                for n in ("zq7_first", "zq7_second")]


def _render_calls(tokenizer, template_args: Optional[Dict[str, Any]], assistant: Dict[str, Any]
                  ) -> Optional[str]:
    msgs = [{"role": "user", "content": "U"}, {"role": "assistant", **assistant},
            {"role": "tool", "tool_call_id": "c1", "content": "R"},
            {"role": "user", "content": "V"}]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=_PROBE_TOOLS, add_generation_prompt=True,
                                             tokenize=False, **(template_args or {}))
    except Exception:  # noqa: BLE001 - a template that refuses the probe
        return None
    return text if isinstance(text, str) else None


def one_call_per_message(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the chat template renders only one tool call of an assistant message (or
    refuses more than one: Llama 3's, gpt-oss's): an answer with several calls is then
    given back as one assistant message per call, each rendered. False where it renders
    them all, or where it cannot be told (no tools in the template)."""
    def probe() -> bool:
        both = _render_calls(tokenizer, template_args,
                             {"content": "", "tool_calls": list(_PROBE_CALLS)})
        one = _render_calls(tokenizer, template_args,
                            {"content": "", "tool_calls": list(_PROBE_CALLS[:1])})
        if one is None or "zq7_first" not in one:
            return False  # the template renders no calls this way at all: nothing to split
        return both is None or "zq7_second" not in both
    return decided(tokenizer, "one_call_per_message", template_args, probe)


def arguments_as_text(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the chat template takes tool call arguments as JSON text and refuses the
    objects mlx-lm makes of them (DeepSeek's add them to text: ``... + arguments``)."""
    def probe() -> bool:
        as_objects = _render_calls(tokenizer, template_args,
                                   {"content": "", "tool_calls": list(_PROBE_CALLS[:1])})
        text = [{**c, "function": {**c["function"], "arguments": '{"a": 1}'}}
                for c in _PROBE_CALLS[:1]]
        as_text = _render_calls(tokenizer, template_args, {"content": "", "tool_calls": text})
        return as_objects is None and as_text is not None
    return decided(tokenizer, "arguments_as_text", template_args, probe)


def reasoning_or_content(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the chat template refuses an assistant message with tool calls that has
    both text and reasoning (gpt-oss's: it renders one analysis message before a call):
    such a message is then given back with its reasoning only."""
    def probe() -> bool:
        calls = {"tool_calls": list(_PROBE_CALLS[:1])}
        plain = _render_calls(tokenizer, template_args, {"content": "T", **calls})
        both = _render_calls(tokenizer, template_args,
                             {"content": "T", "thinking": "H", "reasoning_content": "H",
                              **calls})
        return plain is not None and both is None
    return decided(tokenizer, "reasoning_or_content", template_args, probe)
