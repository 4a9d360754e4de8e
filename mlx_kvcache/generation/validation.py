"""Checks on a request's arguments, made before anything changes.

A token id outside the model's vocabulary must never reach the model: MLX does not bound
check ``take``, so such an id reads garbage (and ids far outside crash the process), and
the garbage would then be cached and saved. Everything here raises ``TypeError`` or
``ValueError`` naming the problem.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..prefix.tokens import as_tokens



def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_type(t: type) -> bool:
    return issubclass(t, numbers.Integral) and not issubclass(t, bool)


def _first_bad_element(prompt) -> None:
    """Raise the TypeError naming the first element that is not an int (error path only)."""
    for i, t in enumerate(prompt):
        if not is_int(t):
            raise TypeError(f"prompt element {i} is {type(t).__name__} {t!r}; token ids "
                            f"must be ints")


def _out_of_range(i: int, t: int, vocab: Optional[int]) -> ValueError:
    where = f"[0, {vocab})" if vocab is not None else ">= 0"
    return ValueError(f"token id {t} at prompt position {i} is outside the model's "
                      f"vocabulary (vocab size {vocab}; ids must be in {where})")


def check_token_ids(tokens: Any, vocab: Optional[int]) -> np.ndarray:
    """``tokens`` as a read-only int64 array, each id in ``[0, vocab)`` (checked in one
    vectorised pass; the error names the first bad id and its position)."""
    try:
        ids = as_tokens(tokens)
    except OverflowError:  # an int beyond int64: find it (error path only)
        for i, t in enumerate(tokens):
            if not -2**63 <= int(t) < 2**63:
                raise _out_of_range(i, int(t), vocab) from None
        raise
    if not len(ids):
        raise ValueError("the prompt is empty")
    bad = ids < 0
    if vocab is not None:
        bad |= ids >= vocab
    i = int(bad.argmax())
    if bad[i]:
        raise _out_of_range(i, int(ids[i]), vocab)
    return ids


def prompt_token_ids(tokenizer, prompt: Any, vocab: Optional[int]) -> np.ndarray:
    """The prompt as a read-only int64 array of token ids: a string is encoded; token ids
    are checked (type, shape and range), in vectorised passes — no per-token Python."""
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        tokens: Any = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError("the prompt is bytes: decode it to str, or pass token ids")
    elif isinstance(prompt, (mx.array, np.ndarray)):
        if prompt.ndim != 1:
            raise ValueError(f"a prompt array must be 1-D token ids, got shape {tuple(prompt.shape)}")
        integer = mx.issubdtype(prompt.dtype, mx.integer) if isinstance(prompt, mx.array) \
            else prompt.dtype.kind in "iu"
        if not integer:
            raise TypeError(f"a prompt array must hold integer token ids, got dtype {prompt.dtype}")
        if prompt.dtype in (np.uint64, mx.uint64) and len(prompt) and int(prompt.max()) >= 2**63:
            i = int(prompt.argmax())
            raise _out_of_range(i, int(prompt[i]), vocab)
        tokens = prompt
    elif isinstance(prompt, (list, tuple, range)):
        # One pass in C over the element types (bool is an int subclass, refused).
        if not all(_int_type(t) for t in set(map(type, prompt))):
            _first_bad_element(prompt)
        tokens = prompt
    else:
        raise TypeError(f"the prompt must be a str, a list of token ids or a 1-D integer "
                        f"array, got {type(prompt).__name__}")
    return check_token_ids(tokens, vocab)


def check_max_tokens(max_tokens: Any) -> int:
    """A positive int, or -1 for no limit."""
    if not is_int(max_tokens):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__} {max_tokens!r}")
    if max_tokens == 0 or max_tokens < -1:
        raise ValueError(f"max_tokens must be positive (or -1 for no limit), got {max_tokens}")
    return int(max_tokens)


def check_positive(name: str, value: Any) -> int:
    """A positive int (e.g. ``prefill_step_size``)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)
