"""How a layer goes back after a rejected draft (speculative decoding): each kind's rule.

After a speculative round a model must hold only the emitted tokens. Each layer answers
(`generation.speculative` asks every layer the same verbs, never its class):

* ``rewinds_live()`` — it can go back to any earlier offset from its live state alone
  (asks nothing of the arrays);
* ``needs_checkpoint(ahead)`` — after a pass of ``ahead`` more tokens it may be unable to
  rewind live, so it is checkpointed before the pass;
* ``rewind(t)`` — go back to ``t`` tokens from the live state (False, and no change,
  where it cannot);
* ``rollback_point()`` / ``return_to(point, at)`` — its whole state, unchangeable by
  later writes, and the way back to it (``at``: the offset it was taken at).

Our classes carry the members (`Rollback`: a KV layer rewinds through
``restore(None, t)``, a whole-state layer comes back from a snapshot; the window's rule
is `RotatingKVCache`'s own). mlx-lm's classes — a request runs on them when the prefix
cache is off — and a model's own classes are adapted here (`ForeignRollback`, through
mlx-lm 0.32's protocol: ``trim`` to rewind, ``state``, scalars included, to checkpoint).
`rollback_of` gives any layer's rules.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as mlc

__all__ = ["Rollback", "ForeignRollback", "rollback_of", "layers_of"]


class Rollback:
    """The rollback rules of our cache classes (a mixin; expects ``restore``,
    ``snapshot``, ``free`` and ``is_trimmable``). A kind whose live rewind is not
    ``is_trimmable`` overrides `rewinds_live` and `needs_checkpoint`."""

    def rewinds_live(self) -> bool:
        return bool(self.is_trimmable())  # type: ignore[attr-defined]

    def needs_checkpoint(self, ahead: int) -> bool:
        return not self.is_trimmable()  # type: ignore[attr-defined]

    def rewind(self, t: int) -> bool:
        return self.restore(None, t)  # type: ignore[attr-defined]

    def rollback_point(self) -> Any:
        """A snapshot of the whole state (None: the layer is empty)."""
        return self.snapshot(0)  # type: ignore[attr-defined]

    def return_to(self, point: Any, at: int) -> bool:
        if point is None:  # the layer was empty at the checkpoint
            self.free()  # type: ignore[attr-defined]
            return at == 0
        return self.restore(point, at)  # type: ignore[attr-defined]


def _fresh(x: Any) -> Any:
    # A new wrapper around the same (immutable) data: an in-place write to the cache's
    # array later rebinds only the cache's wrapper, never the saved one.
    return mx.array(x) if isinstance(x, mx.array) else x


class ForeignRollback:
    """The rollback rules of a cache class that is not ours (mlx-lm's, a model's own),
    through mlx-lm 0.32's protocol. A window (an int ``max_size``) needs a checkpoint
    once a pass would wrap it; any other class when it is not trimmable."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def rewinds_live(self) -> bool:
        return bool(self.cache.is_trimmable())

    def needs_checkpoint(self, ahead: int) -> bool:
        c = self.cache
        max_size = getattr(c, "max_size", None)
        if isinstance(max_size, int) and hasattr(c, "offset"):  # a window wraps, or it does not
            return c.offset + ahead > max_size
        return not c.is_trimmable()

    def rewind(self, t: int) -> bool:
        c = self.cache
        off = getattr(c, "offset", None)
        if off is None or t > off:
            return False
        if t < off:
            if not c.is_trimmable():
                return False
            c.trim(off - t)
        return True

    def rollback_point(self) -> Any:
        """``state`` carries everything in mlx-lm 0.32, scalars included (no ``meta_state``)."""
        return tree_map(_fresh, self.cache.state)

    def return_to(self, point: Any, at: int) -> bool:
        self.cache.state = tree_map(_fresh, point)
        return True


def rollback_of(cache: Any) -> Any:
    """The rollback rules of one layer cache: itself when it is ours, else its adapter."""
    return cache if isinstance(cache, Rollback) else ForeignRollback(cache)


def layers_of(caches: Sequence[Any]) -> List[Any]:
    """A model's cache list flattened to its layers (mlx-lm's ``CacheList`` expanded),
    as the model holds them (nothing adapted)."""
    out: List[Any] = []
    for c in caches:
        if isinstance(c, mlc.CacheList):
            out.extend(layers_of(c.caches))
        else:
            out.append(c)
    return out
