"""An agent request through the front door: a `ChatCall` rendered as the model's chat
template renders it, then answered by the engine (`engine.answer`).

Both agent front ends (`anthropic`: ``/v1/messages``; `responses`: ``/v1/responses``)
translate their request into a `ChatCall` (`call`: OpenAI chat-format messages, tools,
limits) and render the answer's typed events in their API's shape; `wire.serve` is the
driver both routes run.

What happens here before the engine sees the conversation (`conversation`): system
messages stay where the client put them (folded into the adjacent user turn where the
model's template refuses them), the billing line and user-named volatile lines are
dropped, and the rendered prompt's layout — where each message and content part starts —
rides along on the request (`MarkedRequest`): the client's ``cache_control`` breakpoints
become checkpoint offsets, and the prompt cache's miss explanation names the part a request
diverged in. The prompt is rendered and encoded once, in the HTTP thread, with the served
model's tokenizer (`ServerResponseGenerator.served_model`: an agent request runs on the
served model, whatever model mlx-lm's provider holds at that moment); its ids ride along
with the ``model_key`` they were encoded for, and the generation thread takes them instead
of rendering and encoding it again — on that model only (`MarkedRequest.tokenizer_for`).

A conversation that ends with the assistant's text is rendered open
(``continue_final_message``, no generation prompt) so the answer continues it (Anthropic's
prefill contract). The answer may not run past the context: a prompt over it is refused
here, before any work, and ``max_tokens`` is clamped to what it leaves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional

from ...engine.answer import Answer, AnswerRequest, Refused, Sampling, start
from ...engine.generator import ServerResponseGenerator
from ...engine.requests import MarkedRequest, ServedModel
from ...engine.templates import (REASONING_SWITCHES, answer_extends_prompt, arguments_as_text,
                                 honours_thinking, one_call_per_message, reasoning_or_content,
                                 reasoning_switches, system_policy)
from ...guards.context import ContextTooLong, answer_tokens, explicit_max_tokens, served_context
from ...guards.images import ImagePolicy, decode_bytes, inline
from ...guards.memory import MemoryRefused
from ..handler import KEEPALIVE_S
from . import conversation
from .call import AgentRequestError, ChatCall, Usage

__all__ = ["Prepared", "Accounting", "prepare", "run", "count_tokens", "prompt_ids",
           "served_name", "served_key"]

log = logging.getLogger("mlx_kvcache")


def served_name(generator: ServerResponseGenerator) -> str:
    """The name of the model the server serves (what answers any model name) — the served
    one, also while mlx-lm's provider holds another a chat request switched to."""
    served = generator.served()
    key = served.key if served is not None else generator.model_provider.model_key
    if key and key[0]:
        return str(key[0])
    return str(generator.cli_args.model or "default_model")


@dataclass
class Prepared:
    """A call rendered for the model: ``messages`` (what the chat template renders),
    ``tools``, its ``layout`` (ids, breakpoints, part marks), the template arguments it was
    rendered with, the model whose tokenizer rendered it, and where the client's last
    breakpoint ends (``marked_end``; 0: none)."""

    messages: List[Dict[str, Any]]
    tools: Optional[List[Dict[str, Any]]]
    layout: "conversation.Layout"
    template_args: Dict[str, Any]
    model: ServedModel
    marked_end: int = 0


@dataclass(frozen=True)
class Accounting:
    """How an answer's token counts split into the routes' usage (`Usage.split`): where
    the client's last breakpoint ends, and whether the prompt cache stores what it
    computes."""

    marked_end: int
    stores: bool

    def usage(self, prompt_tokens: int, cached_tokens: int, output_tokens: int = 0) -> Usage:
        return Usage.split(prompt_tokens, cached_tokens, self.marked_end, self.stores,
                           output_tokens)


def prepare(generator: ServerResponseGenerator, call: ChatCall) -> Prepared:
    """Render ``call`` as the served model's chat template renders it (`conversation`);
    `AgentRequestError` when the template refuses it or an image cannot be served."""
    try:
        model = generator.served_model()
    except RuntimeError as e:
        raise AgentRequestError(str(e), 503, "overloaded_error") from None
    tokenizer = model.tokenizer
    args = generator.cli_args
    base_args = dict(args.chat_template_args or {})
    template_args = dict(base_args)
    templated = bool(tokenizer.has_chat_template)
    if templated and call.thinking is not None:
        if honours_thinking(tokenizer, base_args):
            template_args["enable_thinking"] = call.thinking
        else:
            log.debug("mlx_kvcache: the chat template ignores enable_thinking: the "
                      "request's thinking setting is ignored")
    keep = call.keep_reasoning if call.keep_reasoning is not None else \
        bool(args.keep_reasoning)
    inline_reasoning = False
    if templated and keep and tokenizer.has_thinking:
        switches = reasoning_switches(tokenizer, template_args)
        inline_reasoning = switches is None
        template_args.update(switches or {})
    breakpoints = list(call.breakpoints)
    route_mark = call.end_mark is not None and call.end_mark not in breakpoints and \
        not answer_extends_prompt(tokenizer, template_args)
    if route_mark:
        breakpoints.append(call.end_mark)
    try:
        conv = conversation.Conversation.from_call(
            call.messages, call.labels, call.part_labels, breakpoints, call.call_breakpoints)
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    conv.drop_lines(conversation.line_filter(keep_billing=bool(args.keep_billing_header),
                                             extra=args.drop_lines))
    if templated:
        conv.fit_template(system_policy(tokenizer, base_args))
        if one_call_per_message(tokenizer, base_args):
            conv.one_call_per_message()
        if reasoning_or_content(tokenizer, base_args):
            conv.reasoning_beside_calls()
    if inline_reasoning:
        conv.inline_reasoning(tokenizer.think_start, tokenizer.think_end)
    messages = conv.messages()
    if templated and _continues(messages):
        # Anthropic's prefill contract (and a Responses input that ends with the
        # assistant's text): the answer goes on from the last assistant message — rendered
        # open, with no generation prompt after it (no new turn, no injected <think>).
        template_args["continue_final_message"] = True
    tools = call.tools or None
    try:
        layout = conversation.layout(tokenizer, conv, tools, template_args,
                                     vision=model.processor is not None,
                                     marked_tools=call.tool_breakpoints,
                                     text_arguments=templated and arguments_as_text(
                                         tokenizer, base_args))
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    problem = ImagePolicy.of(args).problem(messages)  # before anything fetches or decodes
    if problem is not None:
        raise AgentRequestError(problem)
    # The client's breakpoints (not the route's own end mark, at the input's end: after
    # every one of them) say what a request stores for reuse: its usage's cache creation.
    client_cuts = layout.cuts[:-1] if route_mark else layout.cuts
    marked = call.breakpoints or call.tool_breakpoints or call.call_breakpoints
    return Prepared(messages, tools, layout, template_args, model,
                    max(client_cuts, default=0) if marked else 0)


def _answer_limit(generator: ServerResponseGenerator, call: ChatCall,
                  prep: Prepared) -> Optional[int]:
    """The answer's ``max_tokens`` (`context.answer_tokens`: the client's, else the user's
    ``--max-tokens``, else what the context leaves; clamped to what it leaves). A prompt
    over the context is refused here, before any work: Anthropic's message, OpenAI's
    ``context_length_exceeded`` code."""
    try:
        return answer_tokens(served_context(generator), prep.layout.prompt_tokens,
                             call.max_tokens, explicit_max_tokens(generator.cli_args))
    except ContextTooLong as e:
        raise AgentRequestError(str(e), 400, "invalid_request_error",
                                code="context_length_exceeded") from None


def _continues(messages: List[Dict[str, Any]]) -> bool:
    """Whether the conversation ends with assistant text to continue (an assistant
    message last, with text and no tool calls)."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    text = content if isinstance(content, str) else "".join(
        p.get("text") or "" for p in content or () if isinstance(p, dict))
    return last.get("role") == "assistant" and bool(text.strip()) and not last.get("tool_calls")


def _with_images_inlined(messages: List[Dict[str, Any]], cap: Optional[int]) -> None:
    """Each allowed ``http(s)`` image URL of ``messages`` fetched into a ``data:`` URL (in
    place), as mlx-lm's chat route fetches them — every rank reads the same bytes; the
    policy checked them already. ValueError: one could not be fetched or is too large."""
    for m in messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("image_url",
                                                                      "input_image", "image"):
                continue
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                part.clear()
                part.update(type="image_url", image_url={"url": inline(url, cap)})


def request_of(generator: ServerResponseGenerator, call: ChatCall,
               prep: Prepared) -> AnswerRequest:
    """The engine's request for ``call`` rendered as ``prep``."""
    lay = prep.layout
    image_bytes = None
    if lay.images:
        policy = ImagePolicy.of(generator.cli_args)
        try:
            _with_images_inlined(prep.messages, policy.max_pixels)
        except ValueError as e:
            raise AgentRequestError(str(e)) from None
        image_bytes = ImagePolicy.decode_bytes(prep.messages)
    request = MarkedRequest(
        "chat", "", prep.messages, prep.tools, None, cuts=list(lay.cuts),
        marks=list(lay.marks), session=call.session, tokens=lay.ids,
        template_kwargs=dict(prep.template_args), reasoning_budget=call.reasoning_budget,
        namespace=call.namespace, model_key=prep.model.key, image_bytes=image_bytes,
        announce_fetch=True, agent=call.agent, one_shot=call.one_shot,
        prompt_lookup_num_tokens=call.prompt_lookup)
    # mlx-lm renders as the layout did: the template arguments the request asked for
    asked = {k: v for k, v in prep.template_args.items()
             if k in ("enable_thinking", "continue_final_message") or k in REASONING_SWITCHES}
    s = call.sampling
    return AnswerRequest(request, max_tokens=_answer_limit(generator, call, prep),
                         stop=list(call.stop), template_kwargs=asked or None,
                         sampling=Sampling(temperature=s.get("temperature"),
                                           top_p=s.get("top_p"), top_k=s.get("top_k"),
                                           min_p=s.get("min_p"), seed=s.get("seed")))


def accounting(generator: ServerResponseGenerator, prep: Prepared) -> Accounting:
    """How ``prep``'s answer's usage splits (`Accounting`)."""
    return Accounting(prep.marked_end, generator.prompt_cache.stores_prompts())


def run(generator: ServerResponseGenerator, call: ChatCall,
        waiting: Optional[Callable[[], None]] = None,
        every: float = KEEPALIVE_S) -> "tuple[Answer, Accounting]":
    """Answer ``call``: its `Answer` (typed events) once the generation thread took it, and
    how its usage splits. `AgentRequestError` before anything is generated (bad input, a
    refusal: the context, the memory guard, the server stopping); afterwards a failure is a
    `Failed` event. ``waiting`` is called every ``every`` seconds while the request waits
    to be taken (a streamed answer's keep-alive; what it raises drops the request)."""
    prep = prepare(generator, call)
    req = request_of(generator, call, prep)
    try:
        answer = start(generator, req, waiting, every)
    except Refused as e:
        raise _agent_error(e) from None
    return answer, accounting(generator, prep)


def _agent_error(e: Refused) -> AgentRequestError:
    if not e.client_error:
        return AgentRequestError(e.message, e.status if e.status == 503 else 500,
                                 "overloaded_error" if e.status == 503 else "api_error",
                                 code=e.code)
    return AgentRequestError(e.message, e.status, "invalid_request_error", code=e.code)


def count_tokens(generator: ServerResponseGenerator, call: ChatCall) -> int:
    """The prompt tokens `run` would give the model for ``call`` (the chat template applied
    as mlx-lm's chat route applies it, each image expanded by the model's image
    processor)."""
    prep = prepare(generator, call)
    lay, processor = prep.layout, prep.model.processor
    if not lay.images or processor is None:
        return lay.prompt_tokens
    cap = ImagePolicy.of(generator.cli_args).max_pixels
    try:
        # The URL forms the message route serves (an allowed http(s) one is fetched here,
        # as mlx-lm's route fetches it), each checked against the pixel cap first; then
        # decoded as the message route decodes them: on the generation thread, once the
        # memory guard admits their decoding.
        lay = replace(lay, images=[inline(u, cap) for u in lay.images])
        return generator.decode(
            lambda: conversation.processed_tokens(prep.model.tokenizer, processor, lay),
            decode_bytes(lay.images))
    except MemoryRefused as e:  # 400 where it never fits, else 503 (retry later)
        raise AgentRequestError(str(e), e.status, "invalid_request_error" if e.status == 400
                                else "overloaded_error") from None
    except ValueError as e:
        raise AgentRequestError(str(e)) from None
    except RuntimeError as e:  # the generation thread is gone (the server stops)
        raise AgentRequestError(str(e), 503, "overloaded_error") from None


def prompt_ids(generator: ServerResponseGenerator, call: ChatCall) -> Optional[List[int]]:
    """The prompt's token ids `run` would give the model for ``call`` (rendered and
    encoded exactly as it would be, by the served model's tokenizer: `served_key`), or
    None where images make them the processor's."""
    ids = prepare(generator, call).layout.ids
    return None if ids is None else list(ids)


def served_key(generator: ServerResponseGenerator) -> Any:
    """The ``model_key`` of the model agent requests run on and are encoded for."""
    return generator.served_model().key
