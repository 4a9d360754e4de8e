"""What the prompt cache does for requests to come while the generation loop has none:

* foreseen prefixes (`Foresight`): the next prompt of an agent, offered when an answer ends
  (`foresee`, any thread), computed in small chunks while nothing waits (`ahead`);
* retention (`retire`, any thread): a prompt whose conversation will not go on — a
  one-shot's, a finished subagent's — has what it alone holds aged at the next idle moment,
  so it goes first under the budget (`PrefixManager.age_tail`).

The model's state (its trie, its pair, its key) is handed in by the prompt cache, which
owns it; this module knows nothing of mlx-lm's server.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ...prefix.tokens import as_tokens
from .foresight import Foresight
from .model_state import ModelState
from .namespace import namespace_of, scoped_session

__all__ = ["IdleWork"]


class IdleWork:
    """Foresight and retention for one prompt cache.

    Args:
        foresight: the cache's `Foresight`.
        key_of: what the trie keys a prompt by, None where it is not cached (no trie storing
            prompts, or a namespaced prompt that cannot be keyed apart).
        per_token: the bytes a token's caches take (the memory guard's measure), or None.
    """

    def __init__(self, foresight: Foresight, key_of: Callable[[Sequence[int]], Optional[np.ndarray]],
                 per_token: Callable[[], Optional[float]]) -> None:
        self.foresight = foresight
        self._key_of = key_of
        self._per_token = per_token
        self._retiring: List[np.ndarray] = []
        self._lock = threading.Lock()

    def foresee(self, session: str, tokens: Sequence[int], expected: bool = True,
                model_key: Any = None, epoch: Optional[int] = None,
                agent: Optional[str] = None) -> None:
        """The next prompt of ``session``'s ``agent`` (`scoped_session`) starts with
        ``tokens`` (rendered by a route when an answer ended; ``expected``: it ends a
        `Foresight.expect`, whose ``epoch`` it is — a clear since drops it): the part the
        trie lacks is computed while the generation loop is idle (`ahead`) — only on the
        model ``model_key`` (whose tokenizer encoded ``tokens``; None: any). Any thread.
        Dropped where nothing is cached. ``tokens`` may carry a cache namespace: computed
        into it."""
        key = self._key_of(tokens)
        if key is None:
            if expected:
                self.foresight.cancel()
            return
        self.foresight.offer(scoped_session(session, namespace_of(tokens), agent),
                             as_tokens(tokens), expected, model_key, trie_key=key, epoch=epoch)

    def ahead(self, st: ModelState, waiting: Callable[[], bool], step: int,
              stream: Any = None) -> bool:
        """Compute foreseen prefixes on ``st`` (the loaded model) until ``waiting()`` says a
        request came (asked before every chunk). Generation thread. Whether it computed
        anything."""
        before = self.foresight.computed
        self.foresight.run(st.manager, st.pair, step, waiting, stream, st.key,
                           self._per_token())
        return self.foresight.computed != before

    def retire(self, tokens: Sequence[int]) -> None:
        """A prompt whose conversation will not go on (a one-shot's, a finished subagent's
        last): what it alone holds in the trie — past the last point another prompt
        branches off, its answer included — goes first under the budget, at the generation
        loop's next idle moment (`age`). Any thread."""
        key = self._key_of(tokens)
        if key is not None and len(key):
            with self._lock:
                self._retiring.append(key)

    def age(self, st: ModelState) -> None:
        """Age what was retired since the last call (`PrefixManager.age_tail`) on ``st``.
        Generation thread."""
        with self._lock:
            retired, self._retiring = self._retiring, []
        for key in retired:
            st.manager.age_tail(key)
