"""A conversation as the agent routes render it: a prefix that only grows from turn to turn.

Agent clients re-send the whole conversation every turn and append to it; the prompt cache
serves such a turn from cache only if its rendering extends the last one's. Peers break
that in three ways, each avoided here:

* Hoisting system messages: Claude Code puts ``system`` messages inside the conversation
  (nudges, reminders after user messages). They stay where the client put them. Where the
  model's chat template refuses a system message after the first (Qwen-style templates
  raise) or silently drops it, `templates.system_policy` finds that out once per template, by
  rendering a probe, and `Conversation.fit_template` then renders each later system
  message inside the adjacent user turn as a ``<system-reminder>`` block: appended to the
  user message before it, else prepended to the user message after it, else as a user
  message of its own. The choice depends only on the message and its neighbours in the
  same request, so turn N+1 renders turn N's messages exactly as turn N did.
* Volatile lines: Claude Code's ``x-anthropic-billing-header: …`` line at the top of the
  system prompt differs on every request (billing metadata, never meant for the model).
  `line_filter` drops it from system text by default (``--keep-billing-header`` keeps
  it), and whole lines matching a user's ``--drop-lines`` regular expression. Only lines
  that *start* with the header name are dropped, so text quoting it stays.
* Re-rendering: tool calls, tool results and earlier turns are passed to the template as
  the same values every time (copied, never rewritten per request).

`layout` renders the prompt once in the HTTP thread (the same call mlx-lm makes, so its
length is ``count_tokens``) and, where the tokenizer reports character offsets, finds where
each message and content part starts (``marks``: the miss explanation names the part a
request diverged in) and where each part, tool or tool call the client marked with
``cache_control`` ends (``cuts``: checkpoint offsets). Its ids are the prompt mlx-lm
then tokenizes without rendering it again (`requests.MarkedRequest.tokenizer_for`).
"""

from __future__ import annotations

import bisect
import copy
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mlx_lm.server import convert_chat, process_message_content


__all__ = ["Conversation", "Layout", "line_filter", "layout", "BILLING_LINE",
           "REMINDER_OPEN", "REMINDER_CLOSE"]

log = logging.getLogger("mlx_kvcache")

#: Claude Code's per-request billing line (anchored: a line starting with it).
BILLING_LINE = r"x-anthropic-billing-header:"
#: How a system message is wrapped inside a user turn where the template refuses it.
REMINDER_OPEN = "<system-reminder>\n"
REMINDER_CLOSE = "\n</system-reminder>"
#: Between a user turn's text and a system message folded into it.
FOLD_SEP = "\n\n"

ROLES = ("system", "user", "assistant", "tool")
#: Tokens re-encoded to check a breakpoint's offset, and characters after it.
_WINDOW = 8
_TAIL = 64
#: Whole-prompt scans spent looking for parts the template rewrote before the layout
#: stops naming parts (`layout`).
_MISSED_SCANS = 2


@dataclass
class Part:
    """One content part: its text (None for a non-text part, kept as ``raw``), the client's
    name for it, and whether the client marked its end for reuse."""

    text: Optional[str]
    label: str
    breakpoint: bool = False
    raw: Optional[Dict[str, Any]] = None


@dataclass
class Message:
    fields: Dict[str, Any]  # everything but content
    parts: List[Part]
    label: str
    #: Indices of its ``tool_calls`` whose end the client marked for reuse.
    marked_calls: List[int] = field(default_factory=list)


def _parts_of(content: Any, label: str, part_labels: Optional[List[str]], where: str) -> List[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Part(content, label)]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts")
    out = []
    for j, p in enumerate(content):
        name = part_labels[j] if part_labels and j < len(part_labels) else f"{label}.content[{j}]"
        if not isinstance(p, dict):
            raise ValueError(f"{where}.content[{j}] must be an object")
        if p.get("type") == "text":
            if not isinstance(p.get("text"), str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            out.append(Part(p["text"], name))
        else:
            out.append(Part(None, name, raw=copy.deepcopy(p)))
    return out


class Conversation:
    """The messages of one request, as parts that keep their names through filtering and
    folding."""

    def __init__(self, messages: List[Message]) -> None:
        self.items = messages

    @classmethod
    def from_call(cls, messages: Sequence[Any], labels: Sequence[str] = (),
                  part_labels: Optional[Sequence[Optional[List[str]]]] = None,
                  breakpoints: Sequence[Tuple[int, int]] = (),
                  call_breakpoints: Sequence[Tuple[int, int]] = ()) -> "Conversation":
        """From OpenAI chat-format messages (see `call.ChatCall`); ValueError names the
        first malformed message. ``breakpoints``: ``(message, part)`` whose end the client
        marked; ``call_breakpoints``: ``(message, tool call)`` likewise."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("the conversation has no messages")
        out = []
        for i, m in enumerate(messages):
            where = labels[i] if i < len(labels) else f"messages[{i}]"
            if not isinstance(m, dict):
                raise ValueError(f"{where} must be an object")
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
            pl = part_labels[i] if part_labels and i < len(part_labels) else None
            parts = _parts_of(m.get("content"), where, pl, where)
            fields = {k: copy.deepcopy(v) for k, v in m.items() if k != "content"}
            out.append(Message(fields, parts, where))
        for i, j in breakpoints:
            if 0 <= i < len(out) and 0 <= j < len(out[i].parts):
                out[i].parts[j].breakpoint = True
        for i, j in call_breakpoints:
            if 0 <= i < len(out) and 0 <= j < len(out[i].fields.get("tool_calls") or ()):
                out[i].marked_calls.append(j)
        return cls(out)

    # -- volatile lines ----------------------------------------------------------------------
    def drop_lines(self, keep: Callable[[str], bool]) -> None:
        """Drop the lines of system text for which ``keep`` is false (with their newline)."""
        for m in self.items:
            if m.fields["role"] != "system":
                continue
            for p in m.parts:
                if p.text:
                    lines = p.text.splitlines(keepends=True)
                    kept = [ln for ln in lines if keep(ln.rstrip("\r\n"))]
                    if len(kept) != len(lines):
                        p.text = "".join(kept)

    # -- templates that refuse later system messages ------------------------------------------
    def fit_template(self, policy: str) -> None:
        """``"in_place"``: nothing to do. ``"fold"``: every system message but a first one
        goes into the adjacent user turn (see the module doc); ``"fold_all"`` (a template
        that takes no system message at all): the first one too."""
        if policy not in ("fold", "fold_all"):
            return
        out: List[Message] = []
        items = self.items
        for i, m in enumerate(items):
            if m.fields["role"] != "system" or (i == 0 and policy == "fold"):
                out.append(m)
                continue
            wrapped = self._wrapped(m)
            prev = out[-1] if out else None
            nxt = items[i + 1] if i + 1 < len(items) else None
            if prev is not None and prev.fields["role"] == "user":
                prev.parts.extend([Part(FOLD_SEP + REMINDER_OPEN, m.label), *wrapped[1:]])
            elif nxt is not None and nxt.fields["role"] == "user":
                nxt.parts[:0] = [*wrapped, Part(FOLD_SEP, m.label)]
            else:
                out.append(Message({"role": "user"}, wrapped, m.label))
        self.items = out

    @staticmethod
    def _wrapped(m: Message) -> List[Part]:
        return [Part(REMINDER_OPEN, m.label), *m.parts, Part(REMINDER_CLOSE, m.label)]

    # -- reasoning kept as generated (--keep-reasoning) --------------------------------------
    def inline_reasoning(self, start: str, end: str) -> None:
        """Put each assistant turn's reasoning back into its text as the model generated it
        (``start`` reasoning ``end`` text), for templates with no switch that keeps the
        reasoning of earlier turns: they render the text as it is (the reasoning field is
        left empty, so none is rendered, or dropped, a second time)."""
        for m in self.items:
            if m.fields["role"] != "assistant" or not m.fields.get("reasoning"):
                continue
            m.parts.insert(0, Part(start + m.fields.pop("reasoning") + end, m.label))
            m.fields["reasoning_content"] = ""

    # -- answers given back as the template wants them ----------------------------------------
    def one_call_per_message(self) -> None:
        """Each assistant message with several tool calls becomes one message per call, for
        templates that render one call of a message (`templates.one_call_per_message`):
        the first keeps the text and reasoning, the others carry their call alone."""
        out: List[Message] = []
        for m in self.items:
            calls = m.fields.get("tool_calls") or []
            if m.fields["role"] != "assistant" or len(calls) < 2:
                out.append(m)
                continue
            for j, call in enumerate(calls):
                fields = dict(m.fields) if j == 0 else {"role": "assistant"}
                fields["tool_calls"] = [call]
                out.append(Message(fields, m.parts if j == 0 else [], m.label,
                                   [0] if j in m.marked_calls else []))
        self.items = out

    def reasoning_beside_calls(self) -> None:
        """An assistant message with tool calls, text and reasoning keeps its reasoning
        only, for templates that render one analysis message before a call and refuse
        both (`templates.reasoning_or_content`: gpt-oss's)."""
        for m in self.items:
            if m.fields["role"] == "assistant" and m.fields.get("tool_calls") and \
                    m.fields.get("reasoning") and any(p.text for p in m.parts):
                m.parts = []

    # -- what mlx-lm renders -----------------------------------------------------------------
    def messages(self) -> List[Dict[str, Any]]:
        """OpenAI chat-format messages: text content joined into a string (as mlx-lm
        joins a list of text parts), content with other parts as a list; the reasoning
        under each name templates read it by (``reasoning_content``: Qwen3's, GLM's;
        ``thinking``: gpt-oss's); no empty ``tool_calls`` (Llama 3's template takes any as
        calls)."""
        out = []
        for m in self.items:
            d = copy.deepcopy(m.fields)
            if all(p.text is not None for p in m.parts):
                d["content"] = "".join(p.text for p in m.parts)
            else:
                d["content"] = [{"type": "text", "text": p.text} if p.text is not None else p.raw
                                for p in m.parts]
            if d.get("reasoning"):
                d.setdefault("reasoning_content", d["reasoning"])
                d.setdefault("thinking", d["reasoning"])
            if "tool_calls" in d and not d["tool_calls"]:
                del d["tool_calls"]
            out.append(d)
        return out

    def has_images(self) -> bool:
        return any(p.text is None for m in self.items for p in m.parts)


def line_filter(keep_billing: bool = False, extra: Optional[str] = None) -> Callable[[str], bool]:
    """Whether a line of system text stays: not the billing line (unless
    ``keep_billing``), not a line ``extra`` (a regular expression) matches at its start."""
    pats = []
    if not keep_billing:
        pats.append(re.compile(re.escape(BILLING_LINE)))
    if extra:
        pats.append(re.compile(extra))
    return lambda line: not any(p.match(line) for p in pats)


# -- the rendered prompt's layout ----------------------------------------------------------
@dataclass
class Layout:
    """``prompt_tokens``: the prompt's length. ``cuts``: token offsets where a part the
    client marked ends. ``marks``: ``(token offset, name)`` where each message (its
    template markup) and each content part starts, in order. ``ids``: the prompt (None
    with images, whose prompt the image processor makes)."""

    prompt_tokens: int
    cuts: List[int] = field(default_factory=list)
    marks: List[Tuple[int, str]] = field(default_factory=list)
    #: The prompt's ids, where they are the chat template's text encoded (no images).
    ids: Optional[List[int]] = None
    #: With images: the template's text (one image token per image) and the images' URLs,
    #: for `processed_tokens`.
    text: Optional[str] = None
    images: List[str] = field(default_factory=list)


def layout(tokenizer, conv: Conversation, tools, template_args: Optional[Dict[str, Any]] = None,
           vision: bool = False, marked_tools: Sequence[int] = (),
           text_arguments: bool = False) -> Layout:
    """Render ``conv`` as mlx-lm's chat route will; ValueError when the template refuses it
    or it has images the model cannot see (``vision``: the model has an image processor).
    With images the length is the text's (the processor expands each image later).
    ``marked_tools``: indices of ``tools`` whose end the client marked for reuse.
    ``text_arguments``: the template takes tool call arguments as JSON text, not as the
    objects mlx-lm makes of them (`templates.arguments_as_text`: DeepSeek's)."""
    msgs = conv.messages()
    if conv.has_images() and not vision:
        raise ValueError("this model serves no images (it has no image processor); send text only")
    if not getattr(tokenizer, "has_chat_template", False):
        return Layout(len(tokenizer.encode(convert_chat(msgs, None))))
    try:
        urls = process_message_content(msgs, keep_images=vision) or []
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unsupported message content: {e}") from None
    if text_arguments:
        as_text(msgs)
    kw = dict(template_args or {})
    kw["add_generation_prompt"] = not kw.get("continue_final_message")  # (see `generation`)
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, **kw)
    except Exception as e:  # the template's own refusal (jinja raise_exception) and the like
        raise ValueError(f"the model's chat template refused this conversation: {e}") from None
    # One render, one encoding: the template's text encoded without added special tokens
    # is what mlx-lm's ``apply_chat_template(tokenize=True)`` returns.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        enc = backend.encode(text, add_special_tokens=False) if backend is not None else None
        ids = list(enc.ids) if enc is not None else list(tokenizer.encode(text, add_special_tokens=False))
    except (TypeError, UnicodeError) as e:  # a lone surrogate the template passed through
        raise ValueError(f"the rendered prompt cannot be encoded by the model's tokenizer "
                         f"(it holds text that is not valid Unicode: {e})") from None
    out = Layout(len(ids), ids=None if conv.has_images() else ids)
    if urls:
        out.text, out.images = text, list(urls)
    if enc is None:
        return out
    starts = [a for a, _ in enc.offsets]

    def token_at(char: int) -> int:  # the token holding character ``char``
        return max(0, bisect.bisect_right(starts, char) - 1)

    cursor = 0
    # A part the template rewrote (trimmed, escaped) is not found, and looking for it scans
    # the rest of the prompt: past `_MISSED_SCANS` such scans of the whole prompt, the
    # layout stops naming parts and placing their breakpoints (the explanation names less,
    # a marked part past there gets no checkpoint; the prompt is the same), so a request
    # of many rewritten parts costs linear time, not parts x prompt.
    missed = 0
    for n, m in enumerate(conv.items):
        if missed > _MISSED_SCANS * len(text):
            log.debug("mlx_kvcache: the layout names no parts past %s (the template "
                      "rewrote too many)", m.label)
            break
        # Template text between two messages (closing one, opening the next) is named
        # after both: a change there is either one's edge.
        gap = (f"the template's text before {m.label}" if n == 0 else
               f"the template's text between {conv.items[n - 1].label} and {m.label}")
        out.marks.append((token_at(cursor), gap))
        for p in m.parts:
            if p.text is None:
                continue
            at = text.find(p.text, cursor) if p.text else cursor
            if at < 0:
                missed += len(text) - cursor
                continue
            out.marks.append((token_at(at), p.label))
            cursor = at + len(p.text)
            if p.breakpoint:
                cut = _cut(backend, text[:cursor], ids, starts, cursor)
                if 0 < cut < len(ids):
                    out.cuts.append(cut)
    out.cuts += _item_cuts(tokenizer, backend, text, ids, starts, conv, msgs, tools,
                           marked_tools, kw)
    out.cuts = sorted(c for c in set(out.cuts) if 0 < c < len(ids))
    return out


def as_text(msgs: List[Dict[str, Any]]) -> None:
    """Each tool call's arguments of ``msgs`` (objects, as mlx-lm hands them to templates)
    back to JSON text, in place, for templates that add them to text."""
    for m in msgs:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and not isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.dumps(fn.get("arguments"), ensure_ascii=False)


def processed_tokens(tokenizer, processor, lay: Layout) -> int:
    """The length of a prompt with images once the model's image processor has expanded
    each image into its tokens — the prompt mlx-lm's chat route gives the model (its own
    image decoding and processor); ValueError when an image cannot be read."""
    from mlx_lm.server import _decode_image

    try:
        text, _ = processor(lay.text, images=[_decode_image(u) for u in lay.images])
    except Exception as e:  # noqa: BLE001 - a bad image, as mlx-lm's route would fail it
        raise ValueError(f"the images could not be read: {e}") from None
    return len(tokenizer.encode(text, add_special_tokens=False))


def _item_cuts(tokenizer, backend, text: str, ids: List[int], starts: List[int],
               conv: Conversation, msgs: List[Dict[str, Any]], tools, marked_tools: Sequence[int],
               kw: Dict[str, Any]) -> List[int]:
    """Where the marked tools and tool calls end in the prompt. They have no text of the
    client's to find there: where one ends is the first token where renderings that keep
    everything up to it and change what follows (nothing more, or one more item) stop
    agreeing with the prompt."""
    def render(changed, tls) -> Optional[str]:
        try:
            return tokenizer.apply_chat_template(changed, tools=tls, tokenize=False, **kw)
        except Exception:  # a template that refuses the probe: no cut there
            return None

    def end_of(variants: List[Optional[str]]) -> int:
        cuts = [_cut(backend, v, ids, starts, _common_text(text, v))
                for v in variants if v is not None and v != text]
        return min(cuts) if cuts else 0

    out = []
    for k in marked_tools:
        if 0 <= k < len(tools or ()):
            out.append(end_of([render(msgs, list(tools[:k + 1]) + extra)
                               for extra in ([], [_PROBE_TOOL])]))
    for n, m in enumerate(conv.items):
        calls = msgs[n].get("tool_calls") or []  # as mlx-lm hands them to the template
        for j in m.marked_calls:
            variants = []
            for extra in ([], [_PROBE_CALL]):
                changed = [dict(d) for d in msgs]
                changed[n]["tool_calls"] = list(calls[:j + 1]) + extra
                variants.append(render(changed, tools))
            out.append(end_of(variants))
    return out


_PROBE_TOOL = {"type": "function", "function": {"name": "zq7_probe", "description": "zq7",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "zq7_probe", "type": "function",
               "function": {"name": "zq7_probe", "arguments": "{}"}}


def _common_text(a: str, b: str) -> int:
    """The length of the common prefix of ``a`` and ``b`` (compared by slices: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _cut(backend, other: str, ids: List[int], starts: List[int], end: int) -> int:
    """The number of prompt tokens ``other`` shares with the prompt, where ``other`` is a
    text that agrees with the prompt's text up to character ``end`` and not after (the
    prompt's text cut at ``end``, or a rendering changed after it): where their tokens
    stop agreeing (a token merging across ``end`` belongs to what follows). Encodes only
    the text of the last few tokens before ``end`` and a few characters after it, from a
    token boundary (pre-tokenization makes tokens there independent of what came before),
    not the whole prefix."""
    guess = bisect.bisect_left(starts, end)
    lo = max(0, guess - _WINDOW)
    while lo > 0 and starts[lo] >= end:
        lo -= 1
    window = backend.encode(other[starts[lo]:end + _TAIL], add_special_tokens=False).ids
    return lo + _common(window, ids[lo:lo + len(window)])
