"""`NullManager`: the manager of a model whose caches are not reused ("caching off").

`generation.core.CacheCore` always holds a manager. When this model's caches cannot be
snapshotted (or a check after construction turned caching off), it holds this one: the
same public verbs as `PrefixManager`, over a trie that never holds a node. It stores
nothing, finds nothing and reports zeros, so the callers need no ``manager is None``
branch; what only the off path says (the reason, in logs and ``GET /v1/cache``) reads
`why` (the same text as `CacheCore.why_not`).

`checkout` lends no live set (None): the caller runs the request on caches of its own
(mlx-lm's, which the trie could not hold) and prefills the whole prompt.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from .agreement import SOLO, Agreement
from .manager import PrefixManager
from .planner import Plan
from .tokens import as_tokens
from .trie import PrefixTrie, TrieNode

__all__ = ["NullManager", "Manager"]


class NullManager:
    """A manager that stores nothing (see the module docstring).

    Args:
        why: why this model's caches are not reused (said in each request's ``reason``).
        max_bytes: the memory budget asked for (reported; nothing is held against it).
        agree: the ranks' agreement (every rank of a sharded model is off alike).
    """

    def __init__(self, why: str, *, max_bytes: int = 0, agree: Agreement = SOLO) -> None:
        self.why = why
        self.max_bytes = int(max_bytes)
        self.agree = agree
        # What `PrefixManager` exposes, as a manager of no layers has them.
        self.kv_quant = None
        self.ops: List[Any] = []
        self.trie = PrefixTrie(self.ops)  # never written: every count stays 0
        self.whole_state = False
        self.keep: "weakref.WeakSet[TrieNode]" = weakref.WeakSet()
        self.verify: Optional[Callable[[Sequence[int]], Any]] = None
        self.evicted_bytes = 0
        self.defer_budget = False
        self.keep_live = False

    # -- critical sections: nothing to guard, the call runs here --------------------------
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def peek(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    # -- requests -------------------------------------------------------------------------
    def plan(self, tokens: Sequence[int]) -> Plan:
        """Nothing matched, nothing restored, no stop: the whole prompt is computed."""
        return Plan(len(as_tokens(tokens)), 0, 0,
                    f"model caches cannot be reused: {self.why}")

    def checkout(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
                 room: Optional[int] = None, guess_end: bool = True) -> Tuple[None, Plan]:
        """No live set (the caller uses caches of its own) and the empty `plan`."""
        return None, self.plan(tokens)

    def preview(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
                guess_end: bool = True) -> Plan:
        return self.plan(tokens)

    def cuts(self, tokens: Sequence[int], extra_stops: Sequence[int] = (),
             guess_end: bool = True) -> List[int]:
        return []

    def checkpoint(self, live: Any, tokens: Sequence[int]) -> bool:
        return False

    def checkin(self, live: Any, tokens: Sequence[int], pending: Sequence[int] = (),
                on_done: Optional[Callable[[bool], None]] = None) -> None:
        """Nothing is recorded: ``on_done(False)``."""
        if on_done is not None:
            on_done(False)

    def record(self, caches: Optional[List[Any]], tokens: Sequence[int],
               label: Optional[str] = None) -> Optional[TrieNode]:
        return None

    def adopt(self, caches: List[Any], tokens: Sequence[int],
              label: Optional[str] = None) -> Optional[TrieNode]:
        return None

    def forget(self, live: Any) -> None:
        pass

    def attach_disk(self, verify: Callable[[Sequence[int]], Any]) -> None:
        raise RuntimeError(f"caching is off for this model: {self.why}")

    # -- the byte budget: nothing held ----------------------------------------------------
    snapshot_bytes = live_bytes = idle_bytes = held_bytes = nbytes = 0

    def fit_bytes(self, target: int) -> None:
        pass

    def fit_count(self, n: int) -> None:
        pass

    def enforce_budget(self) -> None:
        pass

    def over_budget(self, limit: Optional[int] = None) -> bool:
        return False

    def settle(self, limit: Optional[int] = None) -> None:
        pass

    def reset_live(self) -> None:
        pass

    def clear(self) -> None:
        pass


#: What `CacheCore.manager` holds: the real manager, or the null one when caching is off.
Manager = Union[PrefixManager, NullManager]
