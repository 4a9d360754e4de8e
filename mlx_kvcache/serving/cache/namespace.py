"""Cache namespaces: clients kept apart in one prompt cache (opt-in; vLLM's ``cache_salt``).

A shared prefix cache tells a client how much of its prompt was cached
(``cached_tokens``, ``cache_read_input_tokens``): enough, guessed token by token, to read
another client's prompt back ("My PIN is 4831" in 24 requests). A request with a
namespace only ever reads and writes its namespace's part of the trie, so one
namespace's prefixes never shorten another's prompt; without one, nothing changes.

How, without touching what the model sees: the trie is keyed by the prompt's token ids,
and a namespaced key replaces its first `SALTED` ids with *salted* ids — each the real id
(below `TEXT_IDS`) plus 40 bits of the namespace's digest (a different 40 bits at each
position), at or above `BASE`. No token id reaches `BASE` and mlx-lm's image ids are
negative, so a namespaced key never shares a first id with a plain key, nor (but with
probability 2^-40 per pair of namespaces, and 2^-80 for two ids) with another
namespace's; within a namespace the mapping is one to one, so reuse there is exact. The
salted ids only ever key the trie (and the disk tier, which stores the trie's keys: a
namespace's entries stay apart after a restart, and the namespace itself is never
stored, only its digest's bits). A namespaced prompt that does not start with a text
token (an image first) is not cached at all.

The namespace rides with the request's token list (`Namespaced`): mlx-lm's batch keeps
each request's token list as one object from its admission to its last insert (it
extends it in place), so every insert the batch makes for a request carries it.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Iterable, List, Optional

import numpy as np

__all__ = ["BASE", "SALTED", "Namespaced", "namespace_of", "salted", "scoped_session",
           "unsalted"]

#: Ids a namespace salts: a vocabulary stays below this.
TEXT_IDS = 1 << 22
#: Salted ids are at or above this (no vocabulary reaches it).
BASE = 1 << 40
#: The first this many ids of a namespaced key are salted.
SALTED = 8
_BITS = 40


class Namespaced(list):
    """A request's token ids, tagged with its cache ``namespace``: slices, copies and
    concatenations keep the tag (mlx-lm slices a prompt before every insert)."""

    __slots__ = ("namespace",)

    def __init__(self, tokens: Iterable[int] = (), namespace: str = "") -> None:
        super().__init__(tokens)
        self.namespace = namespace

    def __getitem__(self, i):
        out = super().__getitem__(i)
        return Namespaced(out, self.namespace) if isinstance(i, slice) else out

    def __add__(self, other) -> "Namespaced":
        return Namespaced(list.__add__(self, list(other)), self.namespace)

    def copy(self) -> "Namespaced":
        return Namespaced(self, self.namespace)


def namespace_of(tokens: Any) -> Optional[str]:
    """The namespace ``tokens`` carry (None: none: a plain list, or an empty name)."""
    return (tokens.namespace or None) if isinstance(tokens, Namespaced) else None


def scoped_session(session: Optional[str], namespace: Optional[str],
                   agent: Optional[str] = None) -> Optional[str]:
    """An agent's key as foresight keys it: its session (two namespaces' sessions of one
    name — the same first messages — stay two) and, for a subagent, its id (the main loop's
    key is its session's)."""
    if session is None:
        return None
    key = session if not namespace else f"{namespace}\x00{session}"
    return key if agent is None else f"{key}\x00agent\x00{agent}"


@functools.lru_cache(maxsize=1024)
def _salts(namespace: str) -> np.ndarray:
    digest = int.from_bytes(hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"),
                                            digest_size=_BITS * SALTED // 8).digest(), "big")
    mask = (1 << _BITS) - 1
    out = np.array([BASE + (((digest >> (_BITS * i)) & mask) << 22) for i in range(SALTED)],
                   dtype=np.int64)
    out.flags.writeable = False
    return out


def salted(ids: np.ndarray, namespace: Optional[str]) -> Optional[np.ndarray]:
    """The trie key of ``ids`` (a read-only int64 array) in ``namespace``: ``ids`` itself
    without one; None when a namespaced prompt cannot be keyed apart (its first id is
    not text: it is then not cached)."""
    if not namespace or not len(ids):
        return ids
    n = min(len(ids), SALTED)
    head = ids[:n]
    if not 0 <= head[0] < TEXT_IDS:
        return None
    text = (head >= 0) & (head < TEXT_IDS)
    out = np.array(ids, dtype=np.int64)
    out[:n] = np.where(text, _salts(namespace)[:n] + head, head)
    out.flags.writeable = False
    return out


def unsalted(ids: Iterable[int]) -> List[int]:
    """Token ids of a key, salted or not (for showing its text)."""
    return [int(t) % TEXT_IDS if t >= BASE else int(t) for t in ids]
