"""OpenAI chat completions — ``POST /v1/chat/completions`` — through the front door, for the
models whose tool calls only our parsers read (gpt-oss's harmony, Llama 3.x, DeepSeek:
`parsers.registry`). mlx-lm's own chat route serves every other model and every request
asking for what only it does (`served_here`): it returns those families' calls as text.

The request is the chat format mlx-lm's route takes (``messages`` with ``tool_calls``,
``tool_call_id``, ``reasoning_content`` / ``reasoning``; ``tools``; ``tool_choice``;
``max_tokens`` / ``max_completion_tokens``; ``temperature`` / ``top_p`` / ``top_k`` /
``min_p`` / ``seed``; ``stop``; ``chat_template_kwargs.enable_thinking``; ``stream`` and
``stream_options.include_usage``), rendered as the agent routes render a conversation
(`generation.prepare`: system messages in place, answers given back as the template wants
them).

Foresight on the chat route, for every model: when an answer ends — through the front door
here, or through mlx-lm's route, whose answer the model's output parser reads as it streams
out (`follow_answer`) — the request the chat client sends next (the answer as it gives it
back, the reasoning in the field its earlier answers carried it; then tool results or a new
user message) is rendered as the route that will serve it renders it, and computed ahead. The answer is OpenAI's: ``message`` (``content``, ``reasoning``, ``tool_calls`` with
their arguments streamed as they are generated), ``finish_reason`` (``stop``, ``length``,
``tool_calls``) and ``usage`` with ``prompt_tokens_details.cached_tokens``; streamed, the
chunks mlx-lm's route sends, ``: keepalive`` comments while nothing else is written, an
``error`` object in the stream for a failure after it opened, then ``data: [DONE]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...engine.answer import Failed, Finished
from ...parsers.base import Call, CallArguments, CallBegin, CallCut, Reasoning, Text, UnreadCall
from .call import (AgentRequestError, ChatCall, keep_reasoning_of, one_shot, prompt_lookup_of,
                   restrict_tools)
from . import foresight
from .generation import Accounting, served_name
from ..sessions import agent_of, session_header
from .wire import DONE, Route, serve

__all__ = ["parse_request", "ChatBuilder", "served_here", "follow_up", "serve_chat", "ROUTE",
           "MLX_ONLY", "Heard", "follow_answer"]

log = logging.getLogger("mlx_kvcache")

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}

#: Request fields only mlx-lm's chat route serves (log-probabilities, penalties, role maps,
#: adapters, a per-request draft model): a request with one goes there.
MLX_ONLY = ("logprobs", "top_logprobs", "role_mapping", "adapters", "draft_model",
            "num_draft_tokens", "logit_bias", "repetition_penalty", "repetition_context_size",
            "presence_penalty", "presence_context_size", "frequency_penalty",
            "frequency_context_size", "xtc_probability", "xtc_threshold")


def served_here(body: Any) -> bool:
    """Whether the front door serves this chat request (else mlx-lm's route does)."""
    return isinstance(body, dict) and not any(body.get(k) not in (None, False, -1)
                                              for k in MLX_ONLY)


def _bad(message: str, param: Optional[str] = None) -> AgentRequestError:
    return AgentRequestError(message, 400, "invalid_request_error", param=param)


def error_body(message: str, kind: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- request -> ChatCall -----------------------------------------------------------------------
def _content(content: Any, where: str, images: bool) -> Any:
    """A message's content as the conversation takes it: a string, or text and (``images``)
    image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", where)
    parts: List[Dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images:
            parts.append(part)
        else:
            raise _bad(f"{at} must be a text part" + (" or an image_url part" if images else ""),
                       at)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _calls(calls: Any, where: str) -> List[Dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{at}.function must name the function called", at)
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {}, ensure_ascii=False)
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(body: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out, labels = [], []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where} must be an object whose role is one of "
                       f"{', '.join(ROLES)}", where)
        role = ROLES[m["role"]]
        msg: Dict[str, Any] = {"role": role,
                               "content": _content(m.get("content"), where, role == "user")}
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _calls(m["tool_calls"], where)
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning"] = reasoning
        elif role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
        labels.append(where)
    return out, labels


def _tools(tools: Any) -> Optional[List[Dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be a function tool with a name", f"tools[{i}]")
        out.append({"type": "function", "function": fn})
    return out or None


def _number(body: Dict[str, Any], key: str, lo: float, hi: Optional[float],
            integer: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or v < lo or (hi is not None and v > hi):
        span = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise _bad(f"{key} must be {'an integer' if integer else 'a number'} {span}, not "
                   f"{json.dumps(v)}", key)
    return v


def parse_request(body: Any) -> ChatCall:
    """A chat completions body -> a `ChatCall`; `AgentRequestError` naming the first
    problem."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    messages, labels = _messages(body)
    call = ChatCall(messages=messages, labels=labels, tools=_tools(body.get("tools")))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        call.max_tokens = int(_number({"max_tokens": limit}, "max_tokens", 1, None, True))
    for key, lo, hi, integer in (("temperature", 0, 2, False), ("top_p", 0, 1, False),
                                 ("top_k", 0, None, True), ("min_p", 0, 1, False),
                                 ("seed", 0, (1 << 64) - 1, True)):
        v = _number(body, key, lo, hi, integer)
        if v is not None:
            call.sampling[key] = v
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop must be a string or a list of non-empty strings", "stop")
        call.stop = list(stops)
    for key in ("stream",):
        if key in body and not isinstance(body[key], bool):
            raise _bad(f"{key} must be true or false", key)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options must be an object", "stream_options")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    if isinstance((kwargs or {}).get("enable_thinking"), bool):
        call.thinking = kwargs["enable_thinking"]
    session = body.get("prompt_cache_key", body.get("user"))
    call.session = session if isinstance(session, str) and session else None
    call.keep_reasoning = keep_reasoning_of(body)
    call.prompt_lookup = prompt_lookup_of(body)
    choice = body.get("tool_choice")
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice must be 'auto', 'none', 'required' or "
                       "{'type': 'function', 'function': {'name': …}}", "tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise _bad("tool_choice must be 'auto', 'none', 'required' or "
                   "{'type': 'function', 'function': {'name': …}}", "tool_choice")
    call.tool_choice = choice
    fmt = body.get("response_format")
    call.one_shot = one_shot(bool(body.get("tools")), isinstance(fmt, dict) and fmt.get("type")
                             in ("json_schema", "json_object"), call.max_tokens)
    restrict_tools(call, none=choice == "none", name=name)
    # The client comes back with this conversation extended: the end of its input is
    # where the next request may diverge (checkpointed where that matters: `generation`).
    if messages[-1]["role"] != "assistant":
        call.end_mark = (len(messages) - 1, 0)
    return call


# -- events -> answer --------------------------------------------------------------------------
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length",
           "tool_calls": "tool_calls"}


class ChatBuilder:
    """An answer as OpenAI chat completion chunks (streamed) and one completion (whole),
    fed the engine's events."""

    def __init__(self, body: Dict[str, Any], model: str,
                 accounting: Optional[Accounting] = None) -> None:
        self.id = f"chatcmpl-{uuid.uuid4()}"
        self.created = int(time.time())
        self.model = model
        opts = body.get("stream_options") or {}
        self._usage_chunk = bool(opts.get("include_usage"))
        self._accounting = accounting or Accounting(0, False)
        self.text = ""
        self.reasoning = ""
        self.calls: List[Dict[str, Any]] = []
        self._streaming: Dict[int, int] = {}  # a streaming call's place in `calls`, by index
        self._unread: set = set()  # calls that began streaming and did not read
        self.finish: Optional[str] = None
        self.usage: Optional[Dict[str, Any]] = None
        self.failed: Optional[str] = None

    def _chunk(self, delta: Dict[str, Any], finish: Optional[str] = None
               ) -> Tuple[None, Dict[str, Any]]:
        return None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                      "model": self.model,
                      "choices": [{"index": 0, "finish_reason": finish,
                                   "delta": {"role": "assistant", **delta}}]}

    def start(self) -> List[Tuple[Optional[str], Any]]:
        return []

    def _new_call(self, name: str, arguments: str) -> Dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return call

    def _call_delta(self, k: int, **fields: Any) -> Tuple[None, Dict[str, Any]]:
        return self._chunk({"tool_calls": [{"index": k, **fields}]})

    def feed(self, ev: Any) -> List[Tuple[Optional[str], Any]]:
        """The chunks ``ev`` makes."""
        if isinstance(ev, Text) and ev.text:
            self.text += ev.text
            return [self._chunk({"content": ev.text})]
        if isinstance(ev, Reasoning) and ev.text:
            self.reasoning += ev.text
            return [self._chunk({"reasoning": ev.text})]
        if isinstance(ev, CallBegin):
            call = self._new_call(ev.name, "")
            k = len(self.calls) - 1
            self._streaming[ev.index] = k
            return [self._call_delta(k, id=call["id"], type="function",
                                     function={"name": ev.name, "arguments": ""})]
        if isinstance(ev, CallArguments):
            k = self._streaming.get(ev.index)
            if k is None or not ev.delta:
                return []
            self.calls[k]["function"]["arguments"] += ev.delta
            return [self._call_delta(k, function={"arguments": ev.delta})]
        if isinstance(ev, (Call, CallCut)):
            k = self._streaming.pop(ev.index, None)
            if k is None:
                if isinstance(ev, CallCut):
                    return []
                call = self._new_call(ev.name, ev.arguments)
                return [self._call_delta(len(self.calls) - 1, id=call["id"], type="function",
                                         function={"name": ev.name, "arguments": ev.arguments})]
            sent = self.calls[k]["function"]["arguments"]
            rest = ev.arguments[len(sent):] if ev.arguments.startswith(sent) else ""
            if not rest:
                return []
            self.calls[k]["function"]["arguments"] += rest
            return [self._call_delta(k, function={"arguments": rest})]
        if isinstance(ev, UnreadCall):  # a begun call that did not read: its markup as text
            k = self._streaming.pop(ev.index, None) if ev.index is not None else None
            if k is not None:
                self._unread.add(k)
            return self.feed(Text(ev.raw))
        if isinstance(ev, Finished):
            self.finish = _FINISH.get(ev.reason, "stop")
            u = self._accounting.usage(ev.prompt_tokens, ev.cached_tokens, ev.output_tokens)
            self.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.output_tokens,
                          "total_tokens": u.prompt_tokens + u.output_tokens,
                          "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
                          "completion_tokens_details": {
                              "accepted_prediction_tokens": ev.accepted_prediction_tokens,
                              "rejected_prediction_tokens": ev.rejected_prediction_tokens}}
            out = [self._chunk({}, self.finish)]
            if self._usage_chunk:
                out.append((None, {"id": self.id, "object": "chat.completion.chunk",
                                   "created": self.created, "model": self.model,
                                   "choices": [], "usage": self.usage}))
            return out + [(None, DONE)]
        if isinstance(ev, Failed):
            self.failed = ev.message or "the answer failed"
            return [(None, error_body(self.failed, "server_error"))]
        return []

    def message(self) -> Dict[str, Any]:
        """The answer's message, as the whole completion has it (without calls that began
        streaming and did not read: their markup is in the text)."""
        msg: Dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        calls = [c for k, c in enumerate(self.calls) if k not in self._unread]
        if calls:
            msg["tool_calls"] = json.loads(json.dumps(calls))
        return msg

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The non-streamed reply: the completion, or a 500 when the answer failed."""
        if self.failed is not None or self.finish is None:
            return 500, error_body(self.failed or "the answer ended early", "server_error")
        return 200, {"id": self.id, "object": "chat.completion", "created": self.created,
                     "model": self.model,
                     "choices": [{"index": 0, "finish_reason": self.finish,
                                  "message": self.message()}],
                     "usage": self.usage}


# -- HTTP --------------------------------------------------------------------------------------
def _error(e: AgentRequestError) -> Dict[str, Any]:
    return error_body(e.message, e.kind, e.param, e.code)


def refusal(message: str) -> Dict[str, Any]:
    """The body of a request the server refuses while it stops: mlx-lm's chat route's
    shape (the path is its as much as ours)."""
    return {"error": message}


def _answer(handler, body: Dict[str, Any], start_usage: Callable[[], Any],
            accounting: Accounting) -> ChatBuilder:
    name = body.get("model")
    return ChatBuilder(body, name if isinstance(name, str) and name
                       else served_name(handler.response_generator), accounting)


def _reasoning_field(messages: List[Any]) -> Optional[str]:
    """How this client gives an answer's reasoning back: the field its earlier assistant
    messages carry it in; None where they carry none (it drops it); ``reasoning_content``
    before its first answer came back (what OpenCode and most chat clients send)."""
    answers = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    for key in ("reasoning_content", "reasoning"):
        if any(isinstance(m.get(key), str) and m.get(key) for m in answers):
            return key
    return None if answers else "reasoning_content"


def follow_up(body: Dict[str, Any], completion: Dict[str, Any],
              text: str) -> Optional[Dict[str, Any]]:
    """The request a chat client sends after ``completion`` (the answer to ``body``): the
    messages, the answer as the client gives it back (its reasoning in the field its earlier
    answers carried it, `_reasoning_field`), then a tool message of ``text`` for each call,
    or a user message of ``text`` after a text answer (`foresight`)."""
    msgs = body.get("messages")
    choices = completion.get("choices") or []
    if not isinstance(msgs, list) or not choices:
        return None
    answer = dict(choices[0].get("message") or {})
    reasoning = answer.pop("reasoning", None)
    field = _reasoning_field(msgs)
    if reasoning and field is not None:
        answer[field] = reasoning
    calls = answer.get("tool_calls") or []
    nxt = ([{"role": "tool", "tool_call_id": c["id"], "content": text} for c in calls]
           if calls else [{"role": "user", "content": text}])
    return dict(body, messages=[*msgs, answer, *nxt])


class Heard:
    """An answer of mlx-lm's chat route as its output parser read it (`Ticket.heard`), as
    the completion a client got (``whole``) — but the calls' ids, which mlx-lm made up."""

    def __init__(self, outputs: List[Any]) -> None:
        b = ChatBuilder({}, "")
        for out in outputs:
            b.feed(out)
        self._message = b.message()

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        return 200, {"choices": [{"index": 0, "message": self._message}]}


def _with_ids(completion: Dict[str, Any], text: str) -> Dict[str, Any]:
    """``completion`` with its calls' ids made from ``text`` (the sentinel of one
    rendering): ids the client has and the server does not differ between the renderings,
    so a template that renders them keeps none of them in the foreseen prefix."""
    msg = dict(completion["choices"][0]["message"])
    tag = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    msg["tool_calls"] = [dict(c, id=f"call_{tag}_{k}")
                         for k, c in enumerate(msg.get("tool_calls") or ())] or None
    if msg["tool_calls"] is None:
        del msg["tool_calls"]
    return {"choices": [{"index": 0, "message": msg}]}


def follow_answer(handler, heard: List[Any], epoch: int) -> None:
    """After mlx-lm's chat route answered ``handler``'s request (what it said: ``heard``):
    foresee the chat client's next request — rendered as mlx-lm's route will render it
    (`ServerResponseGenerator.render_chat`) — in the foresight ``epoch`` the answer's end
    counted (always ended: foreseen or cancelled)."""
    generator = handler.response_generator
    try:
        body = handler.body
        call = parse_request(body)
        if call.session is None:
            call.session = session_header(handler.headers)
        call.agent = agent_of(handler.headers)
        call.namespace = handler.cache_namespace
        if call.one_shot:
            generator.prompt_cache.foresight.cancel()
            return
        route = replace(ROUTE, follow=lambda b, c, t: follow_up(b, _with_ids(c, t), t))

        def render(nxt: Dict[str, Any]) -> Optional[List[int]]:
            return generator.render_chat(nxt["messages"], nxt.get("tools"),
                                         nxt.get("chat_template_kwargs"))
        foresight.follow(generator, route, body, Heard(heard), call, epoch, render)
    except Exception as e:  # noqa: BLE001 - a body the chat form cannot read: none foreseen
        log.debug("mlx_kvcache: no foresight for this chat answer: %s", e)
        generator.prompt_cache.foresight.cancel()


def _stream_error(e: AgentRequestError) -> List[Tuple[Optional[str], Any]]:
    return [(None, _error(e))]


ROUTE = Route(parse=parse_request, answer=_answer, error=_error, follow=follow_up,
              keepalive=b": keepalive\n\n", stream_error=_stream_error,
              session=session_header)


def serve_chat(handler) -> None:
    """Answer one ``POST /v1/chat/completions`` on ``handler`` through the front door."""
    serve(handler, ROUTE)
