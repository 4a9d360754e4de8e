"""Foresight: when an agent answer ends, the session's next prompt — the conversation with
this answer as the client sends it back, then a tool result or a new user message, as the
chat template renders them — is computed while the client is busy, so the next request
reads everything but what it adds from the cache.

In process: a foreseen prefix computed, interrupted and resumed on a `PrefixManager`
restores exactly (logits equal a cold run's, plain and hybrid models), its nodes go first
under the budget, and its counters say what was read. Against real servers, with the
official SDKs and the scripted agent model (`testing.scripted_model`: it answers from
the token ids its cache holds, so a wrong cache changes its answers) under Qwen3's and
GLM-4.5's own templates: tool loops and new user turns, both APIs, thinking on and off,
streamed and not; the same answers with foresight off; a request that arrives while the
server computes ahead takes the generation thread at the next chunk; and the opt-in
``keep_reasoning`` renders earlier reasoning as generated.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvcache.caches import make_prompt_cache
from mlx_kvcache.generation.model_pair import ModelPair
from mlx_kvcache.prefix.manager import PrefixManager
from mlx_kvcache.serving.cache.foresight import Foresight
from mlx_kvcache.testing.agent_sessions import Session
from mlx_kvcache.testing.agent_templates import CUE, QWEN3_TEMPLATE, write_scripted_dir
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP
from models import V, build

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(CAP)

#: Markup a turn adds around its new text (closing tags, the generation prompt, with
#: thinking off its empty reasoning block): what the "new tokens" bound allows beyond it.
MARKUP = 40


# -- in process: the job itself --------------------------------------------------------------
def _cold_logits(model, tokens):
    return model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_foreseen_prefix_restores_exactly_after_an_interruption(kind):
    m = build(kind)
    mgr = PrefixManager(lambda: make_prompt_cache(m), max_bytes=1 << 30, snapshot_interval=64)
    toks = [random.Random(3).randrange(1, V) for _ in range(300)]
    caches = make_prompt_cache(m)
    m(mx.array(toks[:100])[None], cache=caches)
    mgr.record(caches, toks[:100])  # what the last request left
    fs = Foresight()
    fs.offer("s", toks[:260], expected=False)
    answers = iter([False, False, True])  # the loop's check, then one before each chunk
    fs.run(mgr, ModelPair(m), 32, lambda: next(answers, True))
    r = fs.report()
    assert r["interrupted"] == 1 and r["computed_tokens"] == 64 and r["queued"] == 1
    # What was done is a node of its own: every layer restores there exactly.
    assert mgr.preview(toks[:200]).restored == 164
    fs.run(mgr, ModelPair(m), 32, lambda: False)
    r = fs.report()
    assert r["finished"] == 1 and r["computed_tokens"] == 160 and r["settled"]
    live, plan = mgr.checkout(toks)
    assert plan.restored == 260
    got = m(mx.array(toks[260:])[None], cache=live.caches)[0, -1]
    assert float(mx.max(mx.abs(got - _cold_logits(m, toks)))) < 1e-4
    mgr.checkin(live, toks)
    # The next request read all of it (`read` runs at each fetch).
    assert fs.read("s", np.asarray(toks), 260) == 160
    r = fs.report()
    assert r["used_tokens"] == 160 and r["wasted_tokens"] == 0 and r["unread_tokens"] == 0


def test_foreseen_nodes_are_evicted_first_and_unread_tokens_count_as_wasted():
    m = build("llama")
    mgr = PrefixManager(lambda: make_prompt_cache(m), max_bytes=1 << 30)
    rng = random.Random(4)
    old = [rng.randrange(1, V) for _ in range(120)]
    other = [rng.randrange(1, V) for _ in range(120)]
    for seq in (old, other):
        caches = make_prompt_cache(m)
        m(mx.array(seq)[None], cache=caches)
        mgr.record(caches, seq)
    fs = Foresight()
    fs.offer("a", old + [5] * 80, expected=False)
    fs.run(mgr, ModelPair(m), 2048, lambda: False)
    path, matched = mgr.trie.find(np.asarray(old + [5] * 80))
    assert matched == 200 and path[-1].last_used == 0 and path[-1].start == 120
    # Under the budget, the foreseen tokens go before the older real prompts.
    mgr.fit_bytes(mgr.trie.nbytes - 1)
    assert mgr.trie.find(np.asarray(old))[1] == 120 and mgr.trie.find(np.asarray(other))[1] == 120
    assert mgr.trie.find(np.asarray(old + [5] * 80))[1] == 120
    # The session's next request read none of them: wasted.
    assert fs.read("a", np.asarray(old + [6] * 80), 120) == 0
    r = fs.report()
    assert r["computed_tokens"] == 80 and r["wasted_tokens"] == 80 and r["used_tokens"] == 0


def test_a_newer_offer_replaces_the_pending_one_and_its_request_drops_it():
    fs = Foresight()
    fs.expect()
    fs.offer("s", [1, 2, 3])
    fs.offer("s", [1, 2, 3, 4], expected=False)
    r = fs.report()
    assert r["queued"] == 1 and r["replaced"] == 1 and r["rendering"] == 0
    fs.request_for("s")
    assert fs.report()["queued"] == 0 and fs.report()["settled"]
    off = Foresight(enabled=False)
    off.offer("s", [1, 2])
    assert not off.pending()


def test_a_job_foreseen_for_another_model_is_dropped():
    # Rendered with model A's tokenizer; a request named model B since, so B runs now:
    # A's ids never reach B's trie.
    m = build("llama")
    mgr = PrefixManager(lambda: make_prompt_cache(m), max_bytes=1 << 30)
    fs = Foresight()
    fs.offer("s", list(range(1, 60)), expected=False, key=("a", None, None))
    fs.run(mgr, ModelPair(m), 2048, lambda: False, key=("b", None, None))
    r = fs.report()
    assert r["computed_tokens"] == 0 and r["replaced"] == 1 and r["settled"]
    assert mgr.trie.find(np.arange(1, 60))[1] == 0
    fs.offer("s", list(range(1, 60)), expected=False, key=("b", None, None))
    fs.run(mgr, ModelPair(m), 2048, lambda: False, key=("b", None, None))
    assert fs.report()["computed_tokens"] == 59


# -- servers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("foresight")
    return root, {f: write_scripted_dir(root / f, f, steps=2) for f in ("qwen3", "glm45")}


def _serve(dirs, family, name, *extra):
    root, models = dirs
    return Server.ours(models[family], root / f"{name}.log", root / "home", "--no-persist",
                       "--trust-remote-code", *extra)


@pytest.fixture(scope="module")
def qwen(dirs):
    with _serve(dirs, "qwen3", "qwen-on") as s:
        yield s


@pytest.fixture(scope="module")
def qwen_off(dirs):
    with _serve(dirs, "qwen3", "qwen-off", "--no-foresight") as s:
        yield s


@pytest.fixture(scope="module")
def glm(dirs):
    with _serve(dirs, "glm45", "glm-on") as s:
        yield s


def _settled(server):
    """``GET /v1/cache``'s foresight counters once nothing is rendered, queued or running
    (waits follow the server's progress)."""
    return server.watch.wait("foresight to settle").until(
        lambda: (lambda f: f if f["settled"] else None)(server.cache()["foresight"]), poll=0.02)


def _session(server, api, thinking=True, stream=False, name="s1", settle=True, **kw):
    """A scripted session whose client waits, after each answer, until the server's
    foresight settled (its idle moment: the tool runs, the user reads)."""
    return Session(server.port, api, thinking, stream, name=name,
                   pause=(lambda: _settled(server)) if settle else None, **kw)


def _assert_only_new_computed(s, server):
    """Every request after the first computed what its client added and the markup
    around it, nothing more."""
    for st in s.steps[1:]:
        assert st.added <= st.computed <= st.added + MARKUP, (s.steps, server.tail())


def _strip_ids(answers):
    """Answers without the ids each server makes up."""
    drop = ("id", "call_id", "tool_use_id")
    return [[{k: v for k, v in b.items() if k not in drop} for b in a] for a in answers]


@pytest.mark.parametrize("api", ["anthropic", "responses"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_loop_and_next_user_turn_read_all_but_the_new_tokens(qwen, api, thinking, stream):
    name = f"{api}-{thinking}-{stream}"
    s = _session(qwen, api, thinking, stream, name=name)
    before = _settled(qwen)
    s.turn("Read the notes, please.")
    s.turn("And once more, briefly.")
    assert [st.called for st in s.steps] == [True, True, False] * 2  # two steps, an answer
    _assert_only_new_computed(s, qwen)
    after = _settled(qwen)
    assert after["used_tokens"] > before["used_tokens"]
    assert after["finished"] - before["finished"] == 6
    entry = next(e for e in reversed(qwen.cache()["recent"]) if e.get("session") == name)
    assert entry.get("foreseen_tokens", 0) > 0


@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_answers_equal_those_of_a_server_without_foresight(qwen, qwen_off, api):
    turns = []
    for server in (qwen, qwen_off):
        s = _session(server, api, name=f"equal-{api}")
        turns.append(_strip_ids(s.turn("Read the notes, please.") + s.turn("Again.")))
    assert turns[0] == turns[1]
    assert qwen_off.cache()["foresight"]["computed_tokens"] == 0
    # Without foresight the new user turn recomputes the last turn's loop (its reasoning
    # dropped by the template), and every tool step the re-rendered generation prompt.
    st = s.steps[3]
    assert st.computed > st.added + 200, s.steps


def test_glm_template_tool_loop_reads_from_cache(glm):
    for api, thinking, stream in (("anthropic", True, False), ("responses", False, True)):
        s = _session(glm, api, thinking, stream, name=f"glm-{api}")
        s.turn("Read the notes, please.")
        s.turn("And once more.")
        _assert_only_new_computed(s, glm)


def test_a_waiting_request_takes_the_thread_at_the_next_chunk(dirs):
    # Chunks of 2 tokens: the next-turn prefix (the whole loop re-rendered) is hundreds of
    # chunks; another session's request sent while it runs is answered before it finishes.
    # On a loaded machine the other request may reach the server only after the job ended on
    # its own: that attempt shows nothing, and a fresh session tries again (bounded).
    with _serve(dirs, "qwen3", "chunks", "--prefill-step-size", "2") as server:
        mid = None
        for attempt in range(4):
            a = _session(server, "anthropic", name=f"long{attempt}", settle=False,
                         result_len=2500)
            finished = server.cache()["foresight"]["finished"]
            a.turn("Read the notes, please.")
            # (a loaded machine may starve these looks until the job has ended: then this
            # attempt shows nothing, and a fresh session tries again)
            running = server.watch.wait("foresight to start computing").until(
                lambda: (lambda f: f if f["running"] or f["finished"] > finished else None)(
                    server.cache()["foresight"]), poll=0.005)
            if not running["running"]:
                _settled(server)
                continue
            b = _session(server, "anthropic", name=f"other{attempt}", settle=False)
            b.user("Hello.")
            b.ask()
            mid = server.cache()["foresight"]
            if mid["interrupted"] == running["interrupted"]:
                # not interrupted: then it finished before the request came
                assert mid["finished"] > running["finished"], (running, mid)
                _settled(server)
                continue
            # It gave way (what it computed kept, the rest queued) rather than finish first.
            assert mid["interrupted"] == running["interrupted"] + 1, (running, mid)
            break
        else:
            pytest.fail(f"no request arrived while foresight computed, in 4 tries: {mid}")
        _settled(server)  # the rest, resumed once the server is idle again
        a.user("Next question.")
        a.ask()
        st = a.steps[-1]
        assert st.added <= st.computed <= st.added + MARKUP, (a.steps, server.tail())


def test_keep_reasoning_renders_earlier_reasoning_as_generated(qwen, dirs):
    from transformers import AutoTokenizer

    thought = "Step 1: I read notes/a.txt next.\n"
    convo = [{"role": "user", "content": f"Read it. {CUE}"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "\n" + thought, "signature": ""},
                 {"type": "text", "text": "\n\nDone."}]},
             {"role": "user", "content": f"Thanks. {CUE}"}]
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{qwen.port}", api_key="x", max_retries=0)
    n = {keep: c.messages.count_tokens(model="m", messages=convo,
                                       extra_body={"keep_reasoning": keep}).input_tokens
         for keep in (False, True)}
    # Qwen3's template drops reasoning before the last user message and has no switch:
    # the reasoning goes back into the turn's text as generated, markers included.
    tok = AutoTokenizer.from_pretrained(str(dirs[1]["qwen3"]))
    inline = tok.encode("<think>\n" + thought + "</think>", add_special_tokens=False)
    assert n[True] - n[False] == len(inline)
    with pytest.raises(anthropic.BadRequestError, match="keep_reasoning"):
        c.messages.create(model="m", max_tokens=4, messages=convo,
                          extra_body={"keep_reasoning": "yes"})
    r = openai.OpenAI(base_url=f"http://127.0.0.1:{qwen.port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        r.responses.create(model="m", input="hi", extra_body={"keep_reasoning": 1})
    assert e.value.body["param"] == "keep_reasoning"


def test_keep_reasoning_uses_the_templates_own_switch():
    from mlx_kvcache.serving.engine.templates import REASONING_SWITCHES, reasoning_switches
    from mlx_kvcache.testing.agent_templates import FAMILIES, _tokenizer
    import tempfile
    from pathlib import Path
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    switch = QWEN3_TEMPLATE.replace("{%- if loop.index0 > ns.last_query_index %}",
                                    "{%- if loop.index0 > ns.last_query_index or "
                                    "preserve_thinking %}")
    with tempfile.TemporaryDirectory() as d:
        fam = FAMILIES["qwen3"]
        plain = TokenizerWrapper(_tokenizer(Path(d) / "a", fam))
        kept = TokenizerWrapper(_tokenizer(Path(d) / "b", fam))
        kept._tokenizer.chat_template = switch
        assert reasoning_switches(plain, {}) is None
        assert reasoning_switches(kept, {}) == REASONING_SWITCHES


# -- the next request, as each API's client builds it -------------------------------------------
def test_each_route_foresees_the_request_its_client_sends_next():
    from mlx_kvcache.serving.routes.agents import anthropic as a_route
    from mlx_kvcache.serving.routes.agents import responses as r_route
    from mlx_kvcache.serving.routes.agents.foresight import common_prefix, session_of

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    answer = {"content": [{"type": "thinking", "thinking": "t", "signature": ""},
                          {"type": "text", "text": "\n\n"},
                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
                          {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]}
    nxt = a_route.follow_up(body, answer, "S")
    assert nxt["messages"][1] == {"role": "assistant", "content": [answer["content"][0],
                                                                   *answer["content"][2:]]}
    assert [b["tool_use_id"] for b in nxt["messages"][2]["content"]] == ["toolu_1", "toolu_2"]
    assert a_route.follow_up(body, {"content": [{"type": "text", "text": "ok"}]}, "S")[
        "messages"][2] == {"role": "user", "content": "S"}
    a_route.parse_request(nxt)  # the route takes what it foresaw
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # (not changed)

    body = {"model": "m", "input": "hi"}
    out = [{"type": "reasoning", "id": "r", "summary": [],
            "content": [{"type": "reasoning_text", "text": "t"}]},
           {"type": "function_call", "id": "fc", "call_id": "c1", "name": "f", "arguments": "{}"}]
    nxt = r_route.follow_up(body, {"output": out}, "S")
    assert nxt["input"] == [{"type": "message", "role": "user", "content": "hi"}, *out,
                            {"type": "function_call_output", "call_id": "c1", "output": "S"}]
    r_route.parse_request(nxt)
    assert r_route.follow_up(body, {"output": []}, "S") is None

    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    from mlx_kvcache.serving.routes.agents.call import ChatCall
    one = ChatCall(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    two = ChatCall(messages=[*one.messages, {"role": "user", "content": "c"}])
    assert session_of(one) == session_of(two) != session_of(ChatCall(messages=[
        {"role": "user", "content": "z"}]))
    assert session_of(ChatCall(messages=[], session="mine")) == "mine"
