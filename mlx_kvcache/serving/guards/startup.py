"""What `mlx-kvcache serve` checks before it answers anyone: the model (and its draft)
loaded, and ``--kv-bits`` / ``--kv-group-size`` can quantize this model's heads.

mlx-lm loads the model in its generation thread and finds such problems only at the first
request: a model or draft that does not load ends that thread (``/health`` then answers
503 for good), a group size that does not divide the heads ends the request's connection
with no answer. Here the load is awaited before the HTTP server starts, and each problem
is one line and a non-zero exit instead.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["StartCheck", "kv_quant_problem"]


class StartCheck:
    """The outcome of the start-up load, set by the generation thread, awaited by the
    main thread (`wait`)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        #: One line naming what is wrong (None: ready to serve).
        self.problem: Optional[str] = None

    def ready(self) -> None:
        self._done.set()

    def fail(self, problem: str) -> None:
        self.problem = problem
        self._done.set()

    def wait(self, keep_waiting, poll: float = 0.1) -> bool:
        """Until the load ended (True) or ``keep_waiting()`` turns false (False)."""
        while not self._done.wait(poll):
            if not keep_waiting():
                return self._done.is_set()
        return True


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def kv_quant_problem(args: Any, *models: Any) -> Optional[str]:
    """Why ``--kv-bits`` / ``--kv-group-size`` cannot quantize these models' full-attention
    layers, or None. One token is run through each model and its caches converted, as the
    server will do once a prompt reaches ``--quantized-kv-start``."""
    import mlx.core as mx

    from ...caches import CacheError, KVQuantization, make_prompt_cache

    bits = getattr(args, "kv_bits", None)
    if bits is None:
        return None
    group = getattr(args, "kv_group_size", 64)
    where = f"--kv-bits {bits} --kv-group-size {group}"
    try:
        schedule = KVQuantization(bits, group, 0)
    except CacheError as e:
        return f"{where}: {e}"
    for model in models:
        if model is None:
            continue
        try:
            caches = make_prompt_cache(model)
            mx.eval(model(mx.array([[0]]), cache=caches))
            schedule.convert(caches)
            mx.eval([c.state for c in caches])
        except Exception as e:  # noqa: BLE001 - whatever mx.quantize refuses, said once
            return f"{where} cannot quantize this model's KV heads: {first_line(e)}"
    return None
