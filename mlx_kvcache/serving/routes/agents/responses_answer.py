"""The OpenAI Responses API's answer: the engine's events (`engine.answer`) as the stream's
events — each with its ``sequence_number`` — and the final ``response`` object; the
non-streamed answer is the streamed one's last snapshot, so the two cannot disagree
(`ResponseBuilder`). The request side and the route: `responses`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ...engine.answer import Failed, Finished
from ...parsers.base import Call, CallArguments, CallBegin, CallCut, Reasoning, Text, UnreadCall
from .generation import Accounting

__all__ = ["ResponseBuilder", "render", "error_body", "custom_tools"]


def error_body(message: str, kind: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def custom_tools(body: Any) -> set:
    """The names of the request's ``custom`` tools (their calls are ``custom_tool_call``
    items)."""
    tools = body.get("tools") if isinstance(body, dict) else None
    return {t.get("name") for t in tools or () if isinstance(t, dict)
            and t.get("type") == "custom" and isinstance(t.get("name"), str)}


# -- Events -> response ------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The Responses answer built from the engine's events (`engine.answer`).

    `start` gives the opening stream events (``response.created``, ``response.in_progress``);
    `feed` one event's stream events; `fail` the closing ``response.failed``. `response`
    is the ``response`` object as of now (the final one once ``done`` was fed)."""

    def __init__(self, body: Dict[str, Any], model: str,
                 accounting: Optional[Accounting] = None) -> None:
        self.id = _new_id("resp")
        self._accounting = accounting or Accounting(0, False)
        self._streaming: Dict[int, int] = {}  # a streaming call's output index, by call index
        self.created_at = int(time.time())
        self.body, self.model = body, model
        self.output: List[Dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: Optional[Dict[str, Any]] = None
        self.error: Optional[Dict[str, Any]] = None
        self.usage: Optional[Dict[str, Any]] = None
        self._seq = 0
        self._open: Optional[Dict[str, Any]] = None  # the item text goes into, if any
        self._open_kind: Optional[str] = None
        self._call_ids: set = set()
        self._custom = custom_tools(body)

    # the response object -----------------------------------------------------------------------
    def response(self) -> Dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "model": self.model,
            "output": json.loads(json.dumps(self.output)),
            "error": self.error, "incomplete_details": self.incomplete,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "metadata": b.get("metadata") or {}, "store": b.get("store", False),
            "prompt_cache_key": b.get("prompt_cache_key"),
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": self.usage,
        }

    def output_text(self) -> str:
        return "".join(p["text"] for item in self.output if item["type"] == "message"
                       for p in item["content"])

    # stream events -----------------------------------------------------------------------------
    def _ev(self, kind: str, **fields: Any) -> Tuple[str, Dict[str, Any]]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return kind, ev

    def _snapshot(self, kind: str) -> Tuple[str, Dict[str, Any]]:
        return self._ev(kind, response=self.response())

    def start(self) -> List[Tuple[str, Dict[str, Any]]]:
        return [self._snapshot("response.created"), self._snapshot("response.in_progress")]

    def _close(self, status: str = "completed") -> List[Tuple[str, Dict[str, Any]]]:
        item, kind = self._open, self._open_kind
        self._open = self._open_kind = None
        if item is None:
            return []
        idx = len(self.output) - 1
        item["status"] = status
        out = []
        if kind == "message":
            part = item["content"][0]
            out.append(self._ev("response.output_text.done", item_id=item["id"],
                                output_index=idx, content_index=0, text=part["text"],
                                logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=item["id"],
                                output_index=idx, content_index=0, part=dict(part)))
        elif kind == "reasoning":
            part = item["content"][0]
            out.append(self._ev("response.reasoning_text.done", item_id=item["id"],
                                output_index=idx, content_index=0, text=part["text"]))
            out.append(self._ev("response.content_part.done", item_id=item["id"],
                                output_index=idx, content_index=0, part=dict(part)))
        out.append(self._ev("response.output_item.done", output_index=idx,
                            item=json.loads(json.dumps(item))))
        return out

    def _open_item(self, kind: str) -> List[Tuple[str, Dict[str, Any]]]:
        if self._open_kind == kind:
            return []
        out = self._close()
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": []}
        self.output.append(item)
        idx = len(self.output) - 1
        out.append(self._ev("response.output_item.added", output_index=idx,
                            item=json.loads(json.dumps(item))))
        item["content"].append(part)
        out.append(self._ev("response.content_part.added", item_id=item["id"],
                            output_index=idx, content_index=0, part=dict(part)))
        self._open, self._open_kind = item, kind
        return out

    def feed(self, event: Any) -> List[Tuple[str, Dict[str, Any]]]:
        """The stream events ``event`` (an engine event) makes (none for an empty delta)."""
        if isinstance(event, (Text, Reasoning)):
            if not event.text:
                return []
            kind = "message" if isinstance(event, Text) else "reasoning"
            out = self._open_item(kind)
            item = self._open
            item["content"][0]["text"] += event.text
            idx = len(self.output) - 1
            name = ("response.output_text.delta" if kind == "message"
                    else "response.reasoning_text.delta")
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self._ev(name, item_id=item["id"], output_index=idx, content_index=0,
                                delta=event.text, **extra))
            return out
        if isinstance(event, CallBegin):
            if event.name in self._custom:  # a custom tool's input is sent whole (`Call`)
                return []
            out = self._close()
            call_id = _new_id("call")
            self._call_ids.add(call_id)
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call_id, "name": event.name, "arguments": ""}
            self.output.append(item)
            self._streaming[event.index] = len(self.output) - 1
            out.append(self._ev("response.output_item.added", output_index=len(self.output) - 1,
                                item=dict(item)))
            return out
        if isinstance(event, CallArguments):
            idx = self._streaming.get(event.index)
            if idx is None or not event.delta:
                return []
            item = self.output[idx]
            item["arguments"] += event.delta
            return [self._ev("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=idx, delta=event.delta)]
        if isinstance(event, UnreadCall):  # a begun call that did not read: closed, then text
            idx = self._streaming.get(event.index) if event.index is not None else None
            out = self.feed(CallCut(event.index, "", self.output[idx]["arguments"])) \
                if idx is not None else []
            return out + self.feed(Text(event.raw))
        if isinstance(event, (Call, CallCut)):
            idx = self._streaming.pop(event.index, None)
            if idx is None and isinstance(event, CallCut):
                return []
            if idx is None:
                return self._whole_call(event.name, event.arguments)
            item = self.output[idx]
            out = []
            rest = event.arguments[len(item["arguments"]):] \
                if event.arguments.startswith(item["arguments"]) else ""
            if rest:
                item["arguments"] += rest
                out.append(self._ev("response.function_call_arguments.delta",
                                    item_id=item["id"], output_index=idx, delta=rest))
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"],
                                output_index=idx, arguments=item["arguments"]))
            item["status"] = "completed" if isinstance(event, Call) else "incomplete"
            out.append(self._ev("response.output_item.done", output_index=idx,
                                item=dict(item)))
            return out
        if isinstance(event, Finished):
            cut = event.reason == "length"
            out = self._close("incomplete" if cut else "completed")
            if cut:
                self.status = "incomplete"
                self.incomplete = {"reason": "max_output_tokens"}
            else:
                self.status = "completed"
            u = self._accounting.usage(event.prompt_tokens, event.cached_tokens,
                                       event.output_tokens)
            self.usage = {
                "input_tokens": u.prompt_tokens,
                # OpenAI's input_tokens is the whole prompt, cached ones included;
                # cache writes are a client breakpoint's, which Responses has not.
                "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                         "cache_write_tokens": u.created_tokens},
                "output_tokens": u.output_tokens,
                # not counted apart from the answer by the engine
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.output_tokens,
            }
            out.append(self._snapshot("response.incomplete" if cut else "response.completed"))
            return out
        if isinstance(event, Failed):
            return self.fail(event.message or "the answer failed")
        return []  # events this front end does not render

    def _whole_call(self, name: str, args: str) -> List[Tuple[str, Dict[str, Any]]]:
        """A call that came whole: its item, its arguments in one delta."""
        out = self._close()
        call_id = _new_id("call")
        self._call_ids.add(call_id)
        if name in self._custom:
            return out + self._custom_call(call_id, name, args)
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call_id, "name": name, "arguments": ""}
        self.output.append(item)
        idx = len(self.output) - 1
        out.append(self._ev("response.output_item.added", output_index=idx, item=dict(item)))
        item["arguments"] = args
        out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=idx, delta=args))
        out.append(self._ev("response.function_call_arguments.done", item_id=item["id"],
                            output_index=idx, arguments=args))
        item["status"] = "completed"
        out.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def _custom_call(self, call_id: str, name: str, args: str) -> List[Tuple[str, Dict[str, Any]]]:
        """A call of a custom tool: a ``custom_tool_call`` item whose ``input`` is the
        text the model gave as the function's ``input`` (its arguments as generated, where
        they are not that)."""
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        text = parsed["input"] if isinstance(parsed, dict) and \
            isinstance(parsed.get("input"), str) else args
        item = {"id": _new_id("ctc"), "type": "custom_tool_call", "call_id": call_id,
                "name": name, "input": ""}
        self.output.append(item)
        idx = len(self.output) - 1
        out = [self._ev("response.output_item.added", output_index=idx, item=dict(item))]
        item["input"] = text
        out.append(self._ev("response.custom_tool_call_input.delta", item_id=item["id"],
                            output_index=idx, delta=text))
        out.append(self._ev("response.custom_tool_call_input.done", item_id=item["id"],
                            output_index=idx, input=text))
        out.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return out

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The non-streamed reply: the response, or a 500 when the answer failed."""
        if self.status == "failed":
            return 500, error_body(self.error["message"], "server_error")
        return 200, self.response()

    def fail(self, message: str) -> List[Tuple[str, Dict[str, Any]]]:
        """The closing events of an answer the server could not finish."""
        out = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        out.append(self._snapshot("response.failed"))
        return out


def render(body: Dict[str, Any], model: str, events: Iterable[Any]
           ) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every stream event of an answer made of ``events`` (without failure handling)."""
    b = ResponseBuilder(body, model)
    yield from b.start()
    for ev in events:
        yield from b.feed(ev)
