"""What the next request of an agent session will render to, worked out when an answer ends.

The client comes back with the same request extended: this answer as its API returns it
(text, ``tool_use`` / ``function_call`` with the arguments as JSON, the reasoning as that
API's clients send it back), then a tool result for each call (the loop goes on) or, after
a text answer, a new user message. Its content is the one unknown. So the route builds
that next request body (`wire.Route.follow`) with a sentinel in place of the unknown
content, parses it with its own parser and renders it as every request is rendered
(`generation.prepare`: the same conversation rules, template arguments and chat template): every token before
the sentinel's rendering is the next prompt's. Where the sentinel starts is found by
rendering with three sentinels that share no first character class and keeping the
tokens all three renderings share, so no token that could merge with the real content
is kept. The prompt cache computes what it lacks of those tokens in idle time
(`cache.foresight`); the rendering itself runs on a thread of its own, after the answer
was sent.

A session is the client's name for it (``metadata.user_id``, ``prompt_cache_key``) or, for
clients that send none, a digest of the conversation's first messages. The foreseen
tokens carry the request's cache namespace (`cache.namespace`): they are computed into
its part of the trie, never the shared one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from ...cache.namespace import Namespaced
from .generation import prompt_ids, served_key
from .call import AgentRequestError, ChatCall

__all__ = ["SENTINELS", "expecting", "follow", "common_prefix", "session_of", "agent_render",
           "Render"]

log = logging.getLogger("mlx_kvcache")

#: Stand-ins for the unknown content: a letter, whitespace, punctuation first.
SENTINELS = ("Qv", "\n\n", ' {"')


def _foresight(generator):
    """The server's prompt cache and its `Foresight`, None where foresight is off."""
    cache = generator.prompt_cache
    fs = cache.foresight
    return cache, fs if fs.enabled else None


def expecting(generator) -> Optional[int]:
    """An answer is ending (its last event not yet sent): when foresight is on, count a
    rendering to come (`follow` ends it), so a reader of ``GET /v1/cache`` who has the
    answer sees the work pending. Returns the epoch its offer belongs to (a ``DELETE
    /v1/cache`` before the offer drops it), or None when foresight is off."""
    _, fs = _foresight(generator)
    return None if fs is None else fs.expect()


def session_of(call: ChatCall) -> str:
    """The session a call belongs to: the client's name, else a digest of its first
    messages (the system prompt and the first user turn). Foresight keys it with the agent
    that sends the call (`ChatCall.agent`: a subagent's id; the main loop has none)."""
    if call.session:
        return call.session
    head = json.dumps(call.messages[:2], sort_keys=True, default=str).encode()
    return "conversation:" + hashlib.sha256(head).hexdigest()[:16]


def common_prefix(seqs: Sequence[Sequence[int]]) -> List[int]:
    """The longest prefix every sequence shares."""
    first = list(seqs[0])
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return first[:i]
    return first[:n]


#: Renders a follow-up request body as the prompt's token ids (None: nothing to foresee).
Render = Callable[[Dict[str, Any]], Optional[List[int]]]


def agent_render(generator, route) -> Render:
    """How an agent route renders a request body: its parser, then `generation.prepare`."""
    return lambda body: prompt_ids(generator, route.parse(body))


def follow(generator, route, body: Dict[str, Any], answer, call: ChatCall,
           epoch: Optional[int], render: Optional[Render] = None) -> None:
    """After ``answer`` (the route's `wire.Answer`, complete) was sent, having had a counted
    `expecting` (its ``epoch``): render the next prompt of ``call``'s agent on a thread of
    its own (``render``: the route's rendering, `agent_render` by default) and hand its
    known tokens to the prompt cache, in the call's cache namespace."""
    cache, fs = _foresight(generator)
    if fs is None:
        return
    try:
        status, whole = answer.whole()
    except Exception:  # noqa: BLE001 - an answer that cannot say itself: nothing foreseen
        status = None
    if status != 200:  # the answer failed after all
        fs.cancel()
        return
    threading.Thread(target=_render, args=(generator, cache, fs, route, body, whole, call,
                                           epoch, render or agent_render(generator, route)),
                     name="mlx_kvcache-foresight", daemon=True).start()


def _render(generator, cache, fs, route, body, answer, call: ChatCall, epoch: Optional[int],
            render: Render) -> None:
    offered = False
    try:
        renders = []
        for s in SENTINELS:
            nxt = route.follow(body, answer, s)
            if nxt is None:
                return
            ids = render(nxt)
            if not ids:
                return
            renders.append(ids)
        known = common_prefix(renders)
        if known:
            ns = call.namespace
            cache.idle_work.foresee(session_of(call), Namespaced(known, ns) if ns else known,
                          model_key=served_key(generator), epoch=epoch, agent=call.agent)
            offered = True
    except AgentRequestError as e:  # the route would refuse its own follow-up: say why once
        log.debug("mlx_kvcache: no foresight for this answer: %s", e.message)
    except Exception:  # never more than a lost optimisation
        log.exception("mlx_kvcache: foreseeing the next prompt failed")
    finally:
        if not offered:
            fs.cancel()
