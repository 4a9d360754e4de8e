"""Anthropic's ``thinking.budget_tokens``: at most that many tokens of reasoning, then the
model's end-of-thinking token, forced, and the model answers.

A logits processor of the request's own. mlx-lm builds each request's processors with
``_make_logits_processors(args)`` on both of its paths; `seam.patched` wraps that to add
ours where the request carries a budget (`generator` puts it on the request's arguments
when it tokenizes it). The processor keeps no count of its own: it reads where the
reasoning opened from the tokens it is handed — mlx-lm gives every processor the prompt
and the answer so far (on the sequential path the restored prompt too: `stream`) — so it
decides the same for a position whatever order it is asked in (speculative decoding asks
for several at once) and on every rank of a sharded model.

Reasoning that opens without a start token (a template whose generation prompt already
is the reasoning, with no ``<think>`` in the prompt), or a model whose start or end of
thinking is more than one token, gets no budget (one log line).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlx_kvcache")

__all__ = ["ReasoningBudget", "with_budgets"]


class ReasoningBudget:
    """Forces ``end_id`` once ``budget`` tokens followed the last ``start_id`` with no
    ``end_id`` after it."""

    def __init__(self, budget: int, start_id: int, end_id: int) -> None:
        if budget < 1:
            raise ValueError(f"a reasoning budget is a positive number of tokens, not {budget}")
        self.budget, self.start_id, self.end_id = int(budget), int(start_id), int(end_id)

    @classmethod
    def for_tokenizer(cls, tokenizer, budget: int) -> Optional["ReasoningBudget"]:
        """The budget for a model whose tokenizer marks reasoning with one start and one
        end token (mlx-lm's ``think_start_id`` / ``think_end_id``); None otherwise."""
        try:
            start, end = tokenizer.think_start_id, tokenizer.think_end_id
        except ValueError:  # mlx-lm: a start or end of thinking of several tokens
            start = end = None
        if start is None or end is None:
            log.info("mlx_kvcache: this model's reasoning is not marked by one start and one "
                     "end token: thinking.budget_tokens is not enforced")
            return None
        return cls(budget, start, end)

    def spent(self, tokens: Any) -> Optional[int]:
        """Reasoning tokens since the open start of thinking in ``tokens`` (None: none open)."""
        t = np.asarray(tokens).reshape(-1)
        marks = np.flatnonzero((t == self.start_id) | (t == self.end_id))
        if not len(marks) or t[marks[-1]] != self.start_id:
            return None
        return len(t) - 1 - int(marks[-1])

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        spent = self.spent(tokens)
        if spent is None or spent < self.budget:
            return logits
        only = mx.arange(logits.shape[-1]) == self.end_id
        return mx.where(only, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))


def with_budgets(make: Callable[[Any], List[Callable]]) -> Callable[[Any], List[Callable]]:
    """mlx-lm's ``_make_logits_processors(args)``, with the request's `ReasoningBudget`
    (``args.reasoning_budget``) appended where it has one."""

    def make_logits_processors(args):
        processors = list(make(args) or [])
        budget = getattr(args, "reasoning_budget", None)
        if budget is not None:
            processors.append(budget)
        return processors
    make_logits_processors.__wrapped__ = make
    return make_logits_processors
