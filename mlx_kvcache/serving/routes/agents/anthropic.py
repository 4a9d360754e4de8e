"""The Anthropic Messages API: ``POST /v1/messages`` (also ``?beta=true``), streamed and
not, and ``POST /v1/messages/count_tokens`` — what Claude Code speaks.

A request becomes a `call.ChatCall` (OpenAI chat-format messages, in the client's order):
``system`` (a string or text blocks) is the first system message; a ``system`` message
inside ``messages`` stays where it is (`conversation`); ``text`` blocks are content parts;
``image`` blocks image parts (served where the model has an image processor, else a 400
that says so); an assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as JSON),
its ``thinking`` blocks its ``reasoning`` (rendered as the template renders reasoning;
``redacted_thinking`` has no text and is dropped); a user's ``tool_result`` blocks tool
messages (before the user's text, in block order; ``is_error`` prefixes ``Error: ``).
``cache_control`` on a text, ``tool_use``, ``tool_result`` or system block, or on a tool,
is a checkpoint at the block's (the tool's) end; at most `MAX_BREAKPOINTS` (4) of them, as
the API (more: its 400). ``tools`` (``name``, ``description``, ``input_schema``) go to the chat template as
function tools; server tools (a ``type`` other than ``custom``) are skipped with a log
line. ``tool_choice``: ``none`` gives the template no tools, ``{"type": "tool", "name"}``
only that one (a 400 when it is not among ``tools``); ``auto`` and ``any`` give it all
(a template cannot force a call). ``temperature`` / ``top_p`` / ``top_k``
are used when present, else the server's defaults; ``metadata.user_id`` names the session
(Claude Code's ``session_id`` inside it: `session_of`). ``max_tokens`` is clamped to what
the model's context leaves; without it the answer may run to the end of the context
(`context.answer_tokens`); a prompt over the context is a 400 ``prompt is too long: N
tokens > M maximum`` before any work. ``context_management`` and the ``anthropic-beta``
headers are accepted and ignored (nothing here clears tool results: the prefix would break).
``thinking`` (``enabled`` / ``disabled``) is given to the chat template as
``enable_thinking`` where the template honours it, else ignored; ``budget_tokens`` caps
the reasoning (`reasoning_budget`: after that many tokens the end of thinking is forced;
any positive number, not only Anthropic's 1,024 or more).
Whatever model name the client sends, the served model answers and the name is echoed.

Answers: ``content`` blocks in the order the model produced them (``thinking`` with a
``signature``: `sign_thinking`; ``text``; ``tool_use`` from mlx-lm's tool-call parser),
``stop_reason`` ``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``, and
``usage`` that adds up (`call.Usage`): ``cache_read_input_tokens`` restored +
``cache_creation_input_tokens`` computed up to the last ``cache_control`` breakpoint +
``input_tokens`` computed after it = the prompt = ``count_tokens``, in ``message_start``
and at the end alike; ``output_tokens`` — the numbers of the log line and
``GET /v1/cache``. Streamed: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta`` and
a closing ``signature_delta``, ``input_json_delta``) / ``content_block_stop``,
``message_delta`` (stop reason, usage), ``message_stop``; a failure after the answer
started is an ``error`` event. A stream is never silent for longer than
`wire.keepalive_interval`: ``ping`` events while the request waits, its prompt is
processed or it decodes. Errors are ``{"type": "error", "error": {"type", "message"}}``
with the fitting status.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from .call import (AgentRequestError, ChatCall, SkippedTools, Usage, keep_reasoning_of,
                   one_shot, prompt_lookup_of, restrict_tools)
from .generation import Accounting, count_tokens, served_name
from .messages_answer import MessageBuilder, error_body, sign_thinking, signed_here
from .wire import Route, read_body, send_json, serve

__all__ = ["parse_request", "MessageBuilder", "serve_messages", "serve_count_tokens",
           "error_body", "refusal", "ROUTE", "sign_thinking", "signed_here"]

log = logging.getLogger("mlx_kvcache")

#: Server tool types skipped (each logged once, bounded).
SKIPPED = SkippedTools("/v1/messages")
#: What a silent stream writes every `wire.keepalive_interval` (Anthropic's own keep-alive).
PING = b'event: ping\ndata: {"type": "ping"}\n\n'

#: Blocks (and tools) a request may mark with ``cache_control``: Anthropic's limit. Each is
#: a checkpoint the prompt cache stores, and finding where a marked tool or tool call ends
#: costs two renders of the prompt: the limit bounds both.
MAX_BREAKPOINTS = 4

_ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


def _bad(message: str) -> AgentRequestError:
    return AgentRequestError(message, 400, "invalid_request_error")


# -- the request -----------------------------------------------------------------------------
def _is_text(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON, breaks every tokenizer
        return False
    return True


def _number(body: Dict[str, Any], key: str, lo: float, hi: Optional[float], integer=False):
    v = body.get(key)
    if v is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds) or v < lo or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise _bad(f"{key} must be {'an integer' if integer else 'a number'} {span}")
    return v


def _image_part(block: Dict[str, Any], where: str) -> Dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source must be an object")
    if src.get("type") == "base64" and _is_text(src.get("data")) and _is_text(src.get("media_type")):
        url = f"data:{src['media_type']};base64,{src['data']}"
    elif src.get("type") == "url" and _is_text(src.get("url")):
        url = src["url"]
    else:
        raise _bad(f"{where}.source must be a base64 (media_type, data) or url image source")
    return {"type": "image_url", "image_url": {"url": url}}


def _result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if _is_text(content):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text blocks")
    out = []
    for k, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not _is_text(b.get("text")):
            raise _bad(f"{where}.content[{k}] must be a text block (tool results carry text here)")
        out.append(b["text"])
    return "\n".join(out)


class _Builder:
    """OpenAI messages, their names and the breakpoints, as a request is read."""

    def __init__(self) -> None:
        self.messages: List[Dict[str, Any]] = []
        self.labels: List[str] = []
        self.part_labels: List[Optional[List[str]]] = []
        self.breakpoints: List[Tuple[int, int]] = []
        self.call_breakpoints: List[Tuple[int, int]] = []

    def add(self, msg: Dict[str, Any], label: str, parts: Optional[List[str]] = None,
            marked: Tuple[int, ...] = (), marked_calls: Tuple[int, ...] = ()) -> None:
        i = len(self.messages)
        self.messages.append(msg)
        self.labels.append(label)
        self.part_labels.append(parts)
        self.breakpoints.extend((i, j) for j in marked)
        self.call_breakpoints.extend((i, j) for j in marked_calls)


def _blocks(content: Any, where: str) -> List[Dict[str, Any]]:
    if _is_text(content):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    for k, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad(f"{where}.content[{k}] must be a content block (an object with a type)")
    return content


def _text_parts(blocks, where: str, out: _Builder, role: str, images: bool) -> Tuple[list, list, tuple]:
    """Text (and image) blocks as OpenAI parts, their names and the marked ones."""
    parts, names, marked = [], [], []
    for k, b in blocks:
        name = f"{where}.content[{k}]"
        if b["type"] == "text":
            if not _is_text(b.get("text")):
                raise _bad(f"{name}.text must be a string")
            parts.append({"type": "text", "text": b["text"]})
        elif b["type"] == "image" and images:
            parts.append(_image_part(b, name))
        else:
            raise _bad(f"{name}: a {b['type']!r} block is not allowed in a {role} message")
        if b.get("cache_control") is not None:
            marked.append(len(parts) - 1)
        names.append(name)
    return parts, names, tuple(marked)


def _user(m: Dict[str, Any], i: int, out: _Builder) -> None:
    where = f"messages[{i}]"
    blocks = list(enumerate(_blocks(m.get("content"), where)))
    rest = []
    for k, b in blocks:
        if b["type"] != "tool_result":
            rest.append((k, b))
            continue
        name = f"{where}.content[{k}]"
        if not _is_text(b.get("tool_use_id")):
            raise _bad(f"{name}.tool_use_id must be a string")
        text = _result_text(b.get("content"), name)
        if b.get("is_error") is True:
            text = "Error: " + text
        out.add({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}, name,
                [name], (0,) if b.get("cache_control") is not None else ())
    if rest or not blocks:
        parts, names, marked = _text_parts(rest, where, out, "user", images=True)
        out.add({"role": "user", "content": parts}, where, names, marked)


def _assistant(m: Dict[str, Any], i: int, out: _Builder) -> None:
    where = f"messages[{i}]"
    text, names, marked, calls, thinking, marked_calls = [], [], [], [], [], []
    for k, b in enumerate(_blocks(m.get("content"), where)):
        name = f"{where}.content[{k}]"
        t = b["type"]
        if t == "text":
            if not _is_text(b.get("text")):
                raise _bad(f"{name}.text must be a string")
            text.append({"type": "text", "text": b["text"]})
            names.append(name)
            if b.get("cache_control") is not None:
                marked.append(len(text) - 1)
        elif t == "tool_use":
            if not _is_text(b.get("id")) or not _is_text(b.get("name")):
                raise _bad(f"{name} needs an id and a name (strings)")
            inp = b.get("input", {})
            if not isinstance(inp, dict):
                raise _bad(f"{name}.input must be an object")
            # The same input always serialises the same (key order as sent): the turn
            # renders identically when re-sent.
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"],
                                       "arguments": json.dumps(inp, ensure_ascii=False)}})
            if b.get("cache_control") is not None:
                marked_calls.append(len(calls) - 1)
        elif t == "thinking":
            if not _is_text(b.get("thinking")):
                raise _bad(f"{name}.thinking must be a string")
            if not signed_here(b["thinking"], b.get("signature")):
                log.debug("mlx_kvcache: %s is a thinking block this server did not sign "
                          "(another server's, or edited): rendered all the same", name)
            thinking.append(b["thinking"])
        elif t == "redacted_thinking":
            continue  # encrypted for Anthropic's models: nothing a local model can read
        else:
            raise _bad(f"{name}: a {t!r} block is not allowed in an assistant message")
    msg: Dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning"] = "\n".join(thinking)
    out.add(msg, where, names, tuple(marked), tuple(marked_calls))


def _system_message(content: Any, where: str, out: _Builder) -> None:
    blocks = list(enumerate(_blocks(content, where)))
    if isinstance(content, str):
        out.add({"role": "system", "content": [{"type": "text", "text": content}]}, where, [where])
        return
    parts, names, marked = _text_parts(blocks, where, out, "system", images=False)
    out.add({"role": "system", "content": parts}, where,
            [n.replace(".content", "") if where == "system" else n for n in names], marked)


def _tools(tools: Any) -> Tuple[Optional[List[Dict[str, Any]]], List[int]]:
    """The client tools in chat form, and the indices (among them) of those marked with
    ``cache_control``."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise _bad("tools must be a list")
    out, marked, skipped = [], [], []
    for k, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools[{k}] must be an object")
        kind = t.get("type")
        if kind not in (None, "custom"):  # Anthropic's server tools (web_search_…, bash_…)
            skipped.append(kind if isinstance(kind, str) else json.dumps(kind)[:64])
            continue
        if not _is_text(t.get("name")) or not t["name"]:
            raise _bad(f"tools[{k}].name must be a non-empty string")
        schema = t.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise _bad(f"tools[{k}].input_schema must be an object")
        fn = {"name": t["name"], "parameters": schema}
        if t.get("description") is not None:
            if not _is_text(t["description"]):
                raise _bad(f"tools[{k}].description must be a string")
            fn["description"] = t["description"]
        if t.get("cache_control") is not None:
            marked.append(len(out))
        out.append({"type": "function", "function": fn})
    SKIPPED.note(skipped)
    return out or None, marked


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}')
    if choice["type"] == "tool" and not (_is_text(choice.get("name")) and choice["name"]):
        raise _bad('tool_choice {"type": "tool"} needs the tool\'s name (a string)')
    return choice


def _thinking(value: Any) -> Tuple[Optional[bool], Optional[int]]:
    """``thinking`` as on / off (None: not sent) and its ``budget_tokens`` (None: none)."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled",
                                                                "adaptive"):
        raise _bad('thinking must be {"type": "enabled", "budget_tokens": N} or '
                   '{"type": "disabled"}')
    budget = value.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise _bad("thinking.budget_tokens must be a positive integer")
    on = value["type"] != "disabled"
    return on, budget if on else None


def parse_request(body: Any, count_only: bool = False) -> ChatCall:
    """A Messages request body as a `ChatCall`; `AgentRequestError` (400) names the first
    problem."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if body.get("model") is not None and not _is_text(body["model"]):
        raise _bad("model must be a string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    out = _Builder()
    if body.get("system") is not None:
        _system_message(body["system"], "system", out)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "user":
            _user(m, i, out)
        elif role == "assistant":
            _assistant(m, i, out)
        elif role == "system":
            _system_message(m.get("content"), f"messages[{i}]", out)
        else:
            raise _bad(f"messages[{i}].role must be user, assistant or system, not {role!r}")
    tools, marked_tools = _tools(body.get("tools"))
    marks = len(out.breakpoints) + len(out.call_breakpoints) + sum(
        1 for t in body.get("tools") or () if t.get("cache_control") is not None)
    if marks > MAX_BREAKPOINTS:  # the API's limit, and a bound on the checkpoints stored
        raise _bad(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                   f"provided. Found {marks}.")
    choice = _tool_choice(body.get("tool_choice"))
    call = ChatCall(messages=out.messages, labels=out.labels, tools=tools, tool_choice=choice,
                    breakpoints=out.breakpoints, part_labels=out.part_labels,
                    tool_breakpoints=marked_tools, call_breakpoints=out.call_breakpoints)
    if choice is not None:
        restrict_tools(call, none=choice["type"] == "none",
                       name=choice.get("name") if choice["type"] == "tool" else None)
    call.thinking, call.reasoning_budget = _thinking(body.get("thinking"))
    call.keep_reasoning = keep_reasoning_of(body)
    call.prompt_lookup = prompt_lookup_of(body)
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise _bad("metadata must be an object")
        if meta.get("user_id") is not None:
            if not _is_text(meta["user_id"]):
                raise _bad("metadata.user_id must be a string")
            call.session = session_of(meta["user_id"])
    if count_only:
        return call
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _bad("stream must be true or false")
    call.max_tokens = _number(body, "max_tokens", 1, None, integer=True)
    for key, lo, hi, integer in (("temperature", 0, 2, False), ("top_p", 0, 1, False),
                                 ("top_k", 0, None, True)):
        v = _number(body, key, lo, hi, integer)
        if v is not None:
            call.sampling[key] = v
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(_is_text(s) and s for s in stops):
            raise _bad("stop_sequences must be a list of non-empty strings")
        call.stop = list(stops)
    # Claude Code's session title: no tools, a JSON schema (output_config), 256 tokens
    call.one_shot = one_shot(bool(body.get("tools")), isinstance(body.get("output_config"), dict)
                             or isinstance(body.get("output_format"), dict), call.max_tokens)
    return call


_LEGACY_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


def session_of(user_id: str) -> str:
    """The session a ``metadata.user_id`` names: Claude Code's is a JSON object as a
    string (``device_id``, ``account_uuid``, ``session_id``), earlier ones
    ``user_<hash>_account_<uuid>_session_<uuid>``; its ``session_id`` tells one session
    from another (the device is the same for all). Any other value names itself."""
    try:
        v = json.loads(user_id)
    except ValueError:
        v = None
    if isinstance(v, dict) and isinstance(v.get("session_id"), str) and v["session_id"]:
        return v["session_id"]
    m = _LEGACY_SESSION.search(user_id)
    return m.group(1) if m else user_id


# -- HTTP ------------------------------------------------------------------------------------
def _error(e: AgentRequestError) -> Dict[str, Any]:
    kind = e.kind if e.kind in _ERROR_KINDS.values() else _ERROR_KINDS.get(e.status, "api_error")
    return error_body(e.message, kind)


def refusal(message: str) -> Dict[str, Any]:
    """The body of a request the server refuses while it stops."""
    return _error(AgentRequestError(message, 503, "overloaded_error"))


def _request_id() -> Dict[str, str]:
    return {"request-id": f"req_{uuid.uuid4().hex[:24]}"}


def _answer(handler, body: Dict[str, Any], start_usage: Callable[[], Usage],
            accounting: Accounting) -> MessageBuilder:
    return MessageBuilder(body.get("model") or served_name(handler.response_generator),
                          start_usage, accounting)


def follow_up(body: Dict[str, Any], message: Dict[str, Any],
              text: str) -> Optional[Dict[str, Any]]:
    """The request a client sends after ``message`` (the answer to ``body``), as Claude
    Code builds it: the answer's content blocks appended as they came (thinking blocks
    included) but for whitespace-only text blocks (Anthropic's API refuses those, so
    clients drop them), then a ``tool_result`` of ``text`` for each ``tool_use``, or a user
    message of ``text`` after a text answer (`foresight`)."""
    content = [b for b in message.get("content") or []
               if b.get("type") != "text" or b.get("text", "").strip()]
    if not isinstance(body.get("messages"), list) or not content:
        return None
    calls = [b for b in content if b.get("type") == "tool_use"]
    nxt = ([{"type": "tool_result", "tool_use_id": b["id"], "content": text} for b in calls]
           if calls else text)
    return dict(body, messages=[*body["messages"], {"role": "assistant", "content": content},
                                {"role": "user", "content": nxt}])


def _stream_error(e: AgentRequestError) -> List[Tuple[str, Dict[str, Any]]]:
    return [("error", _error(e))]


ROUTE = Route(parse=parse_request, answer=_answer, error=_error, headers=_request_id,
              follow=follow_up, keepalive=PING, stream_error=_stream_error)


def serve_count_tokens(handler) -> None:
    """Answer ``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the tokens of
    the prompt `serve_messages` would give the model."""
    try:
        call = parse_request(read_body(handler), count_only=True)
        n = count_tokens(handler.response_generator, call)
    except AgentRequestError as e:
        return send_json(handler, e.status, _error(e), _request_id())
    send_json(handler, 200, {"input_tokens": n}, _request_id())


def serve_messages(handler) -> None:
    """Answer one ``POST /v1/messages`` on ``handler`` (see the module doc)."""
    serve(handler, ROUTE)
