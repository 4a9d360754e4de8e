"""The server's routes (`serving/routes/`), in process: model names answered with the
served model."""

from __future__ import annotations

import types


def test_model_names_answer_unknown_names_with_the_served_model(tmp_path, monkeypatch):
    import huggingface_hub

    from mlx_kvcache.serving.routes import model_names as mn

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the Hub reachable
    d = tmp_path / "exported"
    d.mkdir()
    args = types.SimpleNamespace(model=str(d), served_model_name="SmolLM2-135M-Instruct")
    for name in ("default_model", "SmolLM2-135M-Instruct", str(d), "claude-sonnet-5", "gpt-4o",
                 "default", "no/such/path/x"):
        assert mn.resolve(args, name) == mn.DEFAULT, name
    # a local path and a Hugging Face repo id are still loaded as mlx-lm loads them
    other = tmp_path / "other"
    other.mkdir()
    assert mn.resolve(args, str(other)) == str(other)
    assert mn.resolve(args, "mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"
    assert mn.resolve(args, 7) == 7  # not a string: mlx-lm's own 400
    # offline, a repo id is loadable only from the local Hugging Face cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, name: str(tmp_path) if repo == "org/cached" else None)
    assert mn.resolve(args, "org/cached") == "org/cached"
    assert mn.resolve(args, "mlx-community/Qwen3-4B-4bit") == mn.DEFAULT
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    listing = mn.models_listing(args, 123)
    assert [m["id"] for m in listing["data"]] == ["SmolLM2-135M-Instruct"]
    assert mn.model_entry(args, 123, "claude-sonnet-5")["id"] == "claude-sonnet-5"
    assert mn.model_entry(args, 123, "mlx-community/Qwen3-4B-4bit") is None
    # without --served-model-name: the repo id, or the directory's absolute path
    assert mn.served_id(types.SimpleNamespace(model="org/m")) == "org/m"
    assert mn.served_id(types.SimpleNamespace(model=str(d))) == str(d.resolve())
    # no served model: mlx-lm's behaviour, and an empty (valid) listing
    none = types.SimpleNamespace(model=None)
    assert mn.resolve(none, "claude-sonnet-5") == "claude-sonnet-5"
    assert mn.models_listing(none, 1) == {"object": "list", "data": []}


def test_model_names_installed_on_the_provider_load(monkeypatch):
    import huggingface_hub

    from mlx_kvcache.serving.routes import model_names as mn

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    calls = []
    prov = types.SimpleNamespace(cli_args=types.SimpleNamespace(model="org/m"),
                                 load=lambda *a: calls.append(a) or ("model", "tok"))
    mn.install(prov)
    assert prov.load("claude-sonnet-5", None, "default_model") == ("model", "tok")
    assert prov.load("org/other") == ("model", "tok")
    assert calls == [("default_model", None, "default_model"), ("org/other", None, None)]


def test_metrics_show_one_reading_in_prometheus_text_and_openmetrics():
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
    from prometheus_client.parser import text_string_to_metric_families

    from mlx_kvcache.serving.cache.counters import Reading
    from mlx_kvcache.serving.guards.counters import GuardCounters, Refusal
    from mlx_kvcache.serving.routes.metrics import FAMILIES, exposition

    g = GuardCounters(buckets=(0.5, 5.0))
    g.refused(Refusal.STOPPING)
    for s in (0.25, 2.0, 9.0):
        g.waited(s)
    fields = [f for _, _, f, _ in FAMILIES]
    reading = Reading(**{f: 1000 + i for i, f in enumerate(fields)}, refusals=g.by_reason(),
                      queue_wait=g.queue_wait())
    body, content_type = exposition(reading, None)
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    want = {(f"mlx_kvcache_{name}{'_total' if kind == 'counter' else ''}", ()): 1000 + i
            for i, (name, kind, _, _) in enumerate(FAMILIES)}
    want.update({("mlx_kvcache_refusals_total", (("reason", r),)): n
                 for r, n in {"memory": 0, "memory_never_fits": 0, "stopping": 1,
                               "context": 0, "bad_input": 0}.items()})
    want.update({("mlx_kvcache_queue_wait_seconds_bucket", (("le", le),)): n
                 for le, n in (("0.5", 1), ("5.0", 2), ("+Inf", 3))})
    want[("mlx_kvcache_queue_wait_seconds_count", ())] = 3
    want[("mlx_kvcache_queue_wait_seconds_sum", ())] = 11.25
    assert samples == want
    # A scraper that asks for OpenMetrics gets it (ending with its "# EOF").
    body, content_type = exposition(reading, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    names = {fam.name for fam in om_parse(body.decode())}
    assert {"mlx_kvcache_requests", "mlx_kvcache_refusals", "mlx_kvcache_cache_ram_bytes",
            "mlx_kvcache_queue_wait_seconds"} <= names
