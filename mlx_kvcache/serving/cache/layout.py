"""A fetch explained in the prompt's own terms: the miss explanation (`prefix.explain`)
named by the part of the prompt where reuse stopped, and the client's session.

Before each fetch the generator tells the prompt cache the layout of the prompt it is
about to fetch for (`TriePromptCache.expect`: where each message and part starts, the
client's session name): a `Layout`. The fetch's explanation then names the part it
diverged in (``reuse.where``), and the request log lists the session. Prompt text appears
in an explanation only with ``excerpts`` (decoded by the model's tokenizer, salts
removed: `namespace.unsalted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

from ...prefix.explain import Explainer, Reuse
from ...prefix.manager import PrefixManager
from .namespace import unsalted

__all__ = ["Layout", "FetchExplainer"]


@dataclass(frozen=True)
class Layout:
    """The next fetch's prompt as the generator laid it out: ``length`` tokens whose parts
    start at ``marks`` (``(offset, name)``, ascending), the client's ``session`` and that
    session as foresight keys it (``scoped``: `namespace.scoped_session`)."""

    length: int
    marks: Tuple[Tuple[int, str], ...]
    session: Optional[str]
    scoped: Optional[str]

    def part_at(self, offset: Optional[int]) -> str:
        """The name of the part holding token ``offset`` (the last mark at or before it;
        "" when none does)."""
        if offset is None:
            return ""
        name = ""
        for at, label in self.marks:
            if at > offset:
                break
            name = label
        return name


class FetchExplainer:
    """Each fetch's explanation for the request log (generation thread only).

    Args:
        excerpts: show prompt text around where reuse stopped (False: offsets and rules
            only).
    """

    def __init__(self, excerpts: bool) -> None:
        self.excerpts = bool(excerpts)
        #: The trie-level explainer (remembers recent prompts: `Explainer.remember`).
        self.explainer = Explainer()
        self._next: Optional[Layout] = None

    def open(self, tokenizer: Any) -> None:
        """A model was loaded: explain with its ``tokenizer``'s text (None: ids), afresh."""
        self.explainer = Explainer(_decoder(tokenizer) if self.excerpts else None)

    def expect(self, layout: Optional[Layout]) -> None:
        """The next fetch's `Layout` (None: none known)."""
        self._next = layout

    def explain(self, manager: PrefixManager, tokens: np.ndarray, plan: Any, restored: int,
                clears: int) -> Tuple[Optional[Reuse], Optional[Layout]]:
        """The explanation of a fetch of ``tokens`` (the trie key) that restored
        ``restored`` by ``plan`` (`PrefixManager.checkout`'s), ``clears`` the cache's clear
        count; and the `Layout` it was expected with, when it is this prompt's (images key
        a prompt otherwise). Each layout serves one fetch."""
        reuse = manager.peek(lambda: self.explainer.explain(
            manager.trie, tokens, plan.matched, restored, plan.reason, manager.ops,
            manager.evicted_bytes, clears))
        if not self.excerpts:
            reuse = reuse.without_text()
        layout, self._next = self._next, None
        if layout is not None and layout.length != len(tokens):
            layout = None
        if layout is not None and reuse is not None:
            reuse.where = layout.part_at(reuse.diverged_at)
        return reuse, layout


def _decoder(tokenizer: Any) -> Optional[Callable[[Sequence[int]], str]]:
    """Token ids to text for the miss explanations (None: show ids)."""
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(unsalted(ids), skip_special_tokens=False)
