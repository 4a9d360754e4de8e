"""Agreement between the ranks of a sharded model, over ``mx.distributed``.

mlx-lm's distributed server runs every rank's generation thread through the same
requests in the same order, and calls the prompt cache at the same points; the
collectives here are issued from those calls, so they line up across ranks by
construction. Each is one small reduction (a few integers) or a gather of a few
kilobytes; on the ring backend over loopback one costs tens of microseconds.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ...prefix.agreement import SOLO
from .profile import Profile


class MLXAgreement:
    """`mlx_kvcache.prefix.agreement.Agreement` over an ``mx.distributed`` group."""

    def __init__(self, group: Any, profile: Optional[Profile] = None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        #: Counts every collective, by the phase of the prompt cache that issued it.
        self.profile = profile or Profile()

    def _reduce(self, op, values: Sequence[int]) -> List[int]:
        with self.profile.collective("reduce"):
            x = op(mx.array(np.asarray(list(values), dtype=np.int64)), group=self.group)
            mx.eval(x)
        return [int(v) for v in x.tolist()]

    def all_min(self, values: Sequence[int]) -> List[int]:
        return self._reduce(mx.distributed.all_min, values) if values else []

    def all_max(self, values: Sequence[int]) -> List[int]:
        return self._reduce(mx.distributed.all_max, values) if values else []

    def all_gather(self, data: bytes) -> List[bytes]:
        n = self.all_max([len(data)])[0]
        buf = np.zeros(max(n, 1) + 8, dtype=np.uint8)
        buf[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        buf[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        with self.profile.collective("gather"):
            out = mx.distributed.all_gather(mx.array(buf)[None], group=self.group)
            mx.eval(out)
        rows = np.asarray(out)
        return [bytes(r[8:8 + int(np.frombuffer(r[:8].tobytes(), dtype=np.int64)[0])]) for r in rows]


def agreement(profile: Optional[Profile] = None) -> Any:
    """The agreement for this process: collectives when launched on several ranks."""
    group: Optional[Any] = None
    try:
        group = mx.distributed.init()
    except Exception:  # pragma: no cover - no distributed backend at all
        group = None
    if group is None or group.size() < 2:
        return SOLO
    return MLXAgreement(group, profile)
