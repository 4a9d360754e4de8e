"""Helpers shared by the commands: byte sizes, cache directories, warning format."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from ..prefix.stats import human_bytes

__all__ = ["parse_bytes", "human_bytes", "default_cache_dir", "format_warning", "temperature",
           "probability"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(s: str) -> int:
    """'512M', '2GiB', '1.5g', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {s!r} (try 512M, 2G, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
