"""Scripted agent sessions through the official SDKs, for foresight's tests and the agents
benchmark: user turns carrying the scripted model's cue (`agent_templates.CUE`), each
answered by a loop of tool calls (the scripted model's) whose results the session makes
up, every answer appended to the history as that API's client appends it.

APIs: ``anthropic`` (``messages.create`` / ``messages.stream``: content blocks sent back as
returned, thinking blocks included, whitespace-only text blocks dropped as Claude Code
drops them, ``tool_result`` blocks), ``responses``
(``responses.create`` / ``responses.stream``: output items sent back as returned,
``function_call_output`` items, ``prompt_cache_key``) and ``chat`` (chat completions, as
OpenCode-style clients: the assistant's text and tool calls sent back, its reasoning not;
thinking on / off as ``chat_template_kwargs``) — the one stock ``mlx_lm.server`` serves.

Each request is recorded as a `Step`: the prompt's tokens and those read from cache as the
answer's usage says, and the characters the client added since the last request (the
scripted model's tokenizer has one token per character, the cue one token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .agent_templates import CUE

__all__ = ["Step", "Session", "SYSTEM", "READ_TOOL"]

SYSTEM = "You are a careful agent."
#: The one tool the scripted model calls.
READ_TOOL = {"name": "read_file", "description": "Read a file.",
             "schema": {"type": "object", "properties": {"path": {"type": "string"}},
                        "required": ["path"]}}


@dataclass
class Step:
    """One request: ``prompt`` tokens, ``cached`` of them read from cache, ``added`` the
    tokens the client added since its last request (its new text; markup not counted),
    ``called`` whether the answer called tools."""

    prompt: int
    cached: int
    added: int
    called: bool

    @property
    def computed(self) -> int:
        return self.prompt - self.cached


class Session:
    """One scripted session on ``port`` (see the module doc).

    Args:
        api: ``anthropic``, ``responses`` or ``chat``.
        thinking: the model reasons first (Anthropic ``thinking``, Responses
            ``reasoning.effort``, chat ``enable_thinking``).
        stream: stream each answer (the SDK's accumulator builds the whole one).
        name: the session's name (sent as ``metadata.user_id`` / ``prompt_cache_key``, and
            in the system prompt: sessions share no prompt).
        result_len: characters of each tool result.
        extra: more request fields (``extra_body``).
        pause: called after each answer (the client's busy time: a tool run, a person).
    """

    def __init__(self, port: int, api: str, thinking: bool = True, stream: bool = False,
                 name: str = "s1", result_len: int = 400, extra: Optional[Dict[str, Any]] = None,
                 pause: Optional[Callable[[], None]] = None, max_tokens: int = 300,
                 headers: Optional[Dict[str, str]] = None,
                 reasoning_back: Optional[str] = None) -> None:
        self.api, self.stream, self.thinking = api, stream, thinking
        #: Headers every request sends (a subagent's id), and (chat) the field the client
        #: gives the answer's reasoning back in (OpenCode: ``reasoning_content``; None: it
        #: drops it).
        self.headers = dict(headers or {})
        self.reasoning_back = reasoning_back
        self.name, self.result_len, self.max_tokens = name, result_len, max_tokens
        self.extra = dict(extra or {})
        self.pause = pause
        self.system = f"{SYSTEM} (session {name})"
        base = f"http://127.0.0.1:{port}"
        if api == "anthropic":
            import anthropic
            self.client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0,
                                              timeout=3600)
        elif api in ("responses", "chat"):
            import openai
            self.client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                        timeout=3600)
        else:
            raise ValueError(f"unknown api {api!r}")
        self.history: List[Dict[str, Any]] = (
            [{"role": "system", "content": self.system}] if api == "chat" else [])
        self.steps: List[Step] = []
        self._added = 0

    # -- the client's side ------------------------------------------------------------------------
    def user(self, text: str) -> None:
        """A new user message (the cue appended)."""
        self.history.append({"role": "user", "content": f"{text} {CUE}"})
        self._added += len(text) + 2  # " " and the cue (one token)

    def result(self, path: str) -> str:
        """What the tool returns for ``path`` (``result_len`` characters)."""
        return (f"[{path}] " + "lorem ipsum dolor sit amet " * (self.result_len // 27 + 1)
                )[: self.result_len]

    def turn(self, text: str, limit: int = 8) -> List[Any]:
        """A user turn and its tool loop, to the text answer; the answers."""
        self.user(text)
        answers = []
        for _ in range(limit):
            out, called = self.ask()
            answers.append(out)
            if self.pause is not None:
                self.pause()
            if not called:
                return answers
        raise AssertionError("the scripted model never answered in text")

    def ask(self) -> Tuple[Any, bool]:
        """One request; the answer as sent back, and whether it called tools."""
        fn = {"anthropic": self._anthropic, "responses": self._responses, "chat": self._chat}
        prompt, cached, out, calls = fn[self.api]()
        self.steps.append(Step(prompt, cached, self._added, bool(calls)))
        self._added = sum(len(self.result(p)) for p in calls)
        return out, bool(calls)

    # -- the APIs ---------------------------------------------------------------------------------
    def _anthropic(self):
        kw = dict(model="claude", max_tokens=self.max_tokens, system=self.system,
                  messages=self.history, metadata={"user_id": self.name},
                  tools=[{"name": READ_TOOL["name"], "description": READ_TOOL["description"],
                          "input_schema": READ_TOOL["schema"]}],
                  thinking=({"type": "enabled", "budget_tokens": 1024} if self.thinking
                            else {"type": "disabled"}),
                  extra_body={"temperature": 0, **self.extra},
                  extra_headers=self.headers or None)
        if self.stream:
            with self.client.messages.stream(**kw) as st:
                r = st.get_final_message()
        else:
            r = self.client.messages.create(**kw)
        # (whitespace-only text blocks dropped, as Claude Code does: Anthropic's API
        # refuses them)
        content = [b.model_dump(exclude_none=True) for b in r.content
                   if b.type != "text" or b.text.strip()]
        self.history.append({"role": "assistant", "content": content})
        calls = [b for b in content if b["type"] == "tool_use"]
        if calls:
            self.history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"],
                 "content": self.result(b["input"]["path"])} for b in calls]})
        u = r.usage
        return (u.input_tokens + (u.cache_read_input_tokens or 0), u.cache_read_input_tokens or 0,
                content, [b["input"]["path"] for b in calls])

    def _responses(self):
        kw = dict(model="codex", instructions=self.system, input=self.history,
                  tools=[{"type": "function", "name": READ_TOOL["name"],
                          "description": READ_TOOL["description"],
                          "parameters": READ_TOOL["schema"]}],
                  temperature=0, prompt_cache_key=self.name, max_output_tokens=self.max_tokens,
                  reasoning={"effort": "medium" if self.thinking else "none"},
                  extra_body=self.extra or None, extra_headers=self.headers or None)
        if self.stream:
            with self.client.responses.stream(**kw) as st:
                r = st.get_final_response()
        else:
            r = self.client.responses.create(**kw)
        out = [o.model_dump(exclude_none=True) for o in r.output]
        self.history += out
        calls = [o for o in out if o["type"] == "function_call"]
        paths = [json.loads(o["arguments"])["path"] for o in calls]
        self.history += [{"type": "function_call_output", "call_id": o["call_id"],
                          "output": self.result(p)} for o, p in zip(calls, paths)]
        u = r.usage
        return u.input_tokens, u.input_tokens_details.cached_tokens, out, paths

    def _chat(self):
        kw = dict(model="default_model", messages=self.history, temperature=0,
                  max_tokens=self.max_tokens, stream=True, stream_options={"include_usage": True},
                  tools=[{"type": "function", "function": {
                      "name": READ_TOOL["name"], "description": READ_TOOL["description"],
                      "parameters": READ_TOOL["schema"]}}],
                  extra_body={"chat_template_kwargs": {"enable_thinking": self.thinking},
                              **self.extra},
                  extra_headers={"x-session-id": self.name, **self.headers})
        text, reasoning, calls, usage = "", "", {}, None
        for chunk in self.client.chat.completions.create(**kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                reasoning += getattr(c.delta, "reasoning", None) or ""
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] = tc.id or slot["id"]
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        msg: Dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning and self.reasoning_back:
            msg[self.reasoning_back] = reasoning
        ordered = [calls[k] for k in sorted(calls)]
        if ordered:
            msg["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(ordered)]
        self.history.append(msg)
        paths = [json.loads(c["arguments"])["path"] for c in ordered]
        self.history += [{"role": "tool", "tool_call_id": m["id"], "content": self.result(p)}
                         for m, p in zip(msg.get("tool_calls", []), paths)]
        cached = 0
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        return (usage.prompt_tokens if usage is not None else 0), cached, msg, paths
