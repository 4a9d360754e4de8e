"""Helpers shared by the commands: byte sizes, cache directories, warning format."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..prefix.stats import human_bytes, parse_bytes

__all__ = ["parse_bytes", "human_bytes", "default_cache_dir", "format_warning", "temperature",
           "probability"]


def default_cache_dir() -> Path:
    """The cache root the commands use by default (see `mlx_kvcache.store.default_root`)."""
    from ..store.format import default_root

    return default_root()



def _number(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def temperature(s: str) -> float:
    """A sampling temperature: a finite number >= 0."""
    v = _number(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {s}")
    return v


def probability(s: str) -> float:
    """A top-p value: a number in (0, 1]."""
    v = _number(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def format_warning(message, category, filename, lineno, line=None) -> str:
    """One clean ``warning: ...`` line, no source excerpt (installed by `main`)."""
    return f"warning: {message}\n"
