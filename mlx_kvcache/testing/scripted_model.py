"""A scripted agent model: its answer is decided from the token ids of its history.

An mlx-lm architecture (loaded from a model directory's ``model_file``, so servers need
``--trust-remote-code``; `agent_templates.write_scripted_dir` writes one) whose one layer's
KV cache holds the token ids themselves (id + 1 as the key; 0 is a batch's left padding).
Each step reads the whole history back from the cache it was handed — restored from the
trie, extended in place, merged into a batch — and emits the next token of a script, at
every position of a short pass (a proposal's verify pass reads them all; `VERIFIED`):

* the turn so far is what follows the last generation prompt (``open``);
* ``k`` = tool results (``result`` token) after the last user cue (``cue`` token, which
  the client puts in every user message);
* ``k < steps``: reason (``<think>`` step k's thought ``</think>``), then call the tool
  with step k's arguments (a step's call may be several calls at once: each result
  counts, so a step of two calls is followed by step k + 2); else reason, then answer in
  text;
* a script may hold a second one under ``sub`` (its own ``cue``, ``thoughts``,
  ``calls``, ``final_thought``, ``final``): where its cue is the later one — a task a
  parent agent handed a subagent in a prompt of its own — that one is followed;
* a turn the template already opened with an empty reasoning block (thinking off) goes on
  with the part after ``</think>``.

So a cache that holds a wrong token (a bad restore) changes the answer, and a conversation
shaped as an agent loop (several tool steps per user turn) comes out of any template that
renders the cue, the results and the generation prompt. Everything decided is plain token
ids in the config (`Script`).

``hybrid`` (config): a second layer, recurrent — mlx-lm's ``ArraysCache(2)``, as Mamba's
and gated delta nets' layers — whose state is a function of the tokens it absorbed (slot 0:
the last token; slot 1, float32: `checksum` — their count and two running sums modulo
`MOD`, each exact in float32), so the server treats the model as a hybrid (its state
cannot rewind: restores only at checkpoints; batch padding masked as real hybrids mask it,
`ArraysCache.make_mask`). Each step compares the state with the checksum of the history its
KV layer holds: where they differ (a state restored from another offset than the KV
layer's) it answers the config's ``wrong`` token once, then ends
the answer, instead of the script. Token id 0 (the tokenizer's ``<unk>``, never in a
prompt; what mlx-lm pads batches with) counts in neither layer.

A second kind of script (`plan_answers`) spells out each step's whole answer in a family's
own markup (gpt-oss's harmony, Llama 3.x's JSON calls, DeepSeek's call tokens), where
the turn opens and what a tool result looks like: `family_dirs` writes those.
"""

# (no ``from __future__ import annotations``: mlx-lm execs this file outside sys.modules,
# where dataclasses cannot resolve string annotations)

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

#: The longest pass whose every position's next token is computed: a proposal's verify pass
#: (prompt lookup, a draft model: a few tokens) reads them all; a prefill chunk only its last.
VERIFIED = 64


@dataclass
class ModelArgs:
    """The architecture's config (``config.json``)."""

    model_type: str = "scripted_agent"
    vocab_size: int = 128
    #: Token ids: ``open`` (the generation prompt), ``cue``, ``result``, ``think_end``,
    #: ``eos``, ``newlines`` (the separator after ``</think>``), and per step ``thoughts``
    #: and ``calls``, then ``final_thought`` and ``final``; optionally ``sub``, a
    #: subagent's script (its ``cue`` and the same four).
    script: Dict[str, Any] = field(default_factory=dict)
    #: A recurrent layer too (see the module doc); ``wrong`` is then the token answered
    #: where its state and the KV layer's history disagree.
    hybrid: bool = False
    wrong: int = 0

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        return cls(**{k: v for k, v in params.items() if k in ("model_type", "vocab_size",
                                                                 "script", "hybrid", "wrong")})


class _Layer(nn.Module):
    """Stands where mlx-lm counts layers (one per cache)."""


#: The recurrent state's running sums are kept modulo this prime (below 2**16: a sum plus
#: a chunk's tokens stays far below 2**53 in the int64 arithmetic, and the state's values
#: are exact in float32).
MOD = 65521


def checksum(tokens: np.ndarray, start: Optional[np.ndarray] = None) -> np.ndarray:
    """The recurrent state after absorbing ``tokens`` (ids, token 0 skipped) from
    ``start`` (``[count, s1, s2]``; zeros by default): count + 1, s1 += t, s2 += s1 per
    token, the sums modulo `MOD` (s2 depends on the order). float64 ``[count, s1, s2]``."""
    t = np.asarray(tokens, dtype=np.int64)
    t = t[t != 0]
    c0, a0, b0 = (np.zeros(3, dtype=np.int64) if start is None
                  else np.asarray(start, dtype=np.float64).astype(np.int64))
    s1 = (a0 + np.cumsum(t % MOD)) % MOD
    s2 = (b0 + int(np.sum(s1 % MOD))) % MOD if len(t) else b0
    s1_end = int(s1[-1]) if len(t) else a0
    return np.array([c0 + len(t), s1_end, s2], dtype=np.float64)


def _find_last(hay: np.ndarray, needle: List[int]) -> int:
    """The index just past the last occurrence of ``needle`` in ``hay``, or -1."""
    n = len(needle)
    if not n or len(hay) < n:
        return -1
    cand = np.flatnonzero(hay[n - 1:] == needle[-1])[::-1]
    for c in cand:
        if list(hay[c: c + n]) == needle:
            return int(c + n)
    return -1


def _ends(hay: np.ndarray, needle: List[int]) -> List[int]:
    """The indices just past each occurrence of ``needle`` in ``hay``, in order."""
    n = len(needle)
    if not n or len(hay) < n:
        return []
    cand = np.flatnonzero(hay[: len(hay) - n + 1] == needle[0])
    return [int(c + n) for c in cand if list(hay[c: c + n]) == needle]


def plan_answers(script: Dict[str, Any], history: np.ndarray) -> int:
    """The token that follows ``history`` under a script of whole answers (a family's
    markup spelled out, `family_dirs`): ``k`` = tool results (any ``results`` sequence)
    after the last ``cue``; the turn starts just past the first ``opens`` sequence after
    the last of those (where the template hands the turn to the model: a generation
    prompt, or the end of a tool result); the answer is the first of ``answers[k]`` (the
    last entry for every later step) that the turn so far begins, which the template may
    have begun itself (an empty reasoning block)."""
    eos = script["eos"]
    cues = np.flatnonzero(history == script["cue"])
    if not len(cues):
        return eos
    anchor = int(cues[-1]) + 1
    ends = sorted(e for r in script["results"] for e in _ends(history[anchor:], r))
    k = len(ends)
    anchor += ends[-1] if ends else 0
    opens = [e for o in script["opens"] for e in _ends(history[anchor:], o)]
    if not opens:
        return eos
    turn = list(history[anchor + min(opens):])
    for answer in script["answers"][min(k, len(script["answers"]) - 1)]:
        if len(turn) < len(answer) and answer[: len(turn)] == turn:
            return answer[len(turn)]
    return eos


def plan(script: Dict[str, Any], history: np.ndarray) -> int:
    """The token that follows ``history`` (ids) under ``script``."""
    if "answers" in script:
        return plan_answers(script, history)
    eos = script["eos"]
    start = _find_last(history, script["open"])
    if start < 0:
        return eos
    turn = history[start:]
    before = history[:start]
    cues = np.flatnonzero(before == script["cue"])
    part = script
    sub = script.get("sub")
    if sub is not None:
        subs = np.flatnonzero(before == sub["cue"])
        if len(subs) and (not len(cues) or subs[-1] > cues[-1]):
            part, cues = sub, subs
    after = before[cues[-1] + 1:] if len(cues) else before
    k = int(np.sum(after == script["result"]))
    steps = len(part["calls"])
    thought, body = ((part["thoughts"][k], part["calls"][k]) if k < steps
                     else (part["final_thought"], part["final"]))
    full = [*script["think"], *thought, script["think_end"], *script["newlines"], *body, eos]
    g = list(turn)
    if g == full[: len(g)]:
        return full[len(g)] if len(g) < len(full) else eos
    if script["think_end"] in g:  # the template opened the turn (thinking off)
        rest = g[len(g) - g[::-1].index(script["think_end"]):]
        tail = [*script["newlines"], *body, eos]
        while rest and tail and rest[0] != tail[0] and rest[0] in script["newlines"]:
            rest = rest[1:]
        if rest == tail[: len(rest)] and len(rest) < len(tail):
            return tail[len(rest)]
    return eos


class Model(nn.Module):
    """The scripted model (see the module doc)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.layers = [_Layer(), _Layer()] if args.hybrid else [_Layer()]
        self.w = mx.zeros((1,))

    def make_cache(self) -> List[Any]:
        """mlx-lm's caches: the KV layer's, and (hybrid) the recurrent layer's."""
        from mlx_lm.models.cache import ArraysCache, KVCache
        return [KVCache(), ArraysCache(2)] if self.args.hybrid else [KVCache()]

    def _absorb(self, inputs: mx.array, rc: Any) -> Optional[np.ndarray]:
        """The recurrent layer's step: ``inputs`` (less the batch's padding, as its mask
        says) absorbed into ``rc``'s state; the state after it, per row (None: no cache)."""
        if rc is None:
            return None
        toks = np.array(inputs.astype(mx.int32))
        mask = rc.make_mask(toks.shape[1]) if hasattr(rc, "make_mask") else None
        keep = np.ones(toks.shape, dtype=bool) if mask is None else np.array(mask)
        keep = np.broadcast_to(keep, toks.shape)
        prev = None if rc[1] is None else np.array(rc[1])
        last = None if rc[0] is None else np.array(rc[0])
        state = np.zeros((toks.shape[0], 3), dtype=np.float64)
        tail = np.zeros((toks.shape[0], 1), dtype=np.float64)
        for row in range(toks.shape[0]):
            got = toks[row][keep[row]]
            state[row] = checksum(got, None if prev is None else prev[row])
            got = got[got != 0]
            tail[row, 0] = got[-1] if len(got) else (0 if last is None else last[row, 0])
        rc[0] = mx.array(tail.astype(np.float32))
        rc[1] = mx.array(state.astype(np.float32))
        rc.advance(toks.shape[1])
        return state

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, **kwargs) -> mx.array:
        b, n = inputs.shape
        ids = (inputs.astype(mx.float32) + 1)[:, None, :, None]
        if cache is not None and cache[0] is not None:
            keys, _ = cache[0].update_and_fetch(ids, ids)
        else:
            keys = ids
        state = (self._absorb(inputs, cache[1] if cache is not None else None)
                 if self.args.hybrid else None)
        hist = np.array(keys[:, 0, :, 0].astype(mx.int32))  # (id + 1), 0 = padding
        logits = np.zeros((b, n, self.args.vocab_size), dtype=np.float32)
        # Every position's next token where a pass is short enough to be a proposal's
        # verify pass (its positions are read); a longer one is a prefill, of which only
        # the last position is read — the others say WRONG, so a reader shows.
        each = n <= VERIFIED
        if not each:
            logits[:, :-1, self.args.wrong] = 30.0
        for row in range(b):
            full = hist[row]
            if state is not None:
                h = full[full > 0] - 1
                if not np.array_equal(checksum(h), state[row]):
                    # the recurrent state is not the one this history gives: a wrong restore
                    nxt = self.args.script["eos"] if len(h) and h[-1] == self.args.wrong \
                        else self.args.wrong
                    logits[row, :, nxt] = 30.0
                    continue
            for j in (range(n) if each else (n - 1,)):
                upto = full[: len(full) - (n - 1 - j)]
                logits[row, j, plan(self.args.script, upto[upto > 0] - 1)] = 30.0
        return mx.array(logits) + self.w[0]

    def sanitize(self, weights):
        return weights
