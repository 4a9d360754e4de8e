"""A value per live model, made once and dropped with the model.

What is worth remembering per model (its vocabulary size: finding the embedding walks every
module; its prompt-lookup length policy: learned from every request) is kept by the
model's id with a weak reference — a module is a dict, so not hashable — and the entry
goes when the model does. A newer model that reuses a freed id never reads an older one's
entry (the reference is checked), and the entry's removal never takes a newer one's.

No lock: single dict operations are atomic, and the weak reference's callback may run
inside any allocation, a locked section included. Two threads asking at once for a model
not seen yet may both make its value; the first stored is the one both get.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Generic, Tuple, TypeVar

__all__ = ["PerModel"]

T = TypeVar("T")


class PerModel(Generic[T]):
    """``make(model)`` for each live model, made the first time it is asked (`__call__`)."""

    def __init__(self, make: Callable[[Any], T]) -> None:
        self._make = make
        self._by_id: Dict[int, Tuple["weakref.ref", T]] = {}

    def __call__(self, model: Any) -> T:
        key = id(model)
        hit = self._by_id.get(key)
        if hit is not None and hit[0]() is model:
            return hit[1]
        entry = (weakref.ref(model, lambda ref, key=key: self._forget(key, ref)),
                 self._make(model))
        kept = self._by_id.setdefault(key, entry)
        if kept[0]() is not model:  # a dead model's entry under a reused id
            self._by_id[key] = kept = entry
        return kept[1]

    def __len__(self) -> int:
        """How many live models have a value."""
        return len(self._by_id)

    def _forget(self, key: int, ref: "weakref.ref") -> None:
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is ref:  # not a newer model's entry under a reused id
            self._by_id.pop(key, None)
