"""A scripted agent model: its answer is decided from the token ids of its history.

An mlx-lm architecture (loaded from a model directory's ``model_file``, so servers need
``--trust-remote-code``; `agent_templates.write_scripted_dir` writes one) whose one layer's
KV cache holds the token ids themselves (id + 1 as the key; 0 is a batch's left padding).
Each step reads the whole history back from the cache it was handed — restored from the
trie, extended in place, merged into a batch — and emits the next token of a script:

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

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "ModelArgs":
        return cls(**{k: v for k, v in params.items() if k in ("model_type", "vocab_size",
                                                                 "script")})


class _Layer(nn.Module):
    """Stands where mlx-lm counts layers (one KV cache)."""


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
        self.layers = [_Layer()]
        self.w = mx.zeros((1,))

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, **kwargs) -> mx.array:
        b, n = inputs.shape
        ids = (inputs.astype(mx.float32) + 1)[:, None, :, None]
        if cache is not None and cache[0] is not None:
            keys, _ = cache[0].update_and_fetch(ids, ids)
        else:
            keys = ids
        hist = np.array(keys[:, 0, :, 0].astype(mx.int32))  # (id + 1), 0 = padding
        logits = np.zeros((b, n, self.args.vocab_size), dtype=np.float32)
        for row in range(b):
            h = hist[row]
            h = h[h > 0] - 1
            logits[row, -1, plan(self.args.script, h)] = 30.0
        return mx.array(logits) + self.w[0]

    def sanitize(self, weights):
        return weights
