"""Cache namespaces (`serving/cache/namespace.py`, `serving/routes/namespace.py`): clients
kept apart in one prompt cache, so ``cached_tokens`` / ``cache_read_input_tokens`` never
tell one client what another sent. Each namespace is named by a request's ``cache_salt``,
its ``X-Cache-Namespace`` header or (``--cache-namespace-by api-key``) its API key, on the
chat route and both agent routes (official SDKs), memory and disk alike; without one,
the cache is shared as before. Real servers on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mlx_kvcache.serving.cache.namespace import BASE, SALTED, Namespaced, salted, unsalted
from mlx_kvcache.serving.routes.namespace import request_namespace
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.servers import Server, answer, same_answer
from mlx_kvcache.testing.waits import CAP

pytestmark = pytest.mark.timeout(CAP)


def pin(tag: str):
    """A prompt only this test sends (the module's server is shared). Tags start with
    characters no other prompt in the shared cache starts with: a prompt nobody sent
    reads there the chat template's start only, a number of tokens the same for all."""
    return [{"role": "user", "content": f"{tag}: my PIN is 4831. Tell me about the sea."}]


def cached(r) -> int:
    return answer(r)[2]


# -- units ---------------------------------------------------------------------------------------
def test_salted_keys_are_apart_exact_and_readable():
    ids = np.arange(100, 140, dtype=np.int64)
    ids.flags.writeable = False
    assert salted(ids, None) is ids  # no namespace: the key as it always was
    a, a2, b = salted(ids, "salt:a"), salted(ids, "salt:a"), salted(ids, "salt:b")
    assert np.array_equal(a, a2) and not a.flags.writeable
    assert (a[:SALTED] >= BASE).all() and np.array_equal(a[SALTED:], ids[SALTED:])
    assert (a[:SALTED] != b[:SALTED]).all()  # apart from the first id on, at every one
    assert unsalted(a) == ids.tolist()  # the text shown is the prompt's
    other = salted(np.asarray([101, *range(101, 139)], dtype=np.int64), "salt:a")
    assert other[0] != a[0]  # one to one within a namespace
    image_first = np.asarray([-5, 1, 2], dtype=np.int64)
    assert salted(image_first, "salt:a") is None  # cannot be keyed apart: not cached
    t = Namespaced([1, 2, 3], "salt:a")
    assert t[:2].namespace == "salt:a" and (t + [4]).namespace == "salt:a"
    assert t.copy().namespace == "salt:a" and list(t[1:]) == [2, 3]


def test_where_a_namespace_comes_from():
    h = {"X-Cache-Namespace": "team"}
    key = {"Authorization": "Bearer sk-1"}
    assert request_namespace({"cache_salt": "s"}, h) == "salt:s"  # the field first
    assert request_namespace({}, h) == "salt:team"  # then the header: one namespace
    assert request_namespace({}, {}) is None and request_namespace({}, key) is None
    by_key = request_namespace({}, key, by_api_key=True)
    assert by_key.startswith("key:") and "sk-1" not in by_key  # hashed
    assert request_namespace({}, {"x-api-key": "sk-1"}, by_api_key=True) == by_key
    assert request_namespace({}, {"Authorization": "Bearer sk-2"}, by_api_key=True) != by_key
    assert request_namespace({"cache_salt": "s"}, key, by_api_key=True) == "salt:s"
    assert request_namespace({}, {"X-Cache-Namespace": ""}) is None  # an empty header: none
    for bad in (5, "", "  ", "x" * 2000):
        with pytest.raises(ValueError, match="cache_salt"):
            request_namespace({"cache_salt": bad}, {})


# -- a server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("namespaces")
    model = write_model_dir(root / "llama", "llama")
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist",
                     "--cache-namespace-by", "api-key") as s:
        yield s


def test_salts_keep_clients_apart_and_reuse_within(server):
    msgs = pin("salts")
    plain = server.chat(msgs)
    alice = server.chat(msgs, cache_salt="alice")
    bob = server.chat(msgs, cache_salt="bob")
    assert (cached(alice), cached(bob)) == (0, 0)  # not one token of another's prefix
    n = alice["usage"]["prompt_tokens"]
    again = server.chat(msgs, cache_salt="alice")
    assert cached(again) == n - 1  # within a namespace: reuse as ever
    assert cached(server.chat(msgs)) == n - 1  # and the shared cache as before
    for r in (bob, plain, again):
        same_answer(alice, r)  # a salted restore is exact
    # What a salted client sent never reaches the shared cache: a prompt only alice sent
    # reads there what a prompt nobody sent does (the chat template's start, at most).
    server.chat(pin("alice only"), cache_salt="alice")
    assert cached(server.chat(pin("alice only"))) == cached(server.chat(pin("1, nobody")))


def test_header_and_api_key_name_namespaces(server):
    def ask(headers=None, tag="headers", **extra):
        body = {"messages": pin(tag), "max_tokens": 4, "temperature": 0.0, **extra}
        status, r = server.request("POST", "/v1/chat/completions", body, headers=headers)
        assert status == 200, (status, r)
        return cached(r)

    assert ask({"X-Cache-Namespace": "team"}) == 0
    n = server.chat(pin("headers"), cache_salt="team")["usage"]["prompt_tokens"]
    assert ask(cache_salt="team") == n - 1  # the header's namespace is the field's
    assert ask({"Authorization": "Bearer sk-one"}) == 0  # a key: its own namespace
    assert ask({"x-api-key": "sk-one"}) == n - 1  # the same key either way
    assert ask({"Authorization": "Bearer sk-two"}) == 0
    assert ask() == ask(tag="2, never sent")  # the shared cache: nobody filled it
    status, r = server.request("POST", "/v1/chat/completions",
                               {"messages": pin("headers"), "cache_salt": 7})
    assert status == 400 and "cache_salt" in r["error"], (status, r)


def test_concurrent_namespaces_in_one_batch_stay_apart(server):
    msgs = pin("batch")
    go = threading.Barrier(2)
    out = {}

    def one(salt):
        go.wait()
        out[salt] = server.chat(msgs, cache_salt=salt)
    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in ("c1", "c2")]
    for t in threads:
        t.start()
    for t in threads:
        server.watch.wait("a client thread").until(lambda t=t: not t.is_alive())
    assert cached(out["c1"]) == cached(out["c2"]) == 0
    n = out["c1"]["usage"]["prompt_tokens"]
    assert cached(server.chat(msgs, cache_salt="c1")) == n - 1
    assert cached(server.chat(msgs, cache_salt="c3")) == 0
    assert cached(server.chat(msgs)) == cached(server.chat(pin("3, never sent")))


def test_agent_routes_keep_namespaces_apart(server):
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    url = f"http://127.0.0.1:{server.port}"
    c = anthropic.Anthropic(base_url=url, api_key="local", max_retries=0)
    body = dict(model="m", max_tokens=4, messages=pin("messages"))

    def read(salt):
        msg = c.messages.create(**body, extra_body={"temperature": 0, "cache_salt": salt})
        return msg.usage.cache_read_input_tokens or 0
    # (the SDK sends its api_key as x-api-key: one namespace for these, salts split it)
    assert read("a") == 0 and read("b") == 0 and read("a") > 0
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**body, extra_body={"cache_salt": ""})
    assert e.value.status_code == 400 and "cache_salt" in str(e.value)
    o = openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0)

    def responses(salt=None, key=None):
        client = o if key is None else openai.OpenAI(base_url=f"{url}/v1", api_key=key,
                                                     max_retries=0)
        extra = {"cache_salt": salt} if salt else {}
        r = client.responses.create(model="m", input="responses: my PIN is 4831.",
                                    max_output_tokens=16, temperature=0, extra_body=extra)
        return r.usage.input_tokens_details.cached_tokens
    assert responses("r1") == 0 and responses("r2") == 0 and responses("r1") > 0
    assert responses(key="other") == 0 and responses() == 0  # keys: one namespace each
    assert responses() > 0


def test_namespaces_stay_apart_after_a_restart(tmp_path):
    model = write_model_dir(tmp_path / "llama", "llama")
    cache = tmp_path / "cache"
    msgs = pin("disk")
    with Server.ours(model, tmp_path / "a.log", tmp_path, "--cache-dir", str(cache)) as s:
        first = s.chat(msgs, cache_salt="alice")
        assert cached(first) == 0
    with Server.ours(model, tmp_path / "b.log", tmp_path, "--cache-dir", str(cache)) as s:
        assert cached(s.chat(msgs, cache_salt="bob")) == 0
        assert cached(s.chat(msgs)) == 0
        again = s.chat(msgs, cache_salt="alice")
        assert cached(again) == first["usage"]["prompt_tokens"] - 1
        assert s.cache()["disk_tokens"] == cached(again)  # read back from the disk tier
        same_answer(first, again)


def test_the_sequential_path_keeps_namespaces_apart(tmp_path):
    # A draft model serves every request on mlx-lm's sequential path, whose caches the
    # next request continues in place (`PrefixManager.adopt`): not across namespaces.
    model = write_model_dir(tmp_path / "llama", "llama")
    msgs = pin("sequential")
    with Server.ours(model, tmp_path / "a.log", tmp_path, "--no-persist", "--draft-model",
                     str(model), "--draft-policy", "fixed") as s:
        alice = s.chat(msgs, cache_salt="alice")
        assert cached(alice) == 0
        assert cached(s.chat(msgs, cache_salt="bob")) == 0
        assert cached(s.chat(msgs)) == 0
        assert cached(s.chat(msgs, cache_salt="alice")) > 0


def test_a_hybrid_models_checkpoints_stay_in_their_namespace(tmp_path):
    # A hybrid restores only at checkpoints, each stored mid-prompt by the batch at a
    # segment's end (`cache_key[:]` of the request's token list): every one in its
    # namespace.
    model = write_model_dir(tmp_path / "hybrid", "qwen3_next")
    msgs = [{"role": "system", "content": "You answer about the sea. " * 4}, *pin("hybrid")]
    with Server.ours(model, tmp_path / "a.log", tmp_path, "--no-persist",
                     "--checkpoint-interval", "16") as s:
        alice = s.chat(msgs, cache_salt="alice")
        assert cached(alice) == 0 and s.cache()["nodes"] > 2  # checkpoints were stored
        assert cached(s.chat(msgs, cache_salt="bob")) == 0
        plain = s.chat(msgs)
        assert cached(plain) == 0  # the shared cache held nothing of theirs
        again = s.chat(msgs, cache_salt="alice")
        assert cached(again) > 0
        same_answer(alice, again)


def test_foresight_computes_a_sessions_next_prompt_into_its_namespace(tmp_path):
    # When an answer ends, the agent routes compute the session's next prompt ahead
    # (`cache.foresight`): that prompt is the whole conversation, so it must land in the
    # session's namespace, readable by its next request and by no one else.
    import copy

    pytest.importorskip("anthropic")
    from mlx_kvcache.testing.agent_sessions import Session
    from mlx_kvcache.testing.agent_templates import write_scripted_dir

    model = write_scripted_dir(tmp_path / "qwen3", "qwen3", steps=2)
    with Server.ours(model, tmp_path / "a.log", tmp_path, "--no-persist",
                     "--trust-remote-code") as s:
        def settled():
            s.watch.wait("foresight to settle").until(
                lambda: s.cache()["foresight"]["settled"], poll=0.02)
        alice = Session(s.port, "anthropic", name="ns", pause=settled,
                        extra={"cache_salt": "alice"})
        alice.turn("Read the notes, please.")
        ahead = s.cache()["foresight"]["computed_tokens"]
        assert ahead > 0  # alice's next prompt, computed while her "user" reads
        for extra in ({"cache_salt": "bob"}, {}):  # the same next request, from others
            other = Session(s.port, "anthropic", name="ns", extra=extra)
            other.history = copy.deepcopy(alice.history)
            other.user("Again.")
            other.ask()
            assert other.steps[-1].cached == 0, (extra, other.steps)
        alice.user("Again.")
        alice.ask()
        st = alice.steps[-1]
        assert st.cached >= st.prompt - st.added - 16, alice.steps  # hers: read ahead
