"""Input validation shared by the cache classes.

Every check runs before a cache changes anything, so a rejected call leaves the
cache exactly as it was.
"""

from __future__ import annotations

import numbers
from typing import Optional

import mlx.core as mx

from .snapshot import CacheError, Snapshot


def check_kv(keys: mx.array, values: mx.array, like: Optional[mx.array], like_v: Optional[mx.array]) -> None:
    """Validate an ``update(keys, values)`` against the cache's existing buffers."""
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise CacheError(
            f"keys and values must be mx.array, got {type(keys).__name__} and {type(values).__name__}"
        )
    if keys.ndim != 4 or values.ndim != 4:
        raise CacheError(
            f"keys and values must have rank 4 [B, H, L, D], got shapes {tuple(keys.shape)} "
            f"and {tuple(values.shape)}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise CacheError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on [B, H, L]"
        )
    if keys.shape[2] == 0:
        raise CacheError("update with zero tokens (L == 0)")
    if like is None:
        return
    if keys.shape[0] != like.shape[0]:
        raise CacheError(f"batch size {keys.shape[0]} does not match the cache's {like.shape[0]}")
    if keys.shape[1] != like.shape[1]:
        raise CacheError(f"head count {keys.shape[1]} does not match the cache's {like.shape[1]}")
    if keys.shape[3] != like.shape[3] or values.shape[3] != like_v.shape[3]:
        raise CacheError(
            f"head dims (keys {keys.shape[3]}, values {values.shape[3]}) do not match the cache's "
            f"(keys {like.shape[3]}, values {like_v.shape[3]})"
        )
    if keys.dtype != like.dtype or values.dtype != like_v.dtype:
        raise CacheError(
            f"dtype changed mid-sequence: got keys {keys.dtype} / values {values.dtype}, "
            f"the cache holds {like.dtype} / {like_v.dtype}"
        )


def check_offset(name: str, value: int, upper: Optional[int] = None) -> int:
    """An offset must be a non-negative int (and at most ``upper`` when given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CacheError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise CacheError(f"{name} must be >= 0, got {value}")
    if upper is not None and value > upper:
        raise CacheError(f"{name} {value} is beyond the cache offset {upper}")
    return value


def check_target(value: int) -> Optional[int]:
    """A restore target as an int, or None when it is negative (unreachable, so the
    restore returns False as the seed interface says); a non-int raises."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value < 0:
        return None
    return check_offset("target", value)


def check_snapshot(snap: Snapshot, cls: type, owner: str) -> None:
    """A snapshot must be of the cache's own kind and still open."""
    if not isinstance(snap, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise CacheError(f"{owner} cannot use a {type(snap).__name__} (expected {names})")
    if snap.closed:
        raise CacheError(f"{type(snap).__name__} [{snap.from_offset}, {snap.to_offset}) is closed")
