"""The OpenAI Responses API — ``POST /v1/responses`` — as an adapter onto the front door.

Entry point for the route table: ``serve_responses(handler) -> None``. ``handler`` is the
live `CacheAPIHandler`, already admitted, its body not yet read. It reads the JSON body,
answers one JSON response (``stream`` false) or a stream of server-sent events, and never
raises for bad input: a 400 in OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``) names the problem; nothing reaches the generation thread.

Stateless: every request carries the whole conversation (as Codex sends it).
``previous_response_id`` and ``conversation`` are refused with a 400 that says so — this
server keeps no responses. ``store``, ``metadata``, ``parallel_tool_calls`` are accepted
and echoed; ``prompt_cache_key`` becomes `ChatCall.session`; OpenAI-side options with no
local meaning (``include``, ``text``, ``truncation``, ``user``,
``service_tier``, …) are accepted and ignored — except values that ask for behaviour this
server lacks (`_unserved_options`: structured outputs, ``background``, ``store: true``,
stored prompts, logprobs), a 400 naming them. ``reasoning.effort`` turns the model's
reasoning off (``none``, ``minimal``) or on (``low`` … ``xhigh``), given to the chat template
as ``enable_thinking`` where the template honours it (as Anthropic's ``thinking``); its
``summary`` is ignored. A user message's ``input_image`` parts are served as the chat
route serves images (where the model has an image processor, else a 400 that says so).
Without ``max_output_tokens`` (Codex sends none) the answer may run to what the model's
context leaves, or the user's ``--max-tokens`` (`context.answer_tokens`); a prompt over
the context is a 400 with ``code: "context_length_exceeded"`` before any work.

The translation is two pure steps, tested without a server:
  * `parse_request`: a request body -> a `ChatCall` (OpenAI chat-format messages in the
    client's order: ``instructions`` first, then every input item where it stands);
  * `ResponseBuilder`: the engine's events -> the stream's events (each with ``sequence_number``) and
    the final ``response`` object; the non-streamed answer is the streamed one's last
    snapshot, so the two cannot disagree.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from .call import (AgentRequestError, ChatCall, SkippedTools, keep_reasoning_of, one_shot,
                   prompt_lookup_of, restrict_tools)
from .generation import Accounting, served_name
from .responses_answer import ResponseBuilder, custom_tools, error_body, render
from .wire import Route, serve

__all__ = ["serve_responses", "parse_request", "ResponseBuilder", "error_body", "refusal", "ROUTE",
           "custom_tools", "render"]

log = logging.getLogger("mlx_kvcache")

#: Tool types other than ``function`` that were skipped (each logged once, bounded).
SKIPPED = SkippedTools("/v1/responses")


def _bad(message: str, param: Optional[str] = None) -> AgentRequestError:
    return AgentRequestError(message, 400, "invalid_request_error", param=param)


# -- request -> ChatCall -----------------------------------------------------------------------
def _text_of(content: Any, where: str, allowed: Tuple[str, ...]) -> str:
    """The text of a message's content: a string, or parts of the ``allowed`` types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", where)
    return "".join(_part_text(part, f"{where}.content[{j}]", allowed)
                   for j, part in enumerate(content))


def _part_text(part: Any, at: str, allowed: Tuple[str, ...]) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise _bad(f"{at} must be an object", at)
    kind = part.get("type")
    if kind == "input_image":
        raise _bad(f"{at}: input_image parts are served in user messages only", at)
    if kind in ("input_file", "input_audio"):
        raise _bad(f"{at}: {kind} parts are not served by this server", at)
    if kind not in allowed:
        raise _bad(f"{at}: content part type {kind!r} is not one of {', '.join(allowed)}", at)
    text = part.get("refusal") if kind == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise _bad(f"{at}.text must be a string", at)
    return text


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _user_content(content: Any, where: str) -> Any:
    """A user message's content: its text (`_text_of`), or — where it has ``input_image``
    parts — chat parts, text and ``image_url`` in order (the model's image processor
    serves them; a model without one answers a 400 that says so)."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text_of(content, where, _TEXT_PARTS)
    parts: List[Dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not (isinstance(part, dict) and part.get("type") == "input_image"):
            parts.append({"type": "text", "text": _part_text(part, at, _TEXT_PARTS)})
            continue
        url = part.get("image_url")
        if part.get("file_id") is not None and url is None:
            raise _bad(f"{at}: file_id needs stored files; this server is stateless — send "
                       "the image as image_url (a data: URL)", at)
        if not isinstance(url, str) or not url:
            raise _bad(f"{at}.image_url must be a data: URL", at)
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _custom_function(tool: Dict[str, Any], i: int) -> Dict[str, Any]:
    """A ``custom`` tool (free text in, as Codex's ``apply_patch``) offered to the chat
    template as a function of one string parameter, ``input``; its ``format`` (a grammar
    or plain text) is told in the description, where a local model can read it."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
    about = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and \
            isinstance(fmt.get("definition"), str):
        about += (f"\n\nThe input is free text following this {fmt.get('syntax', '')} "
                  f"grammar:\n{fmt['definition']}")
    fn: Dict[str, Any] = {"name": name, "parameters": {
        "type": "object", "properties": {"input": {
            "type": "string", "description": "The tool's input: free text, sent as is."}},
        "required": ["input"]}}
    if about:
        fn["description"] = about.strip()
    return {"type": "function", "function": fn}


def _tools(tools: Any) -> Optional[List[Dict[str, Any]]]:
    """Function and custom tools in chat form (`_custom_function`); other types
    (web_search, local_shell, …) are skipped, not refused — Codex sends them whatever the
    model — and logged once."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out, skipped = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}] must be an object", f"tools[{i}]")
        kind = tool.get("type", "function")
        if kind == "custom":
            out.append(_custom_function(tool, i))
            continue
        if kind != "function":
            skipped.append(kind if isinstance(kind, str) else json.dumps(kind)[:64])
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].parameters must be a JSON schema object",
                       f"tools[{i}].parameters")
        fn: Dict[str, Any] = {"name": name,
                              "parameters": params or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            fn["description"] = str(tool["description"])
        out.append({"type": "function", "function": fn})
    SKIPPED.note(skipped)
    return out or None


def _tool_choice(choice: Any) -> Tuple[Any, Optional[List[str]]]:
    """``(mlx-lm's tool_choice, the function names an allowed_tools choice lets the model
    see — None for every other choice)``; the other kinds an ``allowed_tools`` lists are
    tools this server skips anyway."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, None
        if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and \
                isinstance(choice.get("tools"), list):
            allowed = []
            for i, t in enumerate(choice["tools"]):
                if not isinstance(t, dict):
                    raise _bad(f"tool_choice.tools[{i}] must be an object", "tool_choice")
                if t.get("type") == "function":
                    if not isinstance(t.get("name"), str):
                        raise _bad(f"tool_choice.tools[{i}] is a function without a name",
                                   "tool_choice")
                    allowed.append(t["name"])
            return choice["mode"], allowed
    raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
               f"'name': …}}, not {json.dumps(choice)[:200]}", "tool_choice")


def _number(body: Dict[str, Any], key: str, lo: float, hi: float) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"{key} must be a number from {lo} to {hi}, not {json.dumps(v)}", key)
    return float(v)


class _Messages:
    """Chat messages built item by item, each with its label (``input[i]``)."""

    def __init__(self) -> None:
        self.messages: List[Dict[str, Any]] = []
        self.labels: List[str] = []
        self._reasoning: List[str] = []  # reasoning items waiting for their assistant turn
        self._open_assistant: Optional[int] = None  # may take the function calls that follow

    def add(self, message: Dict[str, Any], label: str) -> None:
        self.messages.append(message)
        self.labels.append(label)
        self._open_assistant = None
        self._reasoning = []  # reasoning belongs to the assistant turn right after it

    def assistant(self, i: int) -> Dict[str, Any]:
        """The assistant turn input item ``i`` belongs to: the one just added (text then
        calls is one turn, as the model produced it), else a new one."""
        if self._open_assistant is not None:
            m = self._open_assistant
            self.labels[m] = f"{self.labels[m].split('..')[0].rstrip(']')}..{i}]"
            return self.messages[m]
        msg: Dict[str, Any] = {"role": "assistant", "content": ""}
        if self._reasoning:
            msg["reasoning"] = "".join(self._reasoning)
            self._reasoning = []
        self.add(msg, f"input[{i}]")
        self._open_assistant = len(self.messages) - 1
        return msg

    def reasoning(self, text: str) -> None:
        if text:  # (an item with only encrypted_content has none)
            self._reasoning.append(text)
        self._open_assistant = None


def _item(msgs: _Messages, item: Any, i: int) -> None:
    at = f"input[{i}]"
    if not isinstance(item, dict):
        raise _bad(f"{at} must be an object", at)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"{at}.role must be user, assistant, system or developer, not "
                       f"{json.dumps(role)}", f"{at}.role")
        if role == "user":
            msgs.add({"role": "user", "content": _user_content(item.get("content"), at)}, at)
            return
        text = _text_of(item.get("content"), at, _TEXT_PARTS)
        if role == "assistant":
            msg = msgs.assistant(i)
            msg["content"] = (msg["content"] or "") + text
            return
        # developer is OpenAI's newer name for system; chat templates know "system".
        msgs.add({"role": "system" if role == "developer" else role, "content": text}, at)
    elif kind in ("function_call", "custom_tool_call"):
        call_id, name = item.get("call_id"), item.get("name")
        args = item.get("arguments") if kind == "function_call" else item.get("input")
        if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
            raise _bad(f"{at}: a {kind} needs string call_id, name and "
                       f"{'arguments' if kind == 'function_call' else 'input'}", at)
        if kind == "custom_tool_call":  # as the model was offered it (`_custom_function`)
            args = json.dumps({"input": args}, ensure_ascii=False)
        msg = msgs.assistant(i)
        msg.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{at}.call_id must be a string", f"{at}.call_id")
        out = item.get("output")
        text = out if isinstance(out, str) else _text_of(out, at, _TEXT_PARTS)
        msgs.add({"role": "tool", "tool_call_id": call_id, "content": text}, at)
    elif kind == "reasoning":
        # Tolerated: its readable text (never encrypted_content) goes with the next
        # assistant turn, where the template renders reasoning (most drop it from past turns).
        parts = item.get("content") or item.get("summary") or []
        msgs.reasoning(_text_of(parts, at, _TEXT_PARTS) if isinstance(parts, list) else "")
    elif kind == "item_reference":
        raise _bad(f"{at}: item_reference needs stored items; this server is stateless — "
                   "send the items themselves", at)
    else:
        raise _bad(f"{at}: input item type {json.dumps(kind)} is not served (message, "
                   "function_call, function_call_output, reasoning)", at)


#: ``reasoning.effort`` values: whether the model reasons first (a local template knows
#: on and off only).
_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
           "xhigh": True}


def _reasoning(value: Any) -> Optional[bool]:
    """``reasoning`` as on / off (None: not sent, or no effort named)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad('reasoning must be an object such as {"effort": "medium"}', "reasoning")
    effort = value.get("effort")
    if effort is None:
        return None
    if effort not in _EFFORT:
        raise _bad(f"reasoning.effort must be one of {', '.join(_EFFORT)}, not "
                   f"{json.dumps(effort)}", "reasoning.effort")
    return _EFFORT[effort]


def _unserved_options(body: Dict[str, Any]) -> None:
    """A 400 for options that ask for behaviour this server does not have, rather than
    an answer that silently lacks it. Values that ask for nothing (``store: false``, the
    SDK's omitted fields, ``text.format`` of type ``text``, ``include`` of outputs of
    tools that never run here) pass."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise _bad(f"text.format {json.dumps(fmt.get('type'))[:64]} is not supported: this "
                   "server has no constrained decoding (structured outputs); ask for JSON in "
                   "the instructions and parse the text", "text.format")
    if body.get("background") is True:
        raise _bad("background is not supported: this server answers in the request (use "
                   "stream for long answers)", "background")
    if body.get("store") is True:
        raise _bad("store: true is not supported: this server is stateless and keeps no "
                   "responses; send store: false or leave it out", "store")
    if body.get("prompt") is not None:
        raise _bad("prompt (a stored prompt template) is not supported: this server keeps no "
                   "prompts; send instructions and input", "prompt")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise _bad("include must be a list", "include")
    if "message.output_text.logprobs" in (include or ()) or body.get("top_logprobs"):
        field = ("top_logprobs" if body.get("top_logprobs")
                 else 'include "message.output_text.logprobs"')
        raise _bad(f"{field}: logprobs are not returned by this server's /v1/responses (the "
                   "chat route, /v1/chat/completions, returns them)", field.split()[0])


def parse_request(body: Any) -> ChatCall:
    """A Responses request body as a `ChatCall`, or `AgentRequestError` (400) naming the
    field at fault."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise _bad(f"{key} is not supported: this server is stateless and keeps no "
                       "responses; send the whole conversation in input (as Codex does)", key)
    _unserved_options(body)
    msgs = _Messages()
    instructions = body.get("instructions")
    if instructions is not None:
        if isinstance(instructions, list):
            instructions = _text_of(instructions, "instructions", _TEXT_PARTS)
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        msgs.add({"role": "system", "content": instructions}, "instructions")
    items = body.get("input")
    if isinstance(items, str):
        msgs.add({"role": "user", "content": items}, "input")
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _item(msgs, item, i)
    elif items is not None:
        raise _bad("input must be a string or a list of items", "input")
    if not msgs.messages:
        raise _bad("input is empty: nothing to answer", "input")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise _bad(f"max_output_tokens must be a positive integer, not {json.dumps(max_tokens)}",
                   "max_output_tokens")
    sampling = {}
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            sampling[key] = v
    thinking = _reasoning(body.get("reasoning"))
    session = body.get("prompt_cache_key")
    if session is not None and not isinstance(session, str):
        raise _bad("prompt_cache_key must be a string", "prompt_cache_key")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise _bad("stream must be true or false", "stream")
    n = len(msgs.messages)
    last = msgs.messages[-1]
    # The client comes back with this prompt extended: mark the end of the instructions
    # (shared by every session) and of the input so far, as Claude Code's cache_control
    # does (`generation.prepare` drops the latter where the next request goes on past the
    # answer).
    marks = [(0, 0)] if instructions is not None else []
    end_mark = None if last["role"] == "assistant" or (0, 0) in marks and n == 1 else (n - 1, 0)
    choice, allowed = _tool_choice(body.get("tool_choice"))
    call = ChatCall(messages=msgs.messages, labels=msgs.labels, tools=_tools(body.get("tools")),
                    tool_choice=choice, max_tokens=max_tokens,
                    sampling=sampling, stop=[], breakpoints=marks, session=session)
    call.thinking, call.end_mark = thinking, end_mark
    call.keep_reasoning = keep_reasoning_of(body)
    call.prompt_lookup = prompt_lookup_of(body)
    call.one_shot = one_shot(bool(body.get("tools")), False, max_tokens)
    restrict_tools(call, none=choice == "none",
                   name=choice["function"]["name"] if isinstance(choice, dict) else None,
                   allowed=allowed)
    return call


# -- HTTP --------------------------------------------------------------------------------------
def _error(e: AgentRequestError) -> Dict[str, Any]:
    return error_body(e.message, e.kind, e.param, e.code)


def refusal(message: str) -> Dict[str, Any]:
    """The body of a request the server refuses while it stops."""
    return _error(AgentRequestError(message, 503, "server_error", code="server_stopping"))


def _answer(handler, body: Dict[str, Any], start_usage: Callable[[], Any],
            accounting: Accounting) -> "ResponseBuilder":
    # The served model answers whatever name the client sent; the name is echoed back.
    name = body.get("model")
    return ResponseBuilder(body, name if isinstance(name, str) and name
                           else served_name(handler.response_generator), accounting)


def follow_up(body: Dict[str, Any], response: Dict[str, Any],
              text: str) -> Optional[Dict[str, Any]]:
    """The request a client sends after ``response`` (the answer to ``body``), as Codex and
    the SDK build it with ``store: false``: the input, the output items as they came
    (reasoning items included), then a ``function_call_output`` of ``text`` for each call,
    or a user message of ``text`` after a text answer (`foresight`)."""
    items = body.get("input")
    output = response.get("output") or []
    if not output or not isinstance(items, (str, list)):
        return None
    items = ([{"type": "message", "role": "user", "content": items}] if isinstance(items, str)
             else list(items))
    outputs = {"function_call": "function_call_output",
               "custom_tool_call": "custom_tool_call_output"}
    calls = [o for o in output if o.get("type") in outputs]
    nxt = ([{"type": outputs[c["type"]], "call_id": c["call_id"], "output": text} for c in calls]
           if calls else [{"type": "message", "role": "user", "content": text}])
    return dict(body, input=[*items, *output, *nxt])


def _stream_error(e: AgentRequestError) -> List[Tuple[str, Dict[str, Any]]]:
    """A refusal that came after the stream's keep-alives started: OpenAI's ``error``
    stream event."""
    return [("error", {"type": "error", "code": e.code or e.kind, "message": e.message,
                       "param": e.param, "sequence_number": 0})]


#: Responses streams have no ping event: an SSE comment line, which every parser ignores.
ROUTE = Route(parse=parse_request, answer=_answer, error=_error, follow=follow_up,
              keepalive=b": keep-alive\n\n", stream_error=_stream_error)


def serve_responses(handler) -> None:
    """Answer one ``POST /v1/responses`` on ``handler`` (see the module's docstring)."""
    serve(handler, ROUTE)
