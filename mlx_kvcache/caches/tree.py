"""A cache's state tree as named arrays plus integer metadata (what a `Snapshot` and the
store can hold), and back.

Leaves may be arrays, None, bools, ints, floats and strings; branches lists, tuples and
dicts with string keys — what mlx-lm caches put in ``state`` / ``meta_state``. Arrays are
named by their path (``r/0/2``); everything else is a metadata key ``<path>#<tag>`` whose
int holds the value (a float's IEEE bits, a container's length). Strings are arrays of
their UTF-8 bytes, so no data is needed to rebuild the *structure*: the store can build
a snapshot around placeholder arrays and fill them in later.
"""

from __future__ import annotations

import numbers
import struct
from typing import Any, Dict, Iterator, Tuple

import mlx.core as mx
import numpy as np

from .snapshot import CacheError

ROOT = "r"


def encodable(x: Any) -> bool:
    """Whether `flatten` can hold ``x``."""
    if x is None or isinstance(x, (mx.array, bool, numbers.Integral, float, str)):
        return True
    if isinstance(x, (list, tuple)):
        return all(encodable(y) for y in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and encodable(v) for k, v in x.items())
    return False


def arrays_of(x: Any) -> Iterator[mx.array]:
    """Every array leaf of a tree (nothing is copied)."""
    if isinstance(x, mx.array):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from arrays_of(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from arrays_of(y)


def flatten(tree: Any, copy) -> Tuple[Dict[str, mx.array], Dict[str, int]]:
    """``(arrays, meta)`` describing ``tree``; ``copy(a)`` makes each stored array."""
    arrays: Dict[str, mx.array] = {}
    meta: Dict[str, int] = {}

    def walk(x: Any, p: str) -> None:
        if isinstance(x, mx.array):
            arrays[p] = copy(x)
        elif x is None:
            meta[p + "#none"] = 0
        elif isinstance(x, bool):
            meta[p + "#bool"] = int(x)
        elif isinstance(x, numbers.Integral):
            meta[p + "#int"] = int(x)
        elif isinstance(x, float):
            meta[p + "#float"] = struct.unpack("<q", struct.pack("<d", x))[0]
        elif isinstance(x, str):
            data = x.encode("utf-8")
            meta[p + "#str"] = len(data)
            if data:
                arrays[p + "#str"] = mx.array(np.frombuffer(data, dtype=np.uint8))
        elif isinstance(x, (list, tuple)):
            meta[p + ("#list" if isinstance(x, list) else "#tuple")] = len(x)
            for i, y in enumerate(x):
                walk(y, f"{p}/{i}")
        elif isinstance(x, dict):
            meta[p + "#dict"] = len(x)
            for i, (k, y) in enumerate(x.items()):
                if not isinstance(k, str):
                    raise CacheError(f"cannot snapshot a dict key {k!r} at {p}: keys must be strings")
                meta[f"{p}#key{i}={k}"] = i
                walk(y, f"{p}/{i}")
        else:
            raise CacheError(f"cannot snapshot a {type(x).__name__} at {p} of a cache's state")

    walk(tree, ROOT)
    return arrays, meta


def unflatten(arrays: Dict[str, mx.array], meta: Dict[str, int], wrap) -> Any:
    """The tree `flatten` described; ``wrap(a)`` makes each array handed out."""
    tags: Dict[str, Tuple[str, int]] = {}
    keys: Dict[str, Dict[int, str]] = {}
    for name, v in meta.items():
        if "#" not in name:
            continue
        p, tag = name.split("#", 1)
        if tag.startswith("key"):
            i, k = tag[3:].split("=", 1)
            keys.setdefault(p, {})[int(i)] = k
        else:
            tags[p] = (tag, int(v))

    def build(p: str) -> Any:
        if p in arrays:
            return wrap(arrays[p])
        if p not in tags:
            raise CacheError(f"snapshot state has nothing at {p}")
        tag, v = tags[p]
        if tag == "none":
            return None
        if tag == "bool":
            return bool(v)
        if tag == "int":
            return v
        if tag == "float":
            return struct.unpack("<d", struct.pack("<q", v))[0]
        if tag == "str":
            return bytes(np.array(arrays[p + "#str"])).decode("utf-8") if v else ""
        items = [build(f"{p}/{i}") for i in range(v)]
        if tag == "list":
            return items
        if tag == "tuple":
            return tuple(items)
        if tag == "dict":
            names = keys.get(p, {})
            return {names[i]: items[i] for i in range(v)}
        raise CacheError(f"snapshot state has an unknown entry {p}#{tag}")

    return build(ROOT)
