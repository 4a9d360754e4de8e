"""What a request carries to the generation thread beside mlx-lm's own fields, and what
the generation thread says of the model it serves:

* `MarkedRequest` — mlx-lm's chat request with an agent route's layout of its prompt (its
  ids, checkpoint cuts, part marks), the client's session, agent and cache namespace, what
  decoding its images takes, and whether it came through the typed front door (`answer`);
  `tokenizer_for` answers mlx-lm's rendering of it from the ids the route made;
* `ServedModel` — the served model (its key, tokenizer, image processor and output
  parser), kept while another model is loaded;
* `Fetched` — what a front-door request's sequential fetch restored, put on its queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm.server import CompletionRequest

from ..parsers.registry import Chosen, parser_for

__all__ = ["MarkedRequest", "ServedModel", "Fetched", "tokenizer_for"]


@dataclass
class MarkedRequest(CompletionRequest):
    """mlx-lm's chat request with what an agent route knows of its prompt's layout
    (`agents.conversation.layout`): ``cuts``, offsets where the client marked a part for
    reuse (checkpoints there); ``marks``, ``(offset, name)`` where each message and part
    starts (the miss explanation names the one a request diverged in); ``session``, the
    client's session name. Offsets are checked against the prompt the generation thread
    makes (a cut is only ever a place to store the caches, never read as content).
    A plain chat or text request with a cache ``namespace`` is one too (no layout)."""

    cuts: List[int] = field(default_factory=list)
    marks: List[Tuple[int, str]] = field(default_factory=list)
    session: Optional[str] = None
    #: The prompt as the agent route rendered and encoded it (for its layout), with the
    #: template arguments it rendered with: mlx-lm's tokenizing takes these ids instead of
    #: rendering and encoding the same prompt again (`tokenizer_for`).
    tokens: Optional[List[int]] = None
    template_kwargs: Optional[Dict[str, Any]] = None
    #: At most this many tokens of reasoning (Anthropic's ``budget_tokens``), or None.
    reasoning_budget: Optional[int] = None
    #: The client's cache namespace (`cache.namespace`), or None: the shared cache.
    namespace: Optional[str] = None
    #: The ``model_key`` of the model whose tokenizer made `tokens`, `cuts` and `marks`.
    model_key: Any = None
    #: What decoding its images takes (`images.decode_bytes`), read by the HTTP thread as
    #: it checked them; None: not read there (the generation thread reads it).
    image_bytes: Optional[int] = None
    #: A request of the typed front door (`answer`): its queue also gets `Fetched`, the
    #: sequential fetch's restore, before the prompt is computed.
    announce_fetch: bool = False
    #: The agent in the session that sent it (a subagent's id; None: the main loop), and
    #: whether it is a one-shot (a title): foresight's key (`TriePromptCache.expect`).
    agent: Optional[str] = None
    one_shot: bool = False
    #: The request's own ``prompt_lookup_num_tokens`` (0: off), or None: the server's.
    prompt_lookup_num_tokens: Optional[int] = None
    #: True once its client left before the generation thread took it (`abandon`): a
    #: plain flag, as the request is pickled to the other ranks of a sharded model.
    abandoned: bool = False

    def abandon(self) -> None:
        """Its client left (any thread): the generation thread drops the request when it
        reaches it (a refusal no one reads) instead of computing an answer — on one
        process; the ranks of a sharded model run it (they must stay in step)."""
        self.abandoned = True

    def encoded_for(self, model_key: Any) -> bool:
        """Whether `tokens`, `cuts` and `marks` are in the vocabulary of the model
        ``model_key`` names (the one about to run this request)."""
        return self.model_key == model_key

    def tokenizer_for(self, tokenizer, model_key: Any = None):
        """``tokenizer``, or a view of it that answers the rendering of this request's own
        prompt (its messages, its tools, the generation prompt, the same template
        arguments) with `tokens` — only when this request was encoded for the running
        model ``model_key`` (`encoded_for`: ids of another model's vocabulary are never
        answered, mlx-lm renders and encodes again) — and renders a continued last
        message without a generation prompt; every other call goes to ``tokenizer``."""
        ids = self.tokens if self.encoded_for(model_key) else None
        if ids is None and not (self.template_kwargs or {}).get("continue_final_message"):
            return tokenizer
        return _KnownPrompt(tokenizer, self, ids)


class _KnownPrompt:
    """A tokenizer whose ``apply_chat_template`` answers one known rendering from its ids
    (and renders a continued last message without a generation prompt)."""

    def __init__(self, tokenizer, request: MarkedRequest, ids: Optional[List[int]]) -> None:
        self._tokenizer, self._request, self._ids = tokenizer, request, ids

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, *args, tokenize=True, **kwargs):
        r = self._request
        rest = {k: v for k, v in kwargs.items() if k not in ("tools", "add_generation_prompt")}
        if (self._ids is not None and tokenize and not args and messages is r.messages
                and kwargs.get("tools") is r.tools and kwargs.get("add_generation_prompt")
                and rest == (r.template_kwargs or {})):
            return list(self._ids)
        if kwargs.get("continue_final_message"):
            # The last assistant message is continued (an agent route's prefill): no
            # generation prompt after it, whatever mlx-lm's call asks for.
            kwargs["add_generation_prompt"] = False
        return self._tokenizer.apply_chat_template(messages, *args, tokenize=tokenize, **kwargs)


def tokenizer_for(tokenizer, request, model_key):
    """The tokenizer mlx-lm tokenizes ``request`` with on the model ``model_key``
    (`MarkedRequest.tokenizer_for`)."""
    return (request.tokenizer_for(tokenizer, model_key) if isinstance(request, MarkedRequest)
            else tokenizer)


@dataclass(frozen=True)
class ServedModel:
    """The model the server serves (``--model``: what every agent request and every
    request naming no other model runs on), as the generation thread loaded it first:
    its ``model_key``, ``tokenizer`` and image ``processor``. Kept while a request naming
    another model has mlx-lm's provider hold that one, so the agent routes render and
    encode with the tokenizer of the model that will run them."""

    key: Any
    tokenizer: Any
    processor: Any = None
    #: Makes the output parser of one answer on this model (`parsers.registry`).
    parser: Optional[Chosen] = None

    @classmethod
    def of(cls, key: Any, tokenizer: Any, processor: Any = None) -> "ServedModel":
        """The model ``key`` with its tokenizer and processor, its parser chosen from the
        registry."""
        return cls(key, tokenizer, processor, parser_for(tokenizer))


@dataclass(frozen=True)
class Fetched:
    """What a front-door request's sequential fetch restored (``restored`` tokens), put on
    its response queue before its prompt is computed (`MarkedRequest.announce_fetch`)."""

    restored: int
