"""``DELETE /v1/cache``: every snapshot dropped, in memory and on disk, durably, on every
rank, before the answer.

Each rank clears its own trie and its own cache directory (`clear_rank`: a capture the
disk writer already took lands first, so nothing written after the clear brings a
snapshot back); on a sharded model the ranks' results are gathered and rank 0 answers
for all of them (`answer`). A directory that cannot be cleared is named in ``error``
(memory is cleared regardless).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List

from ...prefix.agreement import Agreement
from .model_state import ModelState

__all__ = ["answer", "clear_rank", "gather"]

log = logging.getLogger("mlx_kvcache")


def clear_rank(states: List[ModelState], rank: int) -> Dict[str, Any]:
    """Clear this rank's tries and disk tiers (``states``: the loaded model's, and the
    served model's kept while another is loaded; none before a model loads). Returns its
    row: ``rank``, ``memory_cleared``, ``disk_cleared``, ``freed_bytes`` / ``freed_files``
    (what the disk got back), ``directory`` (the first with a disk tier) and ``error`` (a
    directory that could not be cleared)."""
    mine: Dict[str, Any] = {"rank": rank, "memory_cleared": True, "disk_cleared": True,
                            "freed_bytes": 0, "freed_files": 0}
    for st in states:
        st.manager.clear()
        if st.store is None:
            continue
        mine.setdefault("directory", str(st.store.directory()))
        try:
            if st.writer is not None:  # a capture taken before the clear lands first
                st.writer.flush(timeout=None)
            freed = st.store.clear_disk()
            mine["freed_bytes"] += freed["bytes"]
            mine["freed_files"] += freed["files"]
        except OSError as e:
            mine["disk_cleared"] = False
            d = str(st.store.directory())
            mine["error"] = str(e) if d in str(e) else f"could not clear {d}: {e}"
            log.error("mlx_kvcache: DELETE /v1/cache: %s (memory was cleared)", mine["error"])
    return mine


def gather(agree: Agreement, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's `clear_rank` row, in rank order (one gather, on every rank)."""
    return [json.loads(b) for b in agree.all_gather(json.dumps(mine).encode())]


def answer(ranks: List[Dict[str, Any]], sharded: bool) -> Dict[str, Any]:
    """``DELETE /v1/cache``'s answer from every rank's row: ``cleared``,
    ``memory_cleared``, ``disk_cleared``, ``freed_bytes``, ``freed_files``, ``error``
    (each failing rank named, when ``sharded``) and, ``sharded``, the rows under
    ``ranks``."""
    out: Dict[str, Any] = {
        "cleared": all(r["disk_cleared"] for r in ranks),
        "memory_cleared": all(r["memory_cleared"] for r in ranks),
        "disk_cleared": all(r["disk_cleared"] for r in ranks),
        # what the disk got back (the files of this model's cache directory)
        "freed_bytes": sum(r.get("freed_bytes", 0) for r in ranks),
        "freed_files": sum(r.get("freed_files", 0) for r in ranks)}
    errors = [(f"rank {r['rank']}: " if sharded else "") + r["error"]
              for r in ranks if r.get("error")]
    if errors:
        out["error"] = "; ".join(errors)
    if sharded:
        out["ranks"] = ranks
    return out
