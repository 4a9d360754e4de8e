"""The server's routes (`serving/routes/`), in process: model names answered with the
served model."""

from __future__ import annotations

import os
import sys
import types

import pytest


def test_model_names_are_read_from_their_spelling_alone(tmp_path, monkeypatch):
    import huggingface_hub

    from mlx_kvcache.serving.routes import model_names as mn

    # No name a client sends is looked up: neither the file system nor the Hub's cache.
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda *a, **k: pytest.fail("a client's name probed the Hub cache"))
    d = tmp_path / "exported"
    d.mkdir()
    args = types.SimpleNamespace(model=str(d), served_model_name="SmolLM2-135M-Instruct")
    mn.served_id(args)  # (the operator's own --model is read once, here)
    real_exists = os.path.exists
    probed = []
    monkeypatch.setattr(os.path, "exists", lambda p: probed.append(p) or real_exists(p))
    for name in ("default_model", "SmolLM2-135M-Instruct", str(d), "claude-sonnet-5", "gpt-4o",
                 "default"):
        assert mn.resolve(args, name) == mn.DEFAULT, name
        assert mn.refusal(args, name) is None, name
    other = tmp_path / "other"
    other.mkdir()
    # A model reference (a path, a repo id) is refused alike whether it exists or not.
    refusals = {n: mn.refusal(args, n) for n in (str(other), str(tmp_path / "nope"),
                                                 "mlx-community/Qwen3-4B-4bit", "~/m", "./m")}
    for name, r in refusals.items():
        assert r is not None and r.field == "model", name
        assert "--allow-model-switch" in r.message and "SmolLM2-135M-Instruct" in r.message
        assert r.message.replace(repr(name), "X") == \
            refusals[str(other)].message.replace(repr(str(other)), "X")
    assert mn.refusal(args, "gpt-4o", draft=str(other)).field == "draft_model"
    assert mn.refusal(args, 7) is None  # not a string: mlx-lm's own 400
    assert probed == []
    # With --allow-model-switch a reference loads as mlx-lm loads it; listed models too.
    switching = types.SimpleNamespace(**vars(args), allow_model_switch=True)
    assert mn.resolve(switching, str(other)) == str(other)
    assert mn.refusal(switching, str(other)) is None
    listed = types.SimpleNamespace(**vars(args), switch_model=["org/listed"])
    assert mn.resolve(listed, "org/listed") == "org/listed" and not mn.refusal(listed, "org/listed")
    assert mn.refusal(listed, "org/other") is not None
    assert [m["id"] for m in mn.models_listing(listed, 1)["data"]] == \
        ["SmolLM2-135M-Instruct", "org/listed"]
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


def test_only_the_operators_models_are_trusted():
    from mlx_kvcache.serving.routes import model_names as mn

    args = types.SimpleNamespace(model="/m", draft_model="/d", switch_model=["/s"],
                                 trust_remote_code=True)
    assert [mn.trusted(args, p) for p in ("/m", "/d", "/s", "/tmp/x", "org/x", None)] == \
        [True, True, True, False, False, False]
    args.trust_remote_code = False
    assert not any(mn.trusted(args, p) for p in ("/m", "/d", "/s"))


def test_model_names_installed_on_the_provider_load():
    from mlx_kvcache.serving.routes import model_names as mn

    calls = []
    prov = types.SimpleNamespace(cli_args=types.SimpleNamespace(model="org/m"),
                                 load=lambda *a: calls.append(a) or ("model", "tok"))
    mn.install(prov)
    assert prov.load("claude-sonnet-5", None, "default_model") == ("model", "tok")
    with pytest.raises(ValueError, match="--allow-model-switch"):
        prov.load("org/other")  # a route that did not refuse it: the load does
    with pytest.raises(ValueError, match="draft model"):
        prov.load("default_model", None, "/tmp/draft")
    prov.cli_args.allow_model_switch = True
    assert prov.load("org/other") == ("model", "tok")
    assert calls == [("default_model", None, "default_model"), ("org/other", None, None)]


def test_the_seam_loads_a_requested_model_without_remote_code(monkeypatch):
    from mlx_lm import server as S

    from mlx_kvcache.serving import seam

    seen = []

    def stock(path, *args, **kwargs):
        seen.append((path, kwargs.get("trust_remote_code"),
                     (kwargs.get("tokenizer_config") or {}).get("trust_remote_code")))
        return "model", "tok"
    monkeypatch.setattr(S, "load", stock)
    monkeypatch.setattr(S, "sharded_load", stock)

    def options(parser):
        for flag in ("--model", "--draft-model", "--switch-model"):
            parser.add_argument(flag)
        parser.add_argument("--trust-remote-code", action="store_true")
    with seam.patched(options, lambda *a: None,
                      ["x", "--model", "/m", "--draft-model", "/d", "--trust-remote-code"]):
        S.argparse.ArgumentParser().parse_args(sys.argv[1:])  # (our Parser: as mlx-lm's main)
        for path in ("/m", "/tmp/evil"):  # the provider's own call: every option by name
            S.load(path, adapter_path=None, tokenizer_config={"trust_remote_code": True},
                   return_config=True, trust_remote_code=True)
        S.load("/d")  # the draft: no options
        S.load("/tmp/evil")
        S.sharded_load("/tmp/evil", tokenizer_config={"trust_remote_code": True},
                       trust_remote_code=True)
    assert seen == [("/m", True, True), ("/tmp/evil", False, False), ("/d", True, True),
                    ("/tmp/evil", False, False), ("/tmp/evil", False, False)]


class _Provider:
    """mlx-lm's ``ModelProvider`` as `draft_use` sees it: ``load`` (re)loads the target and
    the draft only when the key changes."""

    def __init__(self, target, drafts):
        self.model, self.draft_model, self.model_key = None, None, None
        self._target, self._drafts = target, drafts

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        key = (model_path, adapter_path, draft_model_path)
        if key != self.model_key:
            self.model_key, self.model = key, self._target
            self.draft_model = self._drafts.get(draft_model_path)
        return self.model, "tok"


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
