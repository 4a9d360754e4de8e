"""The Anthropic Messages API's answer: the engine's events (`engine.answer`) as content
blocks — ``thinking`` with a ``signature`` (`sign_thinking`), ``text``, ``tool_use`` with
its input streamed as ``input_json_delta`` — and stream events, ``stop_reason`` and usage
that adds up (`MessageBuilder`). The request side and the route: `anthropic`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...engine.answer import Failed, Finished
from ...parsers.base import (Call, CallArguments, CallBegin, CallCut, Reasoning, Text,
                             UnreadCall, partial_arguments)
from .call import Usage
from .generation import Accounting

__all__ = ["MessageBuilder", "sign_thinking", "signed_here", "error_body", "STOP_REASONS"]

#: The API's stop reasons, by the engine's (`engine.answer.Finished.reason`).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "stop_sequence": "stop_sequence"}


def error_body(message: str, kind: str = "invalid_request_error") -> Dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


#: What thinking blocks' signatures are keyed with: a fixed key, so the same answer is the
#: same bytes from any server and after a restart (nothing is trusted on a signature: a
#: block coming back is only rendered, signed or not).
_SIGNING_KEY = b"mlx-kvcache thinking v1"


def sign_thinking(thinking: str) -> str:
    """The ``signature`` of a thinking block this server produced: an HMAC of its text
    (opaque to clients; Claude Code drops thinking blocks without one)."""
    mac = hmac.new(_SIGNING_KEY, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(mac).decode("ascii")


def signed_here(thinking: str, signature: Any) -> bool:
    """Whether ``signature`` is the one this server gives ``thinking``."""
    return isinstance(signature, str) and hmac.compare_digest(signature,
                                                              sign_thinking(thinking))


# -- the answer ------------------------------------------------------------------------------
def _usage(u: Optional[Usage]) -> Dict[str, int]:
    """Anthropic's usage: the three input counts add up to the prompt (`Usage`)."""
    if u is None:
        u = Usage(0, 0, 0, 0)
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "cache_creation_input_tokens": u.created_tokens,
            "cache_read_input_tokens": u.cached_tokens}


def _tool_input(arguments: str) -> Any:
    try:
        v = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {"value": v}


class MessageBuilder:
    """An answer as Anthropic content blocks and stream events, fed the engine's events.

    ``start_usage``: the prompt's usage before the answer (``message_start``'s); ``accounting``
    splits the usage at the end (`generation.Accounting`)."""

    def __init__(self, model: str, start_usage: Optional[Callable[[], Usage]] = None,
                 accounting: Optional[Accounting] = None) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self._start_usage = start_usage or (lambda: Usage(0, 0, 0, 0))
        self._accounting = accounting or Accounting(0, False)
        self.blocks: List[Dict[str, Any]] = []
        self._open: Optional[str] = None  # the kind of the block being streamed
        self._args: Dict[int, str] = {}  # a streaming call's arguments so far, by call index
        self._unread: set = set()  # blocks of begun calls that did not read (not in `message`)
        self.done: Optional[Finished] = None
        self.usage: Optional[Usage] = None
        self.failed: Optional[str] = None  # why the answer failed after it started

    def start(self) -> List[Tuple[str, Dict[str, Any]]]:
        """``message_start`` (its usage is the prompt's, as the end's: it may wait for the
        prompt cache's fetch) and a ``ping``."""
        head = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": _usage(self._start_usage())}
        return [("message_start", {"type": "message_start", "message": head}),
                ("ping", {"type": "ping"})]

    def _close(self) -> List[Tuple[str, Dict[str, Any]]]:
        if self._open is None:
            return []
        out: List[Tuple[str, Dict[str, Any]]] = []
        if self._open == "thinking":  # signed once whole, as Anthropic's stream signs it
            block = self.blocks[-1]
            block["signature"] = sign_thinking(block["thinking"])
            out.append(("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "signature_delta", "signature": block["signature"]}}))
        self._open = None
        return out + [("content_block_stop", {"type": "content_block_stop",
                                              "index": len(self.blocks) - 1})]

    def _text(self, kind: str, text: str) -> List[Tuple[str, Dict[str, Any]]]:
        out: List[Tuple[str, Dict[str, Any]]] = []
        if self._open != kind:
            out += self._close()
            block = ({"type": "text", "text": ""} if kind == "text"
                     else {"type": "thinking", "thinking": "", "signature": ""})
            self.blocks.append(dict(block))
            self._open = kind
            out.append(("content_block_start", {"type": "content_block_start",
                                                "index": len(self.blocks) - 1,
                                                "content_block": block}))
        self.blocks[-1][kind] += text
        delta = ({"type": "text_delta", "text": text} if kind == "text"
                 else {"type": "thinking_delta", "thinking": text})
        out.append(("content_block_delta", {"type": "content_block_delta",
                                            "index": len(self.blocks) - 1, "delta": delta}))
        return out

    def _begin(self, name: str) -> List[Tuple[str, Dict[str, Any]]]:
        out = self._close()
        tid = f"toolu_{uuid.uuid4().hex[:24]}"
        self.blocks.append({"type": "tool_use", "id": tid, "name": name, "input": {}})
        self._open = "tool_use"
        return out + [("content_block_start", {
            "type": "content_block_start", "index": len(self.blocks) - 1,
            "content_block": {"type": "tool_use", "id": tid, "name": name, "input": {}}})]

    def _arguments(self, delta: str) -> List[Tuple[str, Dict[str, Any]]]:
        if not delta:
            return []
        return [("content_block_delta", {"type": "content_block_delta",
                                         "index": len(self.blocks) - 1,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": delta}})]

    def feed(self, ev: Any) -> List[Tuple[str, Dict[str, Any]]]:
        """The stream events ``ev`` makes (and the whole answer's blocks grow)."""
        out: List[Tuple[str, Dict[str, Any]]] = []
        if isinstance(ev, (Text, Reasoning)):
            if ev.text:
                out += self._text("text" if isinstance(ev, Text) else "thinking", ev.text)
        elif isinstance(ev, CallBegin):
            out += self._begin(ev.name)
            self._args[ev.index] = ""
        elif isinstance(ev, CallArguments):
            if ev.index in self._args:
                self._args[ev.index] += ev.delta
                out += self._arguments(ev.delta)
        elif isinstance(ev, Call):
            streamed = self._args.pop(ev.index, None)
            if streamed is None:  # the call came whole: its arguments in one delta
                out += self._begin(ev.name)
                self.blocks[-1]["input"] = _tool_input(ev.arguments)
                out += self._arguments(json.dumps(self.blocks[-1]["input"]))
            else:
                self.blocks[-1]["input"] = _tool_input(ev.arguments)
                rest = ev.arguments[len(streamed):] if ev.arguments.startswith(streamed) \
                    else ""
                out += self._arguments(rest)
            out += self._close()
        elif isinstance(ev, CallCut):
            if self._args.pop(ev.index, None) is not None:  # (only a begun call is cut)
                self.blocks[-1]["input"] = partial_arguments(ev.arguments)
                out += self._close()
        elif isinstance(ev, UnreadCall):  # a begun call that did not read: closed, then text
            streamed = self._args.pop(ev.index, None) if ev.index is not None else None
            if streamed is not None:
                self.blocks[-1]["input"] = partial_arguments(streamed)
                self._unread.add(len(self.blocks) - 1)
                out += self._close()
            out += self._text("text", ev.raw)
        elif isinstance(ev, Finished):
            self.done = ev
            self.usage = self._accounting.usage(ev.prompt_tokens, ev.cached_tokens,
                                                ev.output_tokens)
            out += self._close()
            out += [("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": self.stop_reason,
                                                 "stop_sequence": ev.stop_sequence},
                                       "usage": _usage(self.usage)}),
                    ("message_stop", {"type": "message_stop"})]
        elif isinstance(ev, Failed):
            self.failed = ev.message or "the answer failed"
            out.append(("error", error_body(self.failed, "api_error")))
        return out

    def whole(self) -> Tuple[int, Dict[str, Any]]:
        """The non-streamed reply: the message, or a 500 when the answer failed."""
        if self.failed is not None or self.done is None:
            return 500, error_body(self.failed or "the answer ended early", "api_error")
        return 200, self.message()

    @property
    def stop_reason(self) -> Optional[str]:
        if self.done is None:
            return None
        return STOP_REASONS.get(self.done.reason, "end_turn")

    def message(self) -> Dict[str, Any]:
        """The whole answer (after its `Finished` event): without the blocks of calls that
        began streaming and did not read (their markup follows as text)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [b for i, b in enumerate(self.blocks) if i not in self._unread],
                "stop_reason": self.stop_reason,
                "stop_sequence": self.done.stop_sequence if self.done else None,
                "usage": _usage(self.usage)}
