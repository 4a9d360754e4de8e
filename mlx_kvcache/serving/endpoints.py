"""What ``GET /v1/cache`` and ``DELETE /v1/cache`` do to a `TriePromptCache` (a mixin):
counters read in O(1), every rank's gathered when asked, and a clear that is durable on
every rank before it answers."""

from __future__ import annotations

import json
import logging
import struct
from typing import Any, Dict, Tuple

__all__ = ["CacheEndpoints"]

log = logging.getLogger("mlx_kvcache")
_STATS = struct.Struct("<qqqqqqq")  # bytes held, nodes, disk bytes, evicted, requests, cached, from disk
_STAT_NAMES = ("bytes_held", "nodes", "disk_bytes", "evicted_bytes", "requests",
               "cached_tokens", "disk_tokens")


class CacheEndpoints:
    """Expects `TriePromptCache`'s ``_model``, ``agree``, ``profile``, ``_guard``, ``memory``, its
    counters and ``_ranks``."""

    def _local(self) -> Tuple[int, ...]:
        st = self._model
        if st is None or st.manager is None:
            return (0, 0, 0, 0, self.requests, self.cached_tokens, self.disk_tokens)
        mgr = st.manager
        # Counters only: O(1) in the trie's size, the lock held for three reads.
        held, nodes, evicted = mgr.peek(lambda: (mgr.trie.nbytes, mgr.trie.node_count,
                                                 mgr.evicted_bytes))
        disk = st.store.disk_bytes if st.store is not None else 0
        return (held, nodes, disk, evicted, self.requests, self.cached_tokens, self.disk_tokens)

    def share_stats(self) -> None:
        """Gather every rank's counters for rank 0's ``GET /v1/cache`` (one small gather;
        on every rank's generation thread, at the same point)."""
        self._guard("gathering the ranks' counters", self._share_stats, None)

    def _share_stats(self) -> None:
        """Every rank's counters, for rank 0's ``GET /v1/cache`` (one small gather)."""
        if self.agree.size > 1:
            with self.profile.phase("stats"):
                self._ranks = [_STATS.unpack(b)
                               for b in self.agree.all_gather(_STATS.pack(*self._local()))]

    def report(self) -> Dict[str, Any]:
        """What ``GET /v1/cache`` returns (on a sharded model: this rank's view, and every
        rank's counters as of the last `share_stats` under ``ranks``)."""
        held, nodes, disk, evicted, _, _, _ = self._local()
        st = self._model
        out: Dict[str, Any] = {
            "bytes_held": held, "max_bytes": self.max_bytes, "disk_bytes": disk,
            "max_disk_bytes": st.store.max_disk_bytes if st and st.store else None, "nodes": nodes,
            "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "ram_tokens": self.cached_tokens - self.disk_tokens,
            "disk_tokens": self.disk_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evicted_bytes": evicted, "checkpoint_interval": self.checkpoint_interval,
            "cache_dir": str(st.store.directory()) if st and st.store else None,
            "cold_bits": self.cold_bits, "enabled": bool(st and st.manager),
            # the layers each node holds (with a draft model: the target's, then the draft's)
            "layers": len(st.manager.ops) if st and st.manager else 0,
            "kv_bits": st.manager.kv_quant.signature()[1:] if st and st.manager
            and st.manager.kv_quant else None,
            "recent": self._log.listing(), "prompt_excerpts": self.excerpts,
            "profile": self.profile.snapshot(),
        }
        if st is not None and st.store is not None:
            mgr, tier = st.manager, st.store.tier
            out["disk_nodes"] = mgr.trie.parked_count
            out["demoted_bytes"], out["promoted_bytes"] = tier.demoted_bytes, tier.promoted_bytes
        if st is not None and st.manager is None:
            out["disabled_because"] = st.why_not
        if self.memory is not None:  # the server's memory guard
            out["memory"] = self.memory.report()
        if self.agree.size > 1:
            out["rank"], out["world_size"] = self.agree.rank, self.agree.size
            out["ranks"] = [dict(zip(_STAT_NAMES, r), rank=i) for i, r in enumerate(self._ranks)]
        return out

    def clear(self) -> Dict[str, Any]:
        """Drop every snapshot, in memory and on disk, durably, before returning
        (``DELETE /v1/cache``). Runs where the model lives (the generation thread); on a
        sharded model every rank calls it at the same point and the results are gathered.
        Returns ``cleared``, ``memory_cleared``, ``disk_cleared``, ``freed_bytes`` and
        ``freed_files`` (what the disk got back) and, when a directory could not be
        cleared, ``error`` naming it (per rank under ``ranks``)."""
        return self._guard("clearing the prompt cache", self._clear_here,
                           {"cleared": False, "memory_cleared": False, "disk_cleared": False,
                            "error": "clearing the prompt cache failed (see the log)"}, "clear")

    def _clear_here(self) -> Dict[str, Any]:
        st = self._model
        mine: Dict[str, Any] = {"rank": self.agree.rank, "memory_cleared": True,
                                "disk_cleared": True, "freed_bytes": 0, "freed_files": 0}
        if st is not None and st.manager is not None:
            st.manager.clear()
            self.clears += 1
            if st.store is not None:
                mine["directory"] = str(st.store.directory())
                try:
                    if st.writer is not None:  # a capture taken before the clear lands first
                        st.writer.flush(timeout=None)
                    freed = st.store.clear_disk()
                    mine["freed_bytes"], mine["freed_files"] = freed["bytes"], freed["files"]
                except OSError as e:
                    mine["disk_cleared"] = False
                    d = str(st.store.directory())
                    mine["error"] = str(e) if d in str(e) else f"could not clear {d}: {e}"
                    log.error("mlx_kvcache: DELETE /v1/cache: %s (memory was cleared)", mine["error"])
        ranks = [mine]
        if self.agree.size > 1:
            ranks = [json.loads(b) for b in self.agree.all_gather(json.dumps(mine).encode())]
            self._share_stats()
        out: Dict[str, Any] = {
            "cleared": all(r["disk_cleared"] for r in ranks),
            "memory_cleared": all(r["memory_cleared"] for r in ranks),
            "disk_cleared": all(r["disk_cleared"] for r in ranks),
            # what the disk got back (the files of this model's cache directory)
            "freed_bytes": sum(r.get("freed_bytes", 0) for r in ranks),
            "freed_files": sum(r.get("freed_files", 0) for r in ranks)}
        errors = [(f"rank {r['rank']}: " if self.agree.size > 1 else "") + r["error"]
                  for r in ranks if r.get("error")]
        if errors:
            out["error"] = "; ".join(errors)
        if self.agree.size > 1:
            out["ranks"] = ranks
        return out
