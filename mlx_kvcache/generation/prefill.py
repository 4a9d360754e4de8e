"""The one chunked prefill: a prompt fed to a model pair's caches, stopping exactly at the
planned snapshot offsets.

`PrefixCache` (`request`), the server's sequential path (`serving.sequential`) and its
draft-model stream (`serving.stream`) all prefill through `prefill`, and every forward
pass of a request — prefill and plain decoding — goes through a `Feed`: the ``kv_bits``
switch applied first, then `ModelPair.forward` (the draft fed clamped ids, both lists
settled), then the tokens counted as absorbed.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ..caches import cache_arrays
from ..prefix.live import LiveSet
from ..prefix.tokens import TokenBuffer
from .model_pair import ModelPair

__all__ = ["Feed", "prefill", "Runner", "inline", "on_stream"]

#: Runs one unit of model work: inline, on the engine thread (`Engine.run`), or on a stream.
Runner = Callable[..., Any]


def inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def on_stream(stream: Any) -> Runner:
    """A `Runner` that runs each unit of work on ``stream`` (None: the current stream)."""
    if stream is None:
        return inline

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        with mx.stream(stream):
            return fn(*args)
    return run


class Feed:
    """Forward passes of one request over its cache set, and the tokens they absorbed.

    The cache set is a `LiveSet` (its ``kv_bits`` switch applied before every pass: it may
    replace cache objects) or, for a model whose caches the trie cannot hold, mlx-lm's own
    cache list. ``fed`` is extended right after each pass's graph is built (nothing is
    evaluated yet), so an interrupt leaves it at most one pass behind: ``pending`` holds
    that pass's tokens, for the manager to recognise. It is a `TokenBuffer`, so handing it
    over copies nothing, however long the prompt.
    """

    def __init__(self, pair: ModelPair, caches: Union[LiveSet, List[Any]],
                 fed: Sequence[int] = ()) -> None:
        self.pair, self.cache_set = pair, caches
        self.fed, self.pending = TokenBuffer(fed), []
        quant = caches.quant if isinstance(caches, LiveSet) else None
        #: Where the ``kv_bits`` switch happens (None: no schedule).
        self.quant_start: Optional[int] = None if quant is None else quant.start

    @property
    def caches(self) -> List[Any]:
        """The whole cache list (the target's, then the draft's), switch applied."""
        if isinstance(self.cache_set, LiveSet):
            self.cache_set.quantize_due()
            return self.cache_set.caches
        return self.cache_set

    @property
    def leaves(self) -> Optional[List[Any]]:
        """The layer caches of a live set (None for mlx-lm's own cache list)."""
        return self.cache_set.leaves if isinstance(self.cache_set, LiveSet) else None

    def lists(self) -> Tuple[List[Any], List[Any]]:
        """``(target caches, draft caches)``, switch applied (the speculative decoder's)."""
        return self.pair.split(self.caches)

    def __call__(self, toks: Sequence[int]) -> mx.array:
        """Feed ``toks`` to both models; the target's logits (a graph)."""
        caches = self.caches
        self.pending = toks
        logits = self.pair.forward(mx.array(np.asarray(toks, dtype=np.int32))[None], caches)
        self.fed.extend(toks)
        self.pending = []
        return logits

    def evaluate(self) -> None:
        """Evaluate every array the caches hold (after a pass: nothing stays a graph)."""
        leaves = self.leaves
        mx.eval(cache_arrays(leaves) if leaves is not None else [c.state for c in self.cache_set])


def prefill(feed: Feed, tokens: Sequence[int], start: int, end: int, *, step: int,
            stops: Sequence[int] = (), checkpoint: Optional[Callable[[int], Any]] = None,
            progress: Optional[Callable[[int], None]] = None, run: Runner = inline) -> int:
    """Feed ``tokens[start:end]`` (the caches hold ``tokens[:start]``) in chunks of at most
    ``step`` that end exactly at each of ``stops`` and at the ``kv_bits`` switch, calling
    ``checkpoint(offset)`` at each stop and ``progress(offset)`` after every chunk.

    Each chunk — the switch, both models' pass, the caches evaluated — is one call of
    ``run`` (the engine thread, a stream): other work may run between chunks, never inside
    one. The switch is applied once more at the end, so a cache at or past its start hands
    over quantized. Returns the offset the caches hold (``end``)."""
    stops = sorted(s for s in stops if start < s <= end)
    qs = feed.quant_start
    bounds = stops + ([qs] if qs is not None and start < qs < end else [])

    def chunk(a: int, b: int) -> None:
        feed(tokens[a:b])
        feed.evaluate()
        mx.clear_cache()

    pos = start
    while pos < end:
        nxt = min([pos + step, end] + [s for s in bounds if s > pos])
        run(chunk, pos, nxt)
        pos = nxt
        if checkpoint is not None and pos in stops:
            run(checkpoint, pos)
        if progress is not None:
            progress(pos)
    run(lambda: feed.caches)
    return pos
