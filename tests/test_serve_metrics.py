"""``GET /metrics`` of a real server, scraped as Prometheus does
(`prometheus_client.parser`): its counters move with the requests served, they are the
figures ``GET /v1/cache`` shows under ``counters``, and the route answers only whom
``/v1/cache`` answers."""

from __future__ import annotations

import time
from typing import Any, Dict, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_kvcache.serving.routes.metrics import FAMILIES
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP

pytestmark = pytest.mark.timeout(CAP)

TOKEN = "metrics-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def scrape(s: Server) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """Every sample of ``GET /metrics``, by name and labels."""
    status, head, body = s.exchange("GET", "/metrics", headers=AUTH)
    assert status == 200, (status, body)
    assert head["content-type"].startswith("text/plain; version=0.0.4")
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(body.decode()) for x in fam.samples}


def as_samples(counters: Dict[str, Any]) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """``GET /v1/cache``'s ``counters`` as the samples ``GET /metrics`` should hold."""
    out = {(f"mlx_kvcache_{name}{'_total' if kind == 'counter' else ''}", ()): counters[field]
           for name, kind, field, _ in FAMILIES}
    out.update({("mlx_kvcache_refusals_total", (("reason", r),)): n
                for r, n in counters["refusals"].items()})
    wait = counters["queue_wait"]
    out.update({("mlx_kvcache_queue_wait_seconds_bucket", (("le", repr(float(b))),)): n
                for b, n in wait["buckets"]})
    out[("mlx_kvcache_queue_wait_seconds_bucket", (("le", "+Inf"),))] = wait["count"]
    out[("mlx_kvcache_queue_wait_seconds_count", ())] = wait["count"]
    out[("mlx_kvcache_queue_wait_seconds_sum", ())] = wait["seconds"]
    return out


def test_metrics_move_with_requests_and_equal_get_v1_cache(tmp_path):
    d = write_model_dir(tmp_path / "llama", "llama")
    msg = [{"role": "system", "content": "You are terse."},
           {"role": "user", "content": "Name three rivers of the mountains, briefly please."}]
    with Server.ours(d, tmp_path / "s.log", tmp_path, "--no-persist",
                     "--admin-token", TOKEN) as s:
        # The rules of GET /v1/cache: the admin token, and never a web page.
        status, body = s.request("GET", "/metrics")
        assert status == 401 and "/metrics needs" in body["error"], body
        assert s.request("GET", "/metrics", headers={
            **AUTH, "Origin": "http://evil.example"})[0] == 403
        assert s.request("OPTIONS", "/metrics", headers=AUTH)[0] == 403
        before = scrape(s)
        sent = time.time()
        first = s.chat(msg, max_tokens=4)
        again = s.chat(msg, max_tokens=4)  # the same prompt: all but its last token restored
        # Both inserted (a request is listed at its final insert): nothing moves from here on.
        s.watch.wait("both requests listed in GET /v1/cache").until(lambda: len([
            e for e in s.request("GET", "/v1/cache", headers=AUTH)[1]["recent"]
            if e["time"] >= sent - 0.001]) == 2)
        prompt = again["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens"] == prompt > 10
        after = scrape(s)

        def moved(name: str, labels=()) -> float:
            return after[(name, labels)] - before[(name, labels)]
        assert moved("mlx_kvcache_requests_total") == 2
        assert moved("mlx_kvcache_prompt_tokens_total") == 2 * prompt
        assert moved("mlx_kvcache_prompt_tokens_restored_total") == prompt - 1
        assert moved("mlx_kvcache_prompt_tokens_computed_total") == prompt + 1
        assert moved("mlx_kvcache_queue_wait_seconds_count") == 2
        assert after[("mlx_kvcache_cache_ram_bytes", ())] > 0
        assert after[("mlx_kvcache_cache_nodes", ())] > 0
        # No sample is labelled by anything that could name a client.
        assert {k for _, labels in after for k, _ in labels} == {"reason", "le"}
        status, report = s.request("GET", "/v1/cache", headers=AUTH)
        assert status == 200
        assert as_samples(report["counters"]) == after
        assert report["cached_tokens"] == after[("mlx_kvcache_prompt_tokens_restored_total", ())]
