"""`LiveSet`: one request's own cache list and the tokens it holds.

Requests own the caches they run on (docs/design.md, "Concurrency"): a live set is
checked out of the manager by exactly one request at a time, written only by it, and
handed back at the request's end. Nothing else ever writes it, whatever threads or event
loops drive the request.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from ..caches.factory import half_written, leaf_caches, quantizable
from ..caches.schedule import KVQuantization
from .tokens import as_tokens

_NONE = as_tokens(())


class LiveSet:
    """A model's cache list (``caches``), its flattened layers (``leaves``: a class the
    package does not know appears as its `GenericCache` adapter while the model keeps its
    own object in ``caches``) and the token ids they hold (``tokens``: a read-only int64
    array, shared with the request that computed them, never copied; valid while
    `consistent`). ``quant`` is the ``kv_bits`` schedule its full-attention layers follow."""

    __slots__ = ("caches", "leaves", "tokens", "epoch", "quant", "shared", "__weakref__")

    def __init__(self, caches: List[Any], epoch: int = 0,
                 quant: Optional[KVQuantization] = None) -> None:
        self.caches = caches
        self.leaves = leaf_caches(caches)
        self.tokens: np.ndarray = _NONE
        self.epoch = epoch
        self.quant = quant
        #: Bytes of it that the trie holds too (a working copy restored for idle work, not
        #: a request's: `counted_bytes` leaves them to the trie's count).
        self.shared = 0

    def leaf_quant(self) -> List[Optional[KVQuantization]]:
        """Per leaf, the schedule it follows: the top-level full-attention caches (the ones
        the switch converts, as mlx-lm's) follow ``quant``; layers inside a ``CacheList``
        and every other kind stay in full precision (None)."""
        if self.quant is None:
            return [None] * len(self.leaves)
        out: List[Optional[KVQuantization]] = []
        for c in self.caches:
            n = len(leaf_caches([c]))
            out.extend([self.quant if quantizable(c) else None] * n)
        return out

    def quantize_due(self) -> None:
        """Switch the full-attention layers whose offset reached the schedule's start to
        quantized rows (call before every forward pass; see `KVQuantization`)."""
        if self.quant is not None and self.quant.convert(self.caches):
            self.leaves = leaf_caches(self.caches)

    def align(self, target: int) -> None:
        """Before a restore to ``target``: the layer classes that target needs."""
        if self.quant is not None and self.quant.align(self.caches, target):
            self.leaves = leaf_caches(self.caches)

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
            if half_written(c):
                return False
        return True

    def reset(self) -> None:
        """Drop all state."""
        for c in self.leaves:
            c.free()
        self.align(0)
        self.tokens = _NONE

    @property
    def nbytes(self) -> int:
        """Bytes the live buffers hold (growth padding included: it is real memory)."""
        return sum(c.nbytes for c in self.leaves)

    @property
    def counted_bytes(self) -> int:
        """What it adds to the manager's budget: its bytes but those the trie holds too."""
        return max(0, self.nbytes - self.shared)

    def __repr__(self) -> str:
        return f"LiveSet({len(self.tokens)} tokens, {self.nbytes} B)"
