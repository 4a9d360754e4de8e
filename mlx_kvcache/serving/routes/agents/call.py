"""One agent request as both agent APIs hand it to the front door (`ChatCall`), its usage
as the APIs split it (`Usage`), and the refusal before anything runs (`AgentRequestError`):
the data the routes, `generation` and the wire share, knowing nothing of HTTP or mlx-lm.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...engine.lookup_request import BODY_FIELD, lookup_tokens

__all__ = ["ChatCall", "Usage", "AgentRequestError", "restrict_tools", "one_shot",
           "keep_reasoning_of", "prompt_lookup_of", "SkippedTools"]

log = logging.getLogger("mlx_kvcache")


@dataclass
class ChatCall:
    """One chat request, as both agent front ends hand it to the front door.

    ``messages``: OpenAI chat-format messages, roles ``system`` / ``user`` / ``assistant`` /
    ``tool``; ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts
    (joined with nothing between them, as mlx-lm's chat route joins them); an assistant
    message may carry ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments" (a JSON string)}}]``) and ``reasoning``; a tool message ``tool_call_id``.
    System messages may be anywhere: they render where they are (see `conversation`).
    ``labels``: per message, the client's name for it (``"messages[3]"``, ``"input[4]"``),
    used by the miss explanation; ``part_labels`` optionally names each content part (else
    ``"<label>.content[j]"``). ``tools``: OpenAI function tools (``[{"type": "function",
    "function": {"name", "description", "parameters"}}]``), given to the chat template.
    ``tool_choice``: the client's, as sent (`restrict_tools` enforces what can be).
    ``max_tokens``: the client's limit, None for none (`generation` then lets the answer run
    to what the context leaves, or the user's ``--max-tokens``: `context.answer_tokens`).
    ``sampling``: only what the client sent (``temperature``, ``top_p``, ``top_k``); the
    rest are the server's defaults. ``stop``: stop strings. ``breakpoints``: ``(message
    index, part index)`` whose END the client marked for reuse (part index 0 for a string
    content): the prompt cache stores a checkpoint there; ``tool_breakpoints`` (indices of
    ``tools``) and ``call_breakpoints`` (``(message index, tool call index)``) likewise;
    ``end_mark``: the ``(message, part)`` where the input ends, marked by the route itself
    where the client comes back with the conversation extended, and checkpointed only where
    that next request may diverge right after it (`templates`: a template whose generation
    prompt the history does not repeat, or a reasoning model). ``thinking``: whether the
    model should reason first (Anthropic's ``thinking``), None for the template's default:
    given to the chat template as ``enable_thinking`` where it honours it, else ignored (a
    debug log line); ``reasoning_budget``: at most that many tokens of it
    (`reasoning_budget`), or None. ``session``: the client's session name (Codex
    ``prompt_cache_key``, Claude Code's ``session_id`` in ``metadata.user_id``), or None:
    listed with the request in the log line and ``GET /v1/cache`` ``recent``; eviction stays
    least-recently-used, which already takes other sessions' leaves first (see
    `TriePromptCache.expect`).
    ``keep_reasoning``: render earlier assistant turns with their reasoning as generated
    (the client's ``keep_reasoning``; None: the server's ``--keep-reasoning``).
    """

    messages: List[Dict[str, Any]]
    labels: List[str] = field(default_factory=list)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Any = None
    max_tokens: Optional[int] = None
    sampling: Dict[str, Any] = field(default_factory=dict)
    stop: List[str] = field(default_factory=list)
    breakpoints: List[Tuple[int, int]] = field(default_factory=list)
    session: Optional[str] = None
    part_labels: Optional[List[Optional[List[str]]]] = None
    tool_breakpoints: List[int] = field(default_factory=list)
    call_breakpoints: List[Tuple[int, int]] = field(default_factory=list)
    thinking: Optional[bool] = None
    reasoning_budget: Optional[int] = None
    end_mark: Optional[Tuple[int, int]] = None
    keep_reasoning: Optional[bool] = None
    #: The client's cache namespace (set by the wire from ``cache_salt``, a header or the
    #: API key: `routes.namespace`), or None: the shared cache.
    namespace: Optional[str] = None
    #: The agent that sends it within its session (Claude Code's subagent id, from its
    #: header: `wire.agent_of`), None for the main loop: foresight and retention are its.
    agent: Optional[str] = None
    #: A one-shot request (a title, a suggestion: no tools, and a structured-output schema
    #: or a small limit): nothing is foreseen after it, it takes no agent's foreseen prefix,
    #: and what it alone computed goes first under the budget once it is answered.
    one_shot: bool = False
    #: The request's own ``prompt_lookup_num_tokens`` (0: no prompt lookup for it), or
    #: None: the server's (`prompt_lookup_of`).
    prompt_lookup: Optional[int] = None


def restrict_tools(call: ChatCall, none: bool = False, name: Optional[str] = None,
                   param: str = "tool_choice", allowed: Optional[List[str]] = None) -> None:
    """Enforce what a ``tool_choice`` can honestly enforce on ``call``: ``none`` — the chat
    template is given no tools (the model is told of none); ``name`` — only that tool
    (the model is told of no other); ``allowed`` — only those tools, in the request's
    order. Otherwise (``auto``, ``any`` / ``required``) the tools stay as they are: a
    template cannot force a call. A name not among ``call.tools`` is an
    `AgentRequestError` naming it (``param``: the field)."""
    if none:
        call.tools, call.tool_breakpoints = None, []
        return
    wanted = [name] if name is not None else allowed
    if wanted is None:
        return
    names = [t["function"]["name"] for t in call.tools or ()]
    for w in wanted:
        if w not in names:
            among = f"which is not among tools ({', '.join(names)})" if names else \
                "but the request has no tools"
            raise AgentRequestError(f"{param} names the tool {w!r}, {among}", param=param)
    keep = [k for k, n in enumerate(names) if n in wanted]
    call.tool_breakpoints = [i for i, k in enumerate(keep) if k in call.tool_breakpoints]
    call.tools = [call.tools[k] for k in keep] or None


@dataclass
class Usage:
    """Token counts of one answer, split so they add up: ``prompt_tokens`` (the whole
    prompt, what ``count_tokens`` says) = ``cached_tokens`` (restored from the prompt
    cache: the log line's ``cached``) + ``created_tokens`` (computed by this request up to
    the end of the client's last ``cache_control`` breakpoint, where the prompt cache
    stores them for reuse; 0 without a breakpoint, or where the cache stores nothing) +
    `input_tokens` (the rest: computed after that breakpoint). ``output_tokens``: the
    answer's."""

    prompt_tokens: int
    cached_tokens: int
    created_tokens: int
    output_tokens: int

    @classmethod
    def split(cls, prompt_tokens: int, cached_tokens: int, marked_end: int, stores: bool,
              output_tokens: int = 0) -> "Usage":
        """The counts of a ``prompt_tokens`` prompt of which ``cached_tokens`` were
        restored, whose last client breakpoint ends at token ``marked_end`` (0: none), on
        a prompt cache that ``stores`` what it computes."""
        prompt = max(int(prompt_tokens), 0)
        cached = max(0, min(int(cached_tokens), prompt))
        created = max(0, min(int(marked_end), prompt) - cached) if stores else 0
        return cls(prompt, cached, created, int(output_tokens))

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens not read from the cache (computed by this request)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def input_tokens(self) -> int:
        """Computed prompt tokens past the last breakpoint (Anthropic's ``input_tokens``)."""
        return self.prompt_tokens - self.cached_tokens - self.created_tokens


class AgentRequestError(Exception):
    """A request the front door will not run, raised before any event: ``status`` (HTTP),
    ``message`` (for the client), ``kind`` (``"invalid_request_error"``, ``"overloaded_error"``
    while the server stops, ``"api_error"``), ``param`` (the request field at fault, where
    one is; OpenAI's error names it) and ``code`` (a machine-readable reason, where the API
    has one: ``"context_length_exceeded"``, ``"server_stopping"``)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code



#: The largest answer limit a request without tools can ask for and count as a one-shot
#: (Claude Code's session title asks for 256 tokens).
ONE_SHOT_TOKENS = 256


def one_shot(tools_sent: bool, schema: bool, max_tokens: Optional[int]) -> bool:
    """Whether a request is a one-shot — a title, a summary, a suggestion: no conversation
    goes on from it — by its shape: no tools, and a structured-output schema or a small
    answer limit (`ONE_SHOT_TOKENS`)."""
    return not tools_sent and (schema or (max_tokens is not None
                                          and max_tokens <= ONE_SHOT_TOKENS))


def keep_reasoning_of(body: Dict[str, Any]) -> Optional[bool]:
    """The request's ``keep_reasoning`` (both agent routes take it: render earlier
    assistant turns with their reasoning as generated), None when not sent;
    `AgentRequestError` naming it when it is not a boolean."""
    value = body.get("keep_reasoning")
    if value is not None and not isinstance(value, bool):
        raise AgentRequestError("keep_reasoning must be true or false", param="keep_reasoning")
    return value


def prompt_lookup_of(body: Dict[str, Any]) -> Optional[int]:
    """The request's ``prompt_lookup_num_tokens`` (every route takes it, as mlx-lm's own
    routes take ``num_draft_tokens``), None when not sent; `AgentRequestError` naming it
    when it is not an integer >= 0."""
    try:
        return lookup_tokens(body)
    except ValueError as e:
        raise AgentRequestError(str(e), param=BODY_FIELD) from None


class SkippedTools:
    """The tool types a route skips (server tools: ``web_search``, ``local_shell``, …),
    each logged the first time it is seen — with a bound: at most `KEPT` type names are
    remembered, each cut to `WIDTH` characters, and a request's log line names at most
    `SHOWN` of them (then a count). A client sending ever new type strings grows neither
    the process's memory nor its log."""

    KEPT, WIDTH, SHOWN = 64, 40, 8

    def __init__(self, route: str) -> None:
        self._route = route
        self._seen: set = set()
        self._lock = threading.Lock()

    def note(self, kinds: List[Any]) -> None:
        """Log the types among ``kinds`` not logged before (while fewer than `KEPT` were)."""
        with self._lock:
            room = self.KEPT - len(self._seen)
            if room <= 0 or not kinds:
                return
            new = sorted({str(k)[:self.WIDTH] for k in kinds[:self.KEPT * 4]} - self._seen)[:room]
            self._seen.update(new)
        if new:
            shown = ", ".join(repr(k) for k in new[:self.SHOWN])
            more = f" and {len(new) - self.SHOWN} more" if len(new) > self.SHOWN else ""
            log.info("mlx_kvcache: %s: tools of type %s%s skipped (only the tools the route "
                     "serves reach the chat template)", self._route, shown, more)

    def __len__(self) -> int:
        return len(self._seen)
