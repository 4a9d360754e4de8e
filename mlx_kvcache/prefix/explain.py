"""Why a request reused what it reused: where reuse stopped, the text on both sides of the
first token that differs from the cache, and the rule that cost tokens.

A user whose client rewrites a line at the top of its system prompt every turn (some agent
CLIs put a per-request hash there) sees every turn recompute its whole prompt and, from a
count of reused tokens alone, cannot tell why. `Explainer.explain` says it: "diverged at
212: cached ``…Session a81f…`` vs prompt ``…Session 9bc1…``".

Costs are independent of the trie's size: one walk of the prompt's path (as the restore
itself does), at most `_CHILDREN` children looked at where the path ends, and a small ring
of recent prompts (to tell "never cached" from "evicted"), each compared once,
vectorised. Token text comes from a ``decode`` callable (the trie knows no tokenizer);
without one, token ids are shown.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from ..caches.factory import restore_rule_of

__all__ = ["Explainer", "Reuse", "excerpt"]

#: Tokens shown on each side of the divergence.
CONTEXT = 8
#: Characters kept of each side's text.
CHARS = 48
#: Children of the node where the match ends that are looked at (newest first), to show
#: what the cache holds there: bounded, whatever the number of sessions branching there.
_CHILDREN = 16
#: Recent prompts remembered to recognise a prefix the cache no longer holds.
RING = 8

Decode = Callable[[List[int]], str]


@dataclass
class Reuse:
    """Where one request's reuse stopped and why.

    ``offset``: prompt tokens restored from the cache (where prefill started).
    ``diverged_at``: the first prompt token that differs from everything cached (None when
    the cache holds the whole prompt). ``cached`` / ``prompt``: escaped text around that
    token — the cache's continuation and the prompt's, after the same ``before`` text
    (empty ``cached``: the cached text ends there). ``rule``: what cost the tokens between
    ``offset`` and the end of the prompt. ``kind``: ``hit``, ``held`` (the whole prompt is cached,
    but a layer could not restore that far), ``extends`` (the prompt continues past the end
    of a cached one), ``diverged``, ``evicted`` (the cache held more of it before),
    ``image`` (different images), ``empty``, ``off`` (caching is off). ``where``: the
    client's name for the part of the prompt holding ``diverged_at`` (``"messages[3]"``),
    when the server knows the prompt's layout; else empty. ``excerpts``: False when the
    text was left out (`without_text`).
    """

    kind: str
    offset: int
    prompt_tokens: int
    diverged_at: Optional[int]
    before: str
    cached: str
    prompt: str
    rule: str
    where: str = ""
    excerpts: bool = True

    def as_dict(self) -> dict:
        return asdict(self)

    def without_text(self) -> "Reuse":
        """The same explanation with no prompt or cached text (offsets and rule only):
        what a server shows when excerpts would reach people other than the prompt's
        owner."""
        return replace(self, before="", cached="", prompt="", excerpts=False)

    def line(self) -> str:
        """One line for a log: where reuse stopped and why."""
        if self.kind == "hit":
            return self.rule
        where = f"reuse stopped at {self.offset}"
        if self.diverged_at is not None and self.kind in ("diverged", "evicted", "image"):
            named = f" in {self.where}" if self.where else ""
            if not self.excerpts:
                return f"{where} (diverged at {self.diverged_at}{named}): {self.rule}"
            where += (f" (diverged at {self.diverged_at}{named}: cached \"…{self.before}|{self.cached}…\""
                      f" vs prompt \"…{self.before}|{self.prompt}…\")")
        return f"{where}: {self.rule}"


def _escape(text: str) -> str:
    out = "".join(ch if ch.isprintable() and ch != '"' else repr(ch)[1:-1] if ch != '"' else '\\"'
                  for ch in text)
    return out


def excerpt(ids: Sequence[int], decode: Optional[Decode], left: bool = False) -> str:
    """Escaped text of ``ids`` (negative ids — image placeholders — as ``<image>``; token
    ids in brackets without ``decode``), cut to `CHARS` characters on the far side."""
    ids = [int(t) for t in ids]
    if not ids:
        return ""
    parts = []
    for neg, group in itertools.groupby(ids, key=lambda t: t < 0):
        run = list(group)
        if neg:
            parts.append("<image>")
            continue
        try:
            if decode is None:
                raise TypeError
            parts.append(_escape(decode(run)))
        except Exception:  # no tokenizer, or one that cannot decode these ids: show them
            parts.append("[" + " ".join(map(str, run)) + "]")
    text = "".join(parts)
    if len(text) > CHARS:
        text = text[-CHARS:] if left else text[:CHARS]
    return text


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


#: The planner's reason names the layer that fell short: "layer 3 (…)".
_LAYER = re.compile(r"layer (\d+) \(([^)]*)\)")


class Explainer:
    """Explains each request's reuse against one trie (see the module docstring).

    Args:
        decode: token ids to text (a tokenizer's ``decode``), or None for ids.
        ring: how many recent prompts to remember (to recognise an evicted prefix).
    """

    def __init__(self, decode: Optional[Decode] = None, ring: int = RING) -> None:
        self.decode = decode
        # (tokens, evicted bytes and clears when it was seen)
        self._recent: Deque[Tuple[np.ndarray, int, int]] = deque(maxlen=ring)

    def explain(self, trie: Any, tokens: Sequence[int], matched: int, restored: int,
                reason: Optional[str] = None, leaves: Sequence[Any] = (),
                evicted: int = 0, clears: int = 0, decode: Optional[Decode] = None) -> Reuse:
        """The explanation for a request of ``tokens`` that matched ``matched`` tokens and
        restored ``restored`` (``reason``: the planner's, when it landed short); call where
        the trie may be read (its lock held). ``evicted`` / ``clears``: the cache's counters
        now (bytes evicted, clears), to tell an evicted prefix from one never stored.
        ``decode`` overrides the explainer's own for this request."""
        toks = np.asarray(tokens, dtype=np.int64)
        dec = decode if decode is not None else self.decode
        return self._explain(trie, toks, matched, restored, reason, leaves, evicted, clears, dec)

    def remember(self, tokens: Sequence[int], evicted: int = 0, clears: int = 0) -> None:
        """``tokens`` were just stored (the counters as in `explain`): a later prompt that
        shares more of them than the trie then holds finds them gone, and says why."""
        self._recent.append((np.array(tokens, dtype=np.int64), evicted, clears))

    def _explain(self, trie, toks, matched, restored, reason, leaves, evicted, clears,
                 dec) -> Reuse:
        n = len(toks)
        path, m = trie.find(toks)
        before = excerpt(toks[max(0, m - CONTEXT):m], dec, left=True)
        mine = excerpt(toks[m:m + CONTEXT], dec)
        lost = max(0, min(matched, n - 1) - restored)
        short = self._short(reason, leaves, lost, "the divergence") if lost else ""
        if m >= n - 1:
            if restored >= n - 1:
                return Reuse("hit", restored, n, None, before, "", mine,
                             f"full hit: {restored} of {n} prompt tokens cached (the last one "
                             f"is always computed, for its logits)")
            return Reuse("held", restored, n, None, before, "", mine,
                         "the cache holds the whole prompt; "
                         + self._short(reason, leaves, lost, "its end"))
        cached_next = self._cached_after(trie, path, m)
        # A longer prefix of a recent prompt than the trie holds: the trie lost it.
        best, when = 0, None
        for old, ev, cl in self._recent:
            c = _common(old, toks)
            if c > best:
                best, when = c, (old, ev, cl)
        if best > m and when is not None:
            old, ev, cl = when
            kind = "evicted"
            gone = ("the cache was cleared since" if clears > cl else
                    "the byte budget evicted them" if evicted > ev else
                    "they were dropped (a damaged file?)")
            rule = (f"a prompt stored before shared {best} tokens with this one; the cache "
                    f"now holds {m} of them: {gone}")
            return Reuse(kind, restored, n, m, before,
                         excerpt(old[m:m + CONTEXT], dec), mine,
                         rule + (f"; {short}" if short else ""))
        if m == 0 and cached_next is None:
            return Reuse("empty", restored, n, None, "", "", mine,
                         "nothing cached starts like this prompt (an empty cache, or a "
                         "new first token)")
        if cached_next is None:  # the cached text ends where this prompt goes on
            rule = f"new tokens: the cache holds this prompt's first {m} tokens, nothing after"
            if lost:
                rule += "; " + self._short(reason, leaves, lost, "them")
            return Reuse("extends", restored, n, None, before, "", mine, rule)
        theirs = excerpt(cached_next, dec)
        image = (m < n and toks[m] < 0) or (len(cached_next) and int(cached_next[0]) < 0)
        if image:
            rule = (f"other images: the prompt's content at {m} is not the cached one's "
                    f"(images never match across different images)")
        else:
            rule = f"the prompt differs from every cached prompt at token {m}"
        if short:
            rule += f"; {short}"
        return Reuse("image" if image else "diverged", restored, n, m, before, theirs, mine, rule)

    @staticmethod
    def _cached_after(trie, path, m: int) -> Optional[np.ndarray]:
        """Up to `CONTEXT` cached tokens after offset ``m`` on the match's path: the rest of
        the edge the match ended in, or the edge of the most recently used of the newest
        children (None: the cached text ends at ``m``)."""
        node = path[-1] if path else trie.root
        if path and node.end > m:
            edge = np.asarray(node.tokens, dtype=np.int64)
            k = m - node.start
            return edge[k:k + CONTEXT]
        kids = list(itertools.islice(reversed(node.children.values()), _CHILDREN))
        if not kids:
            return None
        child = max(kids, key=lambda c: c.last_used)
        return np.asarray(child.tokens, dtype=np.int64)[:CONTEXT]

    @staticmethod
    def _short(reason: Optional[str], leaves: Sequence[Any], lost: int, where: str) -> str:
        """The rule for a restore that landed ``lost`` tokens short of the match."""
        rule = None
        found = _LAYER.search(reason or "")
        if found and int(found.group(1)) < len(leaves):
            rule = restore_rule_of(leaves[int(found.group(1))])  # its kind's words (caches/)
        rule = rule or reason or "a layer had no state at the match"
        return f"{rule}: landed {lost} token{'s' if lost != 1 else ''} before {where}"
