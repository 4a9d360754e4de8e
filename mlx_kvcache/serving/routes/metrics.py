"""``GET /metrics``: the server's counters in the format Prometheus scrapes.

The families come from one `cache.counters.Reading` (`TriePromptCache.counters_now`), the
same reading ``GET /v1/cache`` shows under ``counters``; prometheus-client writes them
(its text format 0.0.4, or OpenMetrics when the scraper's ``Accept`` asks for it:
`prometheus_client.exposition.choose_encoder`). Each family's name and the field of the
reading it shows are in `FAMILIES` (and docs/serving.md). No family has a label per cache
namespace (`guards.counters` says why); on a sharded model they are rank 0's.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple, Type

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from ..cache.counters import Reading

__all__ = ["FAMILIES", "PREFIX", "exposition", "families"]

#: Every family's name starts with this.
PREFIX = "mlx_kvcache"

#: ``(name, kind, the Reading field it shows, help)`` of each single-valued family
#: (a counter's samples get Prometheus's ``_total`` suffix).
FAMILIES: Tuple[Tuple[str, str, str, str], ...] = (
    ("requests", "counter", "requests",
     "Requests the model ran (prompt-cache fetches)."),
    ("prompt_tokens", "counter", "prompt_tokens",
     "Prompt tokens of those requests."),
    ("prompt_tokens_computed", "counter", "computed_tokens",
     "Prompt tokens the model computed (not restored from the cache)."),
    ("prompt_tokens_restored", "counter", "restored_tokens",
     "Prompt tokens restored from the prompt cache instead of computed."),
    ("prompt_tokens_from_disk", "counter", "disk_tokens",
     "Restored prompt tokens read back from the disk tier."),
    ("prompt_tokens_ahead", "counter", "ahead_tokens",
     "Tokens computed ahead (foresight) while the client was busy."),
    ("prompt_tokens_ahead_used", "counter", "ahead_used_tokens",
     "Tokens computed ahead that the request they were computed for read."),
    ("cache_evicted_bytes", "counter", "evicted_bytes",
     "Bytes the prompt cache's memory budget evicted."),
    ("cache_clears", "counter", "clears",
     "DELETE /v1/cache calls."),
    ("cache_ram_bytes", "gauge", "ram_bytes",
     "Bytes the prompt cache holds in memory (snapshots and caches lent to running "
     "requests: what --prompt-cache-bytes bounds)."),
    ("cache_disk_bytes", "gauge", "disk_bytes",
     "Bytes the prompt cache holds on disk (what --max-disk-bytes bounds)."),
    ("cache_nodes", "gauge", "nodes",
     "Nodes of the prompt cache's trie."),
)

_KINDS: Dict[str, Type[Metric]] = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def families(reading: Reading) -> List[Metric]:
    """The metric families of ``reading``: `FAMILIES`, refusals by reason
    (``mlx_kvcache_refusals_total{reason=...}``) and the queue-wait histogram
    (``mlx_kvcache_queue_wait_seconds``)."""
    out: List[Metric] = [_KINDS[kind](f"{PREFIX}_{name}", help_, value=getattr(reading, field))
                         for name, kind, field, help_ in FAMILIES]
    refusals = CounterMetricFamily(
        f"{PREFIX}_refusals", "Requests refused before their answer started, by reason.",
        labels=["reason"])
    for reason, n in sorted(reading.refusals.items()):
        refusals.add_metric([reason], n)
    out.append(refusals)
    w = reading.queue_wait
    out.append(HistogramMetricFamily(
        f"{PREFIX}_queue_wait_seconds",
        "Seconds a request waited between being queued and the generation thread taking "
        "it (the memory guard's line included).",
        buckets=[(floatToGoString(b), n) for b, n in zip(w.bounds, w.cumulative)]
        + [("+Inf", w.count)], sum_value=w.seconds))
    return out


class _Families:
    """A prometheus-client collector of fixed families (what an encoder reads)."""

    def __init__(self, made: List[Metric]) -> None:
        self._made = made

    def collect(self) -> Iterator[Metric]:
        return iter(self._made)


def exposition(reading: Reading, accept: Optional[str]) -> Tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics`` for a scraper that sent ``accept``
    (None: none)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(_Families(families(reading))), content_type
