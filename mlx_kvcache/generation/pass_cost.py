"""What verifying drafts costs on this machine, measured as the model decodes.

A plain decode step is one forward pass of one token, pipelined (the next pass is queued
before the current token is read). A round that verifies ``k`` drafted tokens feeds
``k + 1`` tokens in one pass and must read its result before the next pass can be built.
Relative to a plain step it costs ``alpha + c * k``: ``alpha`` (>= 1) the round's fixed
price (the pipeline waits once; the bookkeeping), ``c`` each verified token's share of a
pass. Where decoding is bound by reading the weights (Apple Silicon, a big model) ``c``
is a few hundredths; where it is bound by arithmetic (MLX's CPU build, a
mixture-of-experts model whose tokens each read other experts) it can be a large part of
a step. Neither can be told from the model alone, so `PassCost` measures both from the
time between consecutive rounds of real requests (one instance per model, shared by its
requests), with cautious priors until it has.

Only how many tokens a round drafts depends on it (`draft_length.LookupLength`), never
which tokens are emitted.
"""

from __future__ import annotations

import threading

__all__ = ["PassCost"]


class PassCost:
    """The cost of a round relative to a plain step: ``1`` for ``k == 0``, else
    ``alpha + c * k`` (see the module doc). `observe` may be called from any thread.

    Args:
        alpha, c: the priors (cautious: a verified token is assumed to cost a quarter of
            a step until measured), each worth ``weight`` rounds.
        memory: each observation's weight decays by this factor per observation.
    """

    #: Bounds on the estimates. A round that must be read before the next pass is built
    #: costs a plain step and some (the device waits while Python reads and rolls back).
    ALPHA, C = (1.05, 3.0), (0.0, 2.0)

    def __init__(self, *, alpha: float = 1.15, c: float = 0.25, weight: float = 3.0,
                 memory: float = 0.98) -> None:
        self._lock = threading.Lock()
        self._memory = float(memory)
        self.plain_seconds = 0.0  # the plain step's time (0: not measured yet)
        self._plain_n = 0
        # Decayed least squares of r = seconds / plain_seconds on (1, k), priors as points.
        w = float(weight)
        pts = [(1, alpha + c), (8, alpha + 8 * c)]
        self._sw = self._sk = self._skk = self._sr = self._skr = 0.0
        for k, r in pts:
            self._add(k, r, w / len(pts))
        self._alpha, self._c = float(alpha), float(c)

    def _add(self, k: float, r: float, w: float) -> None:
        self._sw += w
        self._sk += w * k
        self._skk += w * k * k
        self._sr += w * r
        self._skr += w * k * r

    @property
    def alpha(self) -> float:
        """A round's fixed price relative to a plain step."""
        with self._lock:
            return self._alpha

    @property
    def c(self) -> float:
        """Each verified token's share of a plain step."""
        with self._lock:
            return self._c

    def relative(self, k: int) -> float:
        """Cost of a round verifying ``k`` drafts relative to a plain step."""
        if k <= 0:
            return 1.0
        with self._lock:
            return self._alpha + self._c * k

    def observe(self, k: int, seconds: float) -> None:
        """A round that verified ``k`` drafts (0: a plain step) took ``seconds`` (from the
        end of the round before). A pause of the caller is not a cost: a time far above
        the estimate is dropped."""
        if not seconds > 0:
            return
        with self._lock:
            t0 = self.plain_seconds
            if k <= 0:
                if t0 and seconds > 4 * t0 and self._plain_n >= 4:
                    return
                self._plain_n += 1
                a = max(1.0 / self._plain_n, 0.1)  # the mean at first, then ~10 steps' memory
                self.plain_seconds = seconds if not t0 else (1 - a) * t0 + a * seconds
                return
            if not t0:
                return  # (a ratio needs the plain step's time)
            r = seconds / t0
            if r > 4 * (self._alpha + self._c * k):
                return
            m = self._memory
            self._sw, self._sk, self._skk = m * self._sw, m * self._sk, m * self._skk
            self._sr, self._skr = m * self._sr, m * self._skr
            self._add(k, r, 1.0)
            det = self._sw * self._skk - self._sk * self._sk
            if det > 1e-9:
                c = (self._sw * self._skr - self._sk * self._sr) / det
                alpha = (self._sr - c * self._sk) / self._sw
            else:  # one k only so far: keep c, move alpha
                c = self._c
                alpha = self._sr / self._sw - c * self._sk / self._sw
            self._c = min(max(c, self.C[0]), self.C[1])
            self._alpha = min(max(alpha, self.ALPHA[0]), self.ALPHA[1])
