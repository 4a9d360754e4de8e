"""mlx-lm's `ResponseGenerator`, with checkpoints inside long prompt segments.

The batch path of mlx-lm's server pauses prefill at the end of every prompt *segment*
(system prompt, user context, thinking tail) and inserts the cache there — the only
places a hybrid or sliding-window model can later restore. We split the segments further
at the offsets the prompt cache asks for (`TriePromptCache.checkpoints`: every
``--checkpoint-interval`` tokens and the branch point of this prompt), so a prompt that
diverges inside a long message restores to within one interval of the divergence, and
exactly from the second time. Everything else is mlx-lm's own code.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from mlx_lm.server import ResponseGenerator


def split_segments(segments: List[List[int]], types: List[str],
                   cuts: Sequence[int]) -> Tuple[List[List[int]], List[str]]:
    """Cut ``segments`` (consecutive pieces of one prompt) at the absolute offsets
    ``cuts``; each piece keeps its segment's type. No piece is empty."""
    out, out_types = [], []
    start = 0
    cuts = sorted(set(cuts))
    for seg, kind in zip(segments, types):
        end = start + len(seg)
        pos = start
        for c in cuts:
            if pos < c < end:
                out.append(seg[pos - start: c - start])
                out_types.append(kind)
                pos = c
        if pos < end:
            out.append(seg[pos - start:])
            out_types.append(kind)
        start = end
    return out, out_types


class CheckpointingResponseGenerator(ResponseGenerator):
    """`ResponseGenerator` whose prompt segments also end at the cache's checkpoints."""

    def _tokenize(self, tokenizer, request, args):
        prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
        checkpoints = getattr(self.prompt_cache, "checkpoints", None)
        if vision is None and checkpoints is not None and self.model_provider.model is not None:
            cuts = checkpoints(self.model_provider.model_key, prompt)
            if cuts:
                segments, types = split_segments(segments, types, cuts)
        return prompt, segments, types, state, vision
