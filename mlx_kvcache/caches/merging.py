"""The two meanings of ``merge`` on a cache class, told apart by their arguments.

* ``merge(caches)`` — mlx-lm's: one argument, a sequence of per-sequence caches, stacked
  into one batch cache (``KVCache.merge`` is ``BatchKVCache.merge`` in mlx-lm). mlx-lm calls
  it on the class and on an instance (``caches[0][i].merge([c[i] for c in caches])``), so
  both work. Our classes implement it as the classmethod ``merge_batch``.
* ``merge(parent, child)`` — the seed interface's snapshot Merge: two snapshots of one
  layer, adjacent ``[a, b)`` + ``[b, c)``, into ``[a, c)``. Only meaningful on an instance
  (the layer that owns them). Our classes implement it as ``merge_snapshots``.

The batch cache ``merge(caches)`` returns lives with its kind (`kv.BatchKVCache`,
`rotating.BatchRotatingKVCache`, `recurrent.BatchRecurrentCache`,
`quantized.BatchQuantizedKVCache`): mlx-lm's ``BatchGenerator`` / ``batch_generate`` stack
per-sequence caches into one (``merge``), ``prepare`` / ``finalize`` / ``filter`` /
``extend`` it and hand each finished sequence's cache back with ``extract(i)``, which
gives back *our* class (a cache that can snapshot) holding exactly what mlx-lm's would.
A kind and its batch form build each other, so they share a module.

The two never overlap (one positional argument or two), so a caller of either API gets
what it asked for; the unambiguous names ``merge_batch`` / ``merge_snapshots`` are there
for code that wants to say which. Anything else — a snapshot merge called on the class,
snapshots passed where caches are expected — is a `TypeError` naming both forms.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .snapshot import Snapshot

_USAGE = ("merge(caches) builds mlx-lm's batch cache from a sequence of caches (also "
          "merge_batch); merge(parent, child) merges two snapshots of this layer (also "
          "merge_snapshots)")


class MergeDispatch:
    """``merge`` on a cache class: `merge_batch` for ``merge(caches)``, `merge_snapshots`
    for ``instance.merge(parent, child)`` (see the module docstring)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Optional[Any], owner: type) -> Callable[..., Any]:
        def merge(*args: Any, **kwargs: Any) -> Any:
            if "caches" in kwargs and not args and len(kwargs) == 1:
                args = (kwargs.pop("caches"),)
            if not kwargs and len(args) == 1:
                caches = args[0]
                if isinstance(caches, Snapshot) or (
                        isinstance(caches, Sequence) and any(isinstance(c, Snapshot) for c in caches)):
                    raise TypeError(f"{owner.__name__}.merge got snapshots where caches are "
                                    f"expected: {_USAGE}")
                return owner.merge_batch(caches)
            if obj is None:
                raise TypeError(f"{owner.__name__}.merge{_shape(args, kwargs)} called on the class: "
                                f"{_USAGE}; a snapshot merge needs the layer's cache instance")
            if set(kwargs) <= {"parent", "child"} and len(args) + len(kwargs) == 2:
                return obj.merge_snapshots(*args, **kwargs)
            raise TypeError(f"{owner.__name__}.merge{_shape(args, kwargs)}: {_USAGE}")

        merge.__doc__ = f"{_USAGE}."
        merge.__qualname__ = f"{owner.__name__}.merge"
        return merge


def as_class(cls: type, obj: Any) -> Any:
    """``obj`` as an instance of ``cls`` (a subclass adding no state): mlx-lm's merge builds
    its own class by name where every cache is empty."""
    if type(obj) is cls:
        return obj
    out = cls.__new__(cls)
    out.__dict__.update(vars(obj))
    return out


def _shape(args: tuple, kwargs: dict) -> str:
    return "(" + ", ".join([type(a).__name__ for a in args] + [f"{k}=..." for k in kwargs]) + ")"
