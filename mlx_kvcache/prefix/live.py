"""`LiveSet`: one request's own cache list and the tokens it holds.

Requests own the caches they run on (docs/design.md, "Concurrency"): a live set is
checked out of the manager by exactly one request at a time, written only by it, and
handed back at the request's end. Nothing else ever writes it, whatever threads or event
loops drive the request.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ..caches.factory import leaf_caches
from ..caches.recurrent import RecurrentCache
from .tokens import as_tokens

_NONE = as_tokens(())


class LiveSet:
    """A model's cache list (``caches``), its flattened layers (``leaves``) and the token
    ids they hold (``tokens``: a read-only int64 array, shared with the request that
    computed them, never copied; valid while `consistent`)."""

    __slots__ = ("caches", "leaves", "tokens", "epoch", "__weakref__")

    def __init__(self, caches: List[Any], epoch: int = 0) -> None:
        self.caches = caches
        self.leaves = leaf_caches(caches)
        self.tokens: np.ndarray = _NONE
        self.epoch = epoch

    @property
    def offset(self) -> int:
        """The smallest layer offset (all are equal while consistent)."""
        return min((c.offset for c in self.leaves), default=0)

    def consistent(self, length: int) -> bool:
        """True when every layer holds exactly ``length`` tokens and no recurrent layer has
        a half-applied write (an interrupted forward pass)."""
        for c in self.leaves:
            if c.offset != length:
                return False
            if isinstance(c, RecurrentCache) and c._dirty:
                return False
        return True

    def reset(self) -> None:
        """Drop all state."""
        for c in self.leaves:
            c.free()
        self.tokens = _NONE

    @property
    def nbytes(self) -> int:
        """Bytes the live buffers hold (growth padding included: it is real memory)."""
        return sum(c.nbytes for c in self.leaves)

    def __repr__(self) -> str:
        return f"LiveSet({len(self.tokens)} tokens, {self.nbytes} B)"
