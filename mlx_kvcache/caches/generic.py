"""`GenericCache`: the conservative treatment of a cache class this package does not know.

A model may bring its own cache class (deepseek_v41's ``LayerCache``, the next class
mlx-lm adds). Rather than refusing it, the trie treats it like a recurrent layer: a
whole-state snapshot at exact node ends, restored only there (the planner's "points"
reach). The model keeps its own object in the cache list — model code may call
class-specific methods on it — and the trie works on an adapter around it (one per
object, `adapt`).

The state is read through the class's ``state`` (and ``meta_state``) where it has a
setter, else as a compact copy of its instance attributes that hold arrays, numbers,
strings or None (and containers of those). The offset is the object's ``offset`` when it
has an integer one, else the count of tokens fed (`settle`). A class is warned about once.
"""

from __future__ import annotations

import logging
import numbers
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from . import tree
from .checks import check_offset, check_snapshot, check_target
from .reach import WholeState
from .rollback import Rollback
from .snapshot import CacheError, Snapshot, compact

log = logging.getLogger("mlx_kvcache")

#: Model-defined classes known to be served correctly by the generic path (no warning).
VETTED = {"mlx_lm.models.deepseek_v41.LayerCache"}
_warned: set = set()
_adapters: "weakref.WeakValueDictionary[int, GenericCache]" = weakref.WeakValueDictionary()


def class_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class GenericSnapshot(Snapshot):
    """The whole state of a generic layer at ``to_offset``: its arrays and the tree
    structure (integers) around them."""

    kind = "generic"
    needs_base = False

    def __init__(self, from_offset, to_offset, arrays, structure: Dict[str, int]):
        super().__init__(from_offset, to_offset, arrays)
        self.structure = dict(structure)

    def meta(self):
        return {**super().meta(), **self.structure}

    def tree(self, wrap) -> Any:
        if self.closed:
            self._get("")  # raises the "closed" error
        return tree.unflatten(self._arrays, self.structure, wrap)

    @classmethod
    def _from_arrays(cls, arrays, meta):
        try:
            a, b = int(meta["from_offset"]), int(meta["to_offset"])
        except KeyError as e:
            raise CacheError(f"generic snapshot is missing {e}") from None
        structure = {k: int(v) for k, v in meta.items() if k not in ("from_offset", "to_offset")}
        return cls(a, b, dict(arrays), structure)


def _state_setter(cls: type) -> bool:
    """Whether the class defines a settable ``state`` of its own (mlx-lm's base class has
    a default that holds nothing, which must not be mistaken for one)."""
    for k in cls.__mro__:
        if "state" in vars(k):
            if k.__name__ == "_BaseCache" and k.__module__.startswith("mlx_lm"):
                return False
            prop = vars(k)["state"]
            return isinstance(prop, property) and prop.fset is not None
    return False


def _int_offset(obj: Any) -> bool:
    o = getattr(obj, "offset", None)
    if isinstance(o, mx.array):
        return o.ndim == 0 and mx.issubdtype(o.dtype, mx.integer)
    return isinstance(o, numbers.Integral) and not isinstance(o, bool)


def _attr_names(obj: Any) -> List[str]:
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    for k in type(obj).__mro__:
        for n in getattr(k, "__slots__", ()):
            if n not in names and n not in ("__dict__", "__weakref__") and hasattr(obj, n):
                names.append(n)
    return names


class GenericCache(WholeState, Rollback):
    """The trie's view of a cache object of a class it does not know (see the module
    docstring). ``obj`` is the object the model uses; it is read and written, never replaced."""

    delta_snapshots = False

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.cls = class_name(obj)
        self.mode = "state" if _state_setter(type(obj)) else "attrs"
        self.tracked = not _int_offset(obj)
        self._fed = 0
        self._ids: Optional[Tuple[int, ...]] = None
        try:  # the empty state `free` returns to (raw arrays, not a Snapshot: nothing to close)
            self._blank = tree.flatten(self._tree(), compact) if self.offset == 0 else None
        except CacheError as e:
            raise CacheError(f"cannot snapshot a {self.cls} layer cache: {e}") from None
        self._mark()
        if self.cls not in _warned:
            _warned.add(self.cls)
            if self.cls in VETTED:
                log.info("mlx_kvcache: %s layers are snapshotted whole at trie node ends", self.cls)
            else:
                warnings.warn(
                    f"mlx_kvcache: {self.cls} is a cache class this package does not know; its "
                    f"layers are snapshotted whole (through its "
                    f"{'state' if self.mode == 'state' else 'array attributes'}) at exact trie "
                    f"node ends and restored only there", RuntimeWarning, stacklevel=3)

    # -- the object's state -------------------------------------------------------------
    def _tree(self) -> Any:
        o = self.obj
        if self.mode == "state":
            t = {"state": o.state}
            if hasattr(type(o), "meta_state") and isinstance(getattr(type(o), "meta_state"), property) \
                    and getattr(type(o), "meta_state").fset is not None:
                t["meta_state"] = o.meta_state
            return t
        out = {}
        for n in _attr_names(o):
            v = getattr(o, n)
            if tree.encodable(v):  # arrays, numbers, None...; anything else is left alone
                out[n] = v
        return out

    def _install(self, t: Any) -> None:
        o = self.obj
        if self.mode == "state":
            o.state = t["state"]
            if "meta_state" in t:
                o.meta_state = t["meta_state"]
        else:
            for n, v in t.items():
                setattr(o, n, v)

    def _capture(self, from_offset: int) -> GenericSnapshot:
        arrays, structure = tree.flatten(self._tree(), compact)
        mx.eval(list(arrays.values()))
        return GenericSnapshot(from_offset, self.offset, arrays, structure)

    def _mark(self) -> None:
        if self.tracked:
            self._ids = tuple(id(a) for a in tree.arrays_of(self._tree()))

    @property
    def dirty(self) -> bool:
        """A forward pass wrote the object since it was last counted (`settle`): its state
        is past ``offset`` (only detectable, and only needed, when the offset is counted)."""
        return self.tracked and tuple(id(a) for a in tree.arrays_of(self._tree())) != self._ids

    @property
    def offset(self) -> int:
        return self._fed if self.tracked else int(self.obj.offset)

    def settle(self, n: int) -> None:
        """After a forward pass of ``n`` tokens: count them where the object has no offset."""
        if self.tracked:
            self._fed += int(n)
            self._mark()

    def set_offset(self, n: int) -> None:
        """The caller's count of tokens an object without an offset holds (server inserts)."""
        if self.tracked:
            self._fed = int(n)
            self._mark()

    @staticmethod
    def rule_for(cls: str) -> str:
        """Why a restore of a layer of class ``cls`` (a class name, dotted or not)
        landed short, in words (`prefix.explain`)."""
        return f"{cls.rsplit('.', 1)[-1]} layers (a cache class restored whole) restore only at checkpoints"

    @property
    def restore_rule(self) -> str:
        return self.rule_for(self.cls)

    # -- rollback after a rejected draft (`rollback`): only whole, from a snapshot
    def rewinds_live(self) -> bool:
        return False

    def needs_checkpoint(self, ahead: int) -> bool:
        return True

    def signature(self, quantization: Any = None) -> List[Any]:
        """Kind and settings (`factory.layer_signature`): the class and how its state is read."""
        return ["generic", self.cls, self.mode]

    def to_mlx(self) -> Any:
        """The model's own object (it goes to mlx-lm as it is)."""
        return self.obj

    def adopt_length(self, length: int, quant: Any = None) -> bool:
        """Adapted from an object mlx-lm's server handed back: count ``length`` where it
        has no offset of its own; whether it holds exactly ``length`` tokens."""
        self.set_offset(length)
        return self.offset == length

    # -- snapshot face ------------------------------------------------------------------
    def snapshot(self, from_offset: int = 0) -> Optional[GenericSnapshot]:
        """The whole state at ``offset`` (``from_offset`` is recorded, not used)."""
        from_offset = check_offset("from_offset", from_offset, self.offset)
        if from_offset == self.offset:
            return None
        return self._capture(from_offset)

    def snapshot_nbytes(self, from_offset: int = 0) -> int:
        if from_offset >= self.offset:
            return 0
        return sum(a.nbytes for a in tree.arrays_of(self._tree()))

    def restore(self, snapshot: Optional[GenericSnapshot], target: int) -> bool:
        """Only ``target == offset`` (live) or ``target == snapshot.to_offset`` succeed."""
        target = check_target(target)
        if target is None:
            return False
        if snapshot is None:
            return target == self.offset and not self.dirty
        check_snapshot(snapshot, GenericSnapshot, f"{self.cls} restore")
        if target != snapshot.to_offset:
            return False
        # Fresh wrappers: an in-place write by the model rebinds only the object's arrays.
        self._install(snapshot.tree(mx.array))
        self._fed = target
        if not self.tracked and int(self.obj.offset) != target:
            try:  # a state without the offset in it
                self.obj.offset = target
            except AttributeError:
                pass
            if int(self.obj.offset) != target:
                raise CacheError(f"{self.cls}: restoring its state left offset "
                                 f"{self.obj.offset}, not {target}")
        self._mark()
        return True

    def merge_snapshots(self, parent, child):
        """The child's state supersedes the parent's; the parent is closed."""
        for s in (parent, child):
            if s is not None:
                check_snapshot(s, GenericSnapshot, f"{self.cls} merge")
        if parent is not None and parent is not child:
            parent.close()
        return child

    #: The seed interface's name (this adapter is the trie's, never batched by mlx-lm).
    merge = merge_snapshots

    def split(self, snapshot, at: int):
        """A whole state cannot be cut: ``(None, snapshot)``."""
        check_snapshot(snapshot, GenericSnapshot, f"{self.cls} split")
        check_offset("at", at)
        return None, snapshot

    def free(self) -> None:
        """Back to the empty state the object was created with."""
        if self._blank is None:
            raise CacheError(f"cannot empty a {self.cls} that was not created empty")
        self._install(tree.unflatten(*self._blank, mx.array))
        self._fed = 0
        self._mark()

    def arrays(self) -> List[mx.array]:
        """The arrays the object holds now (to evaluate)."""
        return list(tree.arrays_of(self._tree()))

    @property
    def nbytes(self) -> int:
        try:
            return int(self.obj.nbytes)
        except Exception:  # no (working) nbytes: count the arrays it holds
            return sum(a.nbytes for a in self.arrays())

    def __repr__(self) -> str:
        return f"GenericCache({self.cls}, {self.mode}, offset={self.offset})"


def adapt(obj: Any) -> GenericCache:
    """The one adapter of ``obj`` (made, and the class warned about, on first use)."""
    a = _adapters.get(id(obj))
    if a is None or a.obj is not obj:
        a = GenericCache(obj)
        _adapters[id(obj)] = a
    return a


def adapter_of(obj: Any) -> Optional[GenericCache]:
    """The adapter of ``obj`` if it has one."""
    a = _adapters.get(id(obj))
    return a if a is not None and a.obj is obj else None
