"""Where a chat client's next request goes on from this one: past the answer, or back at
the generation prompt.

A chat client sends the conversation with the model's answer appended. Whether that next
prompt extends this prompt and the answer depends on the chat template: a ChatML-style
template renders its generation prompt (``<|im_start|>assistant\\n``) exactly as the
answer's turn opens in the history, so the next request diverges only after the answer
ends (where the prompt cache stores the caches anyway). A thinking template renders a
generation prompt the history does not repeat (an empty ``<think></think>`` pair, or the
answer's reasoning dropped from the history), so the next request diverges right after
the input: hybrid and sliding-window models then restore only where a state was stored
before that point, which is what the prompt cache's stop a few tokens before the end is
for (`prefix.planner.stops`, ``guess_end``).

`answer_extends_prompt` tells the two apart once per template, by rendering a probe
(`template_probe`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from .template_probe import decided

log = logging.getLogger("mlx_kvcache")

_PROBE_USER, _PROBE_ANSWER, _PROBE_NEXT = "Ping 7", "Pong 7.", "Again"


def answer_extends_prompt(tokenizer, template_args: Optional[Dict[str, Any]] = None) -> bool:
    """Whether the next request of a conversation extends this prompt and its answer:
    the template's rendering of ``[user]`` with the generation prompt, followed by the
    answer's text, starts the rendering of ``[user, assistant, user]``, and the model does
    not reason first (a reasoning model's answer comes back without its reasoning).
    False where it cannot be told (no chat template, a template that raises).
    ``template_args``: the chat template's arguments (``enable_thinking``, …)."""
    def probe() -> bool:
        extends = _probe(tokenizer, dict(template_args or {}))
        log.info("mlx_kvcache: the chat template %s",
                 "re-renders its generation prompt as the answer's turn: a conversation's "
                 "next request goes on past the answer" if extends else
                 "does not re-render its generation prompt as the answer's turn (or the "
                 "model reasons first): hybrid and sliding-window models also store the "
                 "caches a few tokens before each prompt's end")
        return extends
    return decided(tokenizer, "answer_extends_prompt", template_args, probe)


def _probe(tokenizer, template_args: Dict[str, Any]) -> bool:
    if not getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "has_thinking",
                                                                     False):
        return False
    user = {"role": "user", "content": _PROBE_USER}
    try:
        prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True,
                                               tokenize=False, **template_args)
        after = tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": _PROBE_ANSWER},
             {"role": "user", "content": _PROBE_NEXT}],
            add_generation_prompt=True, tokenize=False, **template_args)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: keep the stop
        return False
    return isinstance(prompt, str) and isinstance(after, str) and after.startswith(
        prompt + _PROBE_ANSWER)
