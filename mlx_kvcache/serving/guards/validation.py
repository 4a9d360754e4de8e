"""Request fields mlx-lm's server only finds wrong inside its generation thread.

mlx-lm's handler checks the types of the sampling options, but a few fields reach the
generation thread unchecked, where an exception outside its per-request ``try`` ends the
thread (``/health`` answers 503 until a restart) or a bad index crashes the process:
``"stop": 123`` or ``[1, 2]``, ``"prompt": ""`` or ``["a", "b"]``, a ``logit_bias`` key
outside the vocabulary, a ``seed`` MLX cannot take. `body_problem` finds them in the HTTP
thread (a 400 naming the field); `generation_problem` checks again in the generation
thread, inside mlx-lm's ``try`` (the request gets an error, the thread lives on), for
requests naming another model and for whatever the first check could not know.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...generation import model_pair

#: ``mx.random.seed`` takes an unsigned 64-bit integer.
SEED_LIMIT = 1 << 64


def _text(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")  # a lone surrogate (valid JSON) breaks every tokenizer
    except UnicodeEncodeError:
        return False
    return True




def _logit_bias_problem(bias: Any, vocab: Optional[int]) -> Optional[str]:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return "logit_bias must be an object mapping token ids to numbers"
    for k, v in bias.items():
        try:
            i = int(k)
        except (TypeError, ValueError):
            return f"logit_bias key {k!r} is not a token id"
        if i < 0 or (vocab is not None and i >= vocab):
            bound = f" (the model has {vocab} token ids)" if vocab is not None else ""
            return f"logit_bias key {k!r} is not a token id of this model{bound}"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"logit_bias value for {k!r} must be a number"
    return None


def body_problem(route: str, body: Dict[str, Any], vocab: Optional[int] = None) -> Optional[str]:
    """The first problem in a completion request's JSON ``body`` for ``route``
    (``"chat"`` or ``"text"``) that mlx-lm would only meet in its generation thread, or
    None. ``vocab`` (the loaded model's, when the request is for it) bounds logit_bias."""
    stop = body.get("stop")
    if stop is not None and not _text(stop):
        if not isinstance(stop, list) or not all(_text(s) for s in stop):
            return "stop must be a string or a list of strings"
    if route == "text":
        prompt = body.get("prompt")
        if not _text(prompt):
            return "prompt must be a string"
        if not prompt:
            return "prompt must not be empty"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list"
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < SEED_LIMIT:
        return f"seed must be between 0 and {SEED_LIMIT - 1}"
    problem = _logit_bias_problem(body.get("logit_bias"), vocab)
    if problem:
        return problem
    for name in ("chat_template_kwargs", "role_mapping", "stream_options"):
        v = body.get(name)
        if v is not None and not isinstance(v, dict):
            return f"{name} must be an object"
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        return "tools must be a list of objects"
    usage = (body.get("stream_options") or {}).get("include_usage", False)
    if not isinstance(usage, bool):
        return "stream_options.include_usage must be true or false"
    return None


def generation_problem(prompt, args, model) -> Optional[str]:
    """What makes a tokenized request unservable by ``model``, checked in the generation
    thread: an empty prompt, a logit_bias key outside the vocabulary, a seed MLX cannot
    take."""
    if len(prompt) == 0:
        return "the prompt is empty once tokenized"
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        return f"seed must be between 0 and {SEED_LIMIT - 1}"
    logits = getattr(args, "logits", None)
    return _logit_bias_problem(getattr(logits, "logit_bias", None),
                               model_pair.vocab_size(model))
