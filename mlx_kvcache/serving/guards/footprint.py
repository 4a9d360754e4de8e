"""What a request costs the memory guard, measured on the model at start (`measure`).

A request's need is measured, not guessed: one forward pass of the model gives the bytes
of its caches per token and of its prefill activations per prompt token, and for a model
with an image processor two image encodings give what encoding an image of n tokens
takes, which grows with n² (`Footprint`). A request needs the caches of its reserved
tokens (as long as the longest running one: a batch pads its rows to one length) plus the
activations of one prefill step and its images' encoding. The guard's rules that use
these figures are in `memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

__all__ = ["CACHE_STEP", "Footprint", "ImageProbe", "cache_tokens", "measure",
           "measure_encoding"]

#: mlx-lm's batch caches grow in steps of this many tokens.
CACHE_STEP = 256


def cache_tokens(tokens: int) -> int:
    """The tokens a batch cache holding ``tokens`` is allocated for: rounded up to
    mlx-lm's growth step (`CACHE_STEP`)."""
    return -(-int(tokens) // CACHE_STEP) * CACHE_STEP


@dataclass(frozen=True)
class Footprint:
    """What one request costs, measured on the model at start (`measure`).

    ``weights``: bytes of the parameters; ``kv_fixed`` + ``kv_per_token`` × tokens: its
    caches; ``act_per_token``: prefill activations per prompt token of one step (logits
    included); ``step``: the prefill step (``--prefill-step-size``); ``image_linear`` × n +
    ``image_square`` × n²: what the model's image encoder takes to encode one image of n
    tokens (0 without one; a vision tower's attention makes it grow with n², measured at
    two sizes: `measure`)."""

    weights: int
    kv_fixed: int
    kv_per_token: float
    act_per_token: float
    step: int
    image_linear: float = 0.0
    image_square: float = 0.0

    def encoding(self, images: Sequence[int]) -> int:
        """Bytes encoding images of ``images`` tokens each takes (all of them: mlx-lm
        encodes a request's images in one graph)."""
        return int(sum(self.image_linear * n + self.image_square * n * n for n in images))

    def need(self, prompt_tokens: int, max_tokens: int, longest: int = 0) -> int:
        """Bytes a request of ``prompt_tokens`` answering up to ``max_tokens`` needs, in a
        batch whose longest row holds ``longest`` tokens."""
        tokens = max(int(prompt_tokens) + max(int(max_tokens), 0), int(longest))
        tokens = cache_tokens(tokens)
        # Twice the caches: the live ones, and the copies its inserts make into the prompt
        # cache (and a batch makes when it merges rows) before the live ones go.
        return int(2 * (self.kv_fixed + self.kv_per_token * tokens)
                   + self.act_per_token * min(int(prompt_tokens), self.step))


#: The image sizes (in tokens, about) whose encoding `measure` times: small enough to cost
#: little at start, four times apart to tell a linear growth from a quadratic one.
_IMAGE_PROBES = (64, 256)

#: What `measure` is given to make an image: for about ``n`` tokens, the prompt ids of one
#: image, its pixel values as the model's processor makes them, and its tokens (None:
#: the processor cannot make one).
ImageProbe = Callable[[int], Optional[Tuple[List[int], Any, int]]]


def measure_encoding(model: Any, probe: ImageProbe) -> Tuple[float, float]:
    """``(linear, square)`` bytes of encoding one image of n tokens with ``model``'s
    ``embed_inputs`` (mlx-lm's image seam): the line b/n = linear + square × n through two
    measured sizes, neither below 0 (1 size where the processor gives every image the same
    tokens: linear only)."""
    points: List[Tuple[int, int]] = []
    for target in _IMAGE_PROBES:
        made = probe(target)
        if made is None:
            break
        ids, pixels, n = made
        if n <= 0 or (points and n <= points[-1][0]):
            break
        mx.eval(pixels)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = model.embed_inputs(mx.array(ids), pixel_values=pixels)
        mx.eval(out)
        points.append((n, max(mx.get_peak_memory() - base, 0)))
        del out
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return points[0][1] / points[0][0], 0.0
    (n1, b1), (n2, b2) = points
    square = max((b2 / n2 - b1 / n1) / (n2 - n1), 0.0)
    return max(b1 / n1 - square * n1, 0.0), square


def measure(models: List[Any], make_caches: Callable[[Any], List[Any]], step: int,
            image: Optional[ImageProbe] = None) -> Footprint:
    """The `Footprint` of ``models`` (a target and maybe its draft, used together), from a
    few forward passes, and — given an ``image`` probe, where the target embeds images —
    two image encodings; run on the models' MLX thread."""
    from ...generation.sizing import checkpoint_bytes, model_bytes

    models = [m for m in models if m is not None]
    step = max(int(step), 1)
    short, long_ = 1, 1 + 1024
    kv1 = sum(checkpoint_bytes(m, lambda m=m: make_caches(m), short) for m in models)
    kvn = sum(checkpoint_bytes(m, lambda m=m: make_caches(m), long_) for m in models)
    per_token = max(kvn - kv1, 0) / (long_ - short)
    fixed = max(kv1 - per_token, 0)
    n = min(step, 256)
    act = 0.0
    for m in models:
        caches = make_caches(m)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = m(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        mx.eval(out)
        act += max(mx.get_peak_memory() - base - per_token * n, 0) / n
        del out, caches
    linear = square = 0.0
    if image is not None and hasattr(models[0], "embed_inputs"):
        linear, square = measure_encoding(models[0], image)
    return Footprint(model_bytes(*models), int(fixed), per_token, act, step, linear, square)

