"""The mlx-lm cache protocol our classes implement, checked against the installed mlx-lm.

Our classes follow mlx-lm 0.32's protocol: ``state`` carries the scalars (no
``meta_state``), ``from_state(state)`` takes one argument, ``keys_and_values()`` is the
valid view, and ``merge(caches)`` builds the batch cache with mlx-lm's batch classes. A
version that changed any of that would take our caches and compute something else (a
state read in the wrong order, a batch cache missing a method), so `check` probes the
installed mlx-lm's own classes — as `serving.seam` probes its server — and raises one
`ProtocolError` naming every difference. It runs once, when `mlx_kvcache.caches` is
imported. A version outside the tested range whose protocol is intact only gets a note.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

#: mlx-lm versions this package (its cache protocol and the server seam) was written and
#: tested against.
SUPPORTED = ((0, 32, 0), (0, 33, 0))  # >= first, < second


class ProtocolError(RuntimeError):
    """The installed mlx-lm's cache protocol is not the one our cache classes implement."""


def _version(v: str) -> Tuple[int, int, int]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _differences() -> List[str]:
    from mlx_lm.models import cache as mlc

    out: List[str] = []

    def scalars(name: str, make, expect: tuple, at: int) -> None:
        try:
            got = tuple(make().state)
        except Exception as e:  # a constructor or a state that changed shape
            out.append(f"{name}.state: {type(e).__name__}: {e}")
            return
        if len(got) != at + len(expect) or got[at:] != expect:
            out.append(f"{name}.state is {got!r}, expected {at} arrays then {expect!r}")

    # `state` with the scalars in it, in mlx-lm 0.32's order (probed with distinct values).
    scalars("KVCache", mlc.KVCache, (0,), 2)
    scalars("RotatingKVCache", lambda: mlc.RotatingKVCache(max_size=7, keep=2), (0, 2, 7, 0), 2)
    scalars("QuantizedKVCache", lambda: mlc.QuantizedKVCache(group_size=32, bits=4), (0, 32, 4), 2)
    scalars("ChunkedKVCache", lambda: mlc.ChunkedKVCache(5), (0, 5, 0), 2)
    scalars("ArraysCache", lambda: mlc.ArraysCache(2), (None, None), 1)
    for name in ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ArraysCache", "ChunkedKVCache"):
        cls = getattr(mlc, name)
        if hasattr(cls, "meta_state"):
            out.append(f"{name} has meta_state (scalars outside state)")
        params = list(inspect.signature(cls.from_state).parameters)
        if params != ["state"]:
            out.append(f"{name}.from_state takes {params}, not (state)")
        if name != "ArraysCache" and not callable(getattr(cls, "keys_and_values", None)):
            out.append(f"{name} has no keys_and_values()")
    # The batch constructors and the batch verbs our merged caches rely on.
    for name in ("KVCache", "RotatingKVCache", "ArraysCache"):
        cls = getattr(mlc, name)
        m = inspect.getattr_static(cls, "merge", None)
        if not isinstance(m, classmethod) or list(inspect.signature(cls.merge).parameters) != ["caches"]:
            out.append(f"{name}.merge is not the classmethod merge(caches)")
    for name in ("BatchKVCache", "BatchRotatingKVCache"):
        cls = getattr(mlc, name, None)
        if cls is None:
            out.append(f"mlx_lm.models.cache has no {name}")
            continue
        gone = [v for v in ("merge", "extend", "filter", "extract", "prepare", "finalize",
                            "make_mask", "update_and_fetch") if not callable(getattr(cls, v, None))]
        if gone:
            out.append(f"{name} has no {', '.join(gone)}")
    gone = [v for v in ("extend", "filter", "extract", "prepare", "finalize", "advance")
            if not callable(getattr(mlc.ArraysCache, v, None))]
    if gone:
        out.append(f"ArraysCache has no {', '.join(gone)}")
    return out


def check() -> Optional[str]:
    """Raise `ProtocolError` if the installed mlx-lm's cache protocol differs from the one
    our classes implement; return a note when its version is outside the tested range but
    the protocol is intact (None otherwise)."""
    import mlx_lm

    diffs = _differences()
    if diffs:
        raise ProtocolError(f"mlx_lm {mlx_lm.__version__}: its cache protocol is not the one "
                            f"mlx_kvcache's caches implement (mlx-lm 0.32's): " + "; ".join(diffs))
    return untested_note("its cache protocol")


def untested_note(what: str) -> Optional[str]:
    """A note when the installed mlx-lm is outside `SUPPORTED` though ``what`` (the part of
    it we checked) looks intact; None inside the range."""
    import mlx_lm

    lo, hi = SUPPORTED
    if lo <= _version(mlx_lm.__version__) < hi:
        return None
    return (f"mlx_lm {mlx_lm.__version__} is outside the tested range "
            f"{'.'.join(map(str, lo))} <= v < {'.'.join(map(str, hi))}; {what} "
            f"looks intact, going on")
