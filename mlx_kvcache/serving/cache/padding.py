"""Whether mlx-lm's batch path computes exact caches for padded rows, and which rows it
padded.

When the server batches prompts of different lengths, mlx-lm pads the shorter rows (right
padding inside a prefill chunk, left padding when caches of different lengths merge) and
relies on each layer to mask the padding. Attention does; some recurrent layers do not —
Mamba-1's in mlx-lm 0.32.2 runs the pad tokens through its state, so a padded row's
recurrent state is wrong (stock's concurrent answers differ from its one-at-a-time ones).
The server's answers stay what mlx-lm computes, but a wrong state must never be stored.

`padded_rows_exact` finds out once per model with recurrent layers, at load, on a few
tokens: one batch with padding in both directions, each row compared with the same tokens
run alone, per layer kind. Where recurrent layers are not
exact, the server hands out `TrackedArraysCache` (mlx-lm's ``ArraysCache`` that remembers
which batch rows were ever padded) and refuses to store a padded row (`was_padded`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlc

#: Difference allowed between a padded row and the same tokens alone, relative to the
#: state's magnitude: far above the arithmetic noise of a batch of another shape (a few
#: units in the last place; 1e-6 measured on float32 models with OpenBLAS), far below
#: what padding run through a recurrent state does (its convolution state then holds pad
#: tokens instead of the prompt's: order one).
_REL_TOL = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 5e-2}


def _flags(c: Any, n: int) -> List[bool]:
    """The padded flags of ``c``'s ``n`` rows (mlx-lm's own kind, which keeps none: all
    False)."""
    f = list(c.padded) if isinstance(c, TrackedArraysCache) else []
    return (f + [False] * n)[:n]


def _padded(c: Any) -> bool:
    """Whether the batch path ever padded a row of ``c`` (only `TrackedArraysCache` keeps
    count; any other kind: no)."""
    return isinstance(c, TrackedArraysCache) and any(c.padded)


def _indices(ix: Any) -> List[int]:
    return [int(i) for i in (ix.tolist() if hasattr(ix, "tolist") else ix)]


class TrackedArraysCache(mlc.ArraysCache):
    """mlx-lm's ``ArraysCache`` that remembers, per batch row, whether the batch path ever
    padded the row (``padded``). Computes exactly what its parent does."""

    def __init__(self, size, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)
        self.padded: List[bool] = [False] * (len(left_padding) if left_padding else 1)

    @classmethod
    def merge(cls, caches):
        out = super().merge(caches)
        out.padded = [_padded(c) for c in caches]
        return out

    def prepare(self, lengths=None, right_padding=None, left_padding=None, **kwargs):
        super().prepare(lengths=lengths, right_padding=right_padding, left_padding=left_padding,
                        **kwargs)
        n = self.batch_size
        flags = _flags(self, n)
        for pads in (right_padding, left_padding):
            if pads is not None:
                for i, p in enumerate(_indices(pads)[:n]):
                    flags[i] = flags[i] or p > 0
        self.padded = flags

    def filter(self, batch_indices):
        flags = _flags(self, self.batch_size)
        self.padded = [flags[i] for i in _indices(batch_indices)]
        super().filter(batch_indices)

    def extend(self, other):
        mine, theirs = _flags(self, self.batch_size), _flags(other, other.batch_size)
        super().extend(other)
        self.padded = mine + theirs

    def extract(self, idx):
        plain = super().extract(idx)
        out = TrackedArraysCache(len(plain.cache))
        out.cache = plain.cache
        out.padded = [_flags(self, self.batch_size)[idx]]
        return out


def native_leaves(caches: Sequence[Any]) -> Iterator[Any]:
    """mlx-lm layer caches with ``CacheList`` entries expanded."""
    for c in caches:
        if isinstance(c, mlc.CacheList):
            yield from native_leaves(c.caches)
        else:
            yield c


def was_padded(caches: Sequence[Any]) -> bool:
    """True when a `TrackedArraysCache` in ``caches`` (one request's) was ever padded."""
    return any(_padded(c) for c in native_leaves(caches))


# -- the check at model load ------------------------------------------------------------------
def _arrays(c: Any) -> Optional[List[mx.array]]:
    """The arrays that define a single-row cache's content, in a comparable form."""
    if isinstance(c, mlc.ArraysCache):
        return [x for x in c.cache if x is not None]
    if isinstance(c, (mlc.KVCache, mlc.RotatingKVCache)):
        if c.keys is None:
            return []
        n = min(c.offset, c.keys.shape[-2])  # the check stays inside any window
        return [c.keys[..., :n, :], c.values[..., :n, :]]
    return None


def _error(got: Any, ref: Any):
    """(max abs difference, max abs reference, relative tolerance); None: not comparable."""
    a, b = _arrays(got), _arrays(ref)
    if a is None or b is None or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    if not b:
        return 0.0, 0.0, 0.0
    err = max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item() for x, y in zip(a, b))
    scale = max(mx.abs(y.astype(mx.float32)).max().item() for y in b)
    return err, scale, _REL_TOL.get(b[0].dtype, 5e-2)


def _run_batch(model, histories: List[List[int]], chunks: List[List[int]]):
    """Each row's caches after mlx-lm's batch path: its history prefilled alone and merged
    (left padding where lengths differ), then ``chunks`` in one ragged step (right
    padding)."""
    from mlx_lm.generate import PromptProcessingBatch

    caches = []
    for h in histories:
        c = mlc.make_prompt_cache(model)
        if h:
            model(mx.array([h]), cache=c)
            mx.eval([x.state for x in c])
        caches.append(c)
    batch = PromptProcessingBatch(model, list(range(len(chunks))), caches,
                                  tokens=[list(h) for h in histories],
                                  max_tokens=[1] * len(chunks))
    batch.prompt([list(t) for t in chunks])
    return [batch.extract_cache(i) for i in range(len(chunks))]


def _run_alone(model, tokens: List[int]):
    c = mlc.make_prompt_cache(model)
    model(mx.array([tokens]), cache=c)
    mx.eval([x.state for x in c])
    return c


def padded_rows_exact(model, vocab: int) -> Dict[str, bool]:
    """Per layer-cache kind (class name): does mlx-lm's batch path leave padded rows'
    caches equal to the same tokens run alone? Four forward passes of a few tokens, run
    where the model lives; a class whose content we cannot read gets no verdict."""
    t = [(7 * i + 3) % max(vocab, 2) for i in range(12)]
    # Row 0 has a 4-token history (so row 1 is left-padded by 4 in attention) and the
    # shorter chunk (right-padded by 4: more than a convolution state's width).
    rows = _run_batch(model, [t[:4], []], [t[4:6], t[6:12]])
    refs = [_run_alone(model, t[:6]), _run_alone(model, t[6:12])]
    verdict: Dict[str, bool] = {}
    for row, ref in zip(rows, refs):
        for g, r in zip(native_leaves(row), native_leaves(ref)):
            e = _error(g, r)
            if e is None:
                continue  # a class we cannot read: no verdict either way
            kind = type(r).__name__
            verdict[kind] = verdict.get(kind, True) and e[0] <= e[2] * e[1]
    return verdict


def recurrent_kinds(model) -> set:
    """Class names of ``model``'s recurrent (``ArraysCache``) layer caches."""
    return {type(c).__name__ for c in native_leaves(mlc.make_prompt_cache(model))
            if isinstance(c, mlc.ArraysCache)}
