"""Budgets that follow the model: the memory it leaves, and what one checkpoint of it costs.

The default memory budget is a share of what the model's weights leave of the machine's
memory (`default_ram_budget`), not a fixed share of all of it: on a Mac the cache shares
unified memory with the weights. A budget that cannot hold one checkpoint of the model —
its snapshot at `snapshot_interval` tokens: every recurrent, sliding-window and other
whole state at its full size plus that many tokens of every KV layer — can never store a
restore point of such a prompt, so every such request recomputes it; that gets one clear
warning with the size needed (`budget_problem`) instead of silent 0 % hits.

The disk budget's default is a share of the free disk (`default_disk_budget`), as peers
do: min(cap, free / 4), the cache's own files counted as free (they are its to reuse); a
budget recorded in the cache's directory by an earlier run is followed instead
(`disk_budget_for`), and that is the figure said at start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..caches import leaf_caches, settle
from ..prefix.stats import human_bytes
from ..store.format import disk_usage, model_dir
from ..store.index import recorded_budget

#: The disk budget by default: a quarter of the free disk, at most this much.
DISK_CAP = 32 << 30


def memory_bytes() -> int:
    """The machine's memory (unified memory on Apple silicon)."""
    try:
        if mx.metal.is_available():
            total = int(mx.metal.device_info().get("memory_size", 0))
            if total:
                return total
    except Exception:  # pragma: no cover - device query is best effort
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 << 30


def model_bytes(*models: Any) -> int:
    """Bytes of the models' parameters (quantized weights at their packed size)."""
    return sum(int(a.nbytes) for m in models if m is not None
               for _, a in tree_flatten(m.parameters()))


def default_ram_budget(weights: int, total: Optional[int] = None) -> Tuple[int, str]:
    """``(bytes, why)``: half of what ``weights`` leave of the memory, at most a quarter
    of it (never negative)."""
    total = memory_bytes() if total is None else int(total)
    left = max(total - int(weights), 0)
    budget = int(min(total * 0.25, left * 0.5))
    why = (f"{human_bytes(budget)}: half of the {human_bytes(left)} the model's "
           f"{human_bytes(weights)} leave of {human_bytes(total)}, at most a quarter")
    return budget, why


def checkpoint_bytes(model: Any, make_caches: Callable[[], List[Any]], tokens: int) -> int:
    """Bytes of one snapshot of ``model``'s caches at ``tokens`` tokens, measured from one
    forward pass of one token (runs the model: call on its MLX thread)."""
    caches = make_caches()
    model(mx.array([[0]]), cache=caches)
    settle(caches, 1)
    leaves = leaf_caches(caches)
    total = 0
    for c in leaves:
        one = int(c.snapshot_nbytes(0)) if hasattr(c, "snapshot_nbytes") else 0
        total += one * c.snapshot_rows(tokens)  # (a window, a chunk, deltas, a whole state)
    return total


def budget_problem(max_bytes: int, one: int, tokens: int, live_counted: bool) -> Optional[str]:
    """The warning for a budget below one checkpoint (``one`` bytes at ``tokens``
    tokens), or None. ``live_counted``: the budget also holds the request's own caches
    (about one checkpoint more)."""
    need = one * (2 if live_counted else 1)
    if max_bytes >= need:
        return None
    extra = " plus a request's own caches of the same size" if live_counted else ""
    return (f"the prompt cache budget ({human_bytes(max_bytes)}) cannot hold one checkpoint "
            f"of this model ({human_bytes(one)} at {tokens} tokens{extra}): prompts that "
            f"long will be recomputed every time. Give it at least {human_bytes(need)}.")


def default_disk_budget(root, own: int = 0) -> Tuple[int, str]:
    """``(bytes, why)``: a quarter of the free disk under ``root`` (the cache's own
    ``own`` bytes counted as free), at most `DISK_CAP`."""
    p = Path(root).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    budget = int(min(DISK_CAP, (free + own) // 4))
    why = (f"{human_bytes(budget)}: a quarter of the {human_bytes(free + own)} free at {p}"
           f"{' (this cache included)' if own else ''}, at most {human_bytes(DISK_CAP)}")
    return budget, why


def disk_budget_for(root, fingerprint: str) -> Tuple[int, str]:
    """The budget a store with the default budget will follow for the cache named
    ``fingerprint`` under ``root``, and why: the one recorded in its directory by an
    earlier run when there is one (a default never replaces it), else
    `default_disk_budget` with the files it holds counted as free (they are its to reuse)."""
    d = model_dir(root, fingerprint)
    budget, why = default_disk_budget(root, disk_usage(d) if d.is_dir() else 0)
    recorded = recorded_budget(d) if d.is_dir() else None
    if recorded is None:
        return budget, why
    return recorded, (f"{human_bytes(recorded)}: recorded for this directory by an earlier run "
                      f"(followed; the default would be {why})")
