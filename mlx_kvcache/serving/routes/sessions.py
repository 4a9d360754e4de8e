"""Who sent a request, as the clients say it: the session it belongs to and the agent in
that session — what foresight and retention are keyed by (`cache.foresight`).

* A session: the body's own name for it where the API has one (``prompt_cache_key``,
  ``user``; Claude Code's ``metadata.user_id`` is read by its route), else a header chat
  clients send (OpenCode's ``x-session-id``); None: the route names it by its conversation.
* An agent: Claude Code marks every request of a subagent with ``x-claude-code-agent-id``
  (its main loop sends none); None: the session's main loop.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["AGENT_HEADER", "SESSION_HEADERS", "agent_of", "session_header", "chat_session"]

#: The header Claude Code sends with every request of a subagent.
AGENT_HEADER = "x-claude-code-agent-id"
#: Headers chat clients name their session in (OpenCode's).
SESSION_HEADERS = ("x-session-id", "x-session-affinity")
#: The longest name kept (a client's string, logged and used as a key).
LONGEST = 128


def _name(v: Any) -> Optional[str]:
    return v[:LONGEST] if isinstance(v, str) and v else None


def agent_of(headers: Mapping[str, str]) -> Optional[str]:
    """The agent that sent a request, where the client names it; None: the main loop."""
    return _name(headers.get(AGENT_HEADER))


def session_header(headers: Mapping[str, str]) -> Optional[str]:
    """The session a chat client names in its headers, if any."""
    for key in SESSION_HEADERS:
        v = _name(headers.get(key))
        if v is not None:
            return v
    return None


def chat_session(body: Any, headers: Mapping[str, str]) -> Optional[str]:
    """A chat completions request's session: its ``prompt_cache_key`` or ``user``, else a
    session header."""
    if isinstance(body, dict):
        for key in ("prompt_cache_key", "user"):
            v = _name(body.get(key))
            if v is not None:
                return v
    return session_header(headers)
