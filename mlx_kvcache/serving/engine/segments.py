"""A prompt's segments cut at checkpoint offsets: mlx-lm's batch prefills a request segment
by segment (a chunk never crosses a segment's end) and its server stores the caches at each
end but the prompt's, so a cut is where a request's caches are stored — planned before the
request is inserted (`split_segments`: the prompt cache's checkpoints) or asked of it while
it runs (`cut_remaining`: a request that shares its prefix, `flight_batch`).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["split_segments", "cut_remaining"]


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


def cut_remaining(segments: List[List[int]], pos: int, offset: int) -> Tuple[bool, bool]:
    """Cut a running request's remaining ``segments`` (their first token at prompt offset
    ``pos``; changed in place) at the prompt offset ``offset``: ``(whether a segment ends
    there now, whether this call made that end)``. Never inside the last segment (the
    prompt's end)."""
    end = pos
    for j, seg in enumerate(segments):
        end += len(seg)
        if offset == end:
            return j < len(segments) - 1, False
        if offset < end:
            if offset <= end - len(seg) or j == len(segments) - 1:
                return False, False
            k = len(seg) - (end - offset)
            segments[j:j + 1] = [seg[:k], seg[k:]]
            return True, True
    return False, False
