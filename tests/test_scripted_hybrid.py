"""The hybrid scripted agent model (`testing.scripted_model` with ``hybrid``: a KV layer
holding the token ids and a recurrent layer whose state is a checksum of the tokens it
absorbed; the model answers `WRONG` where the two disagree).

In process: its caches are a KV layer and mlx-lm's ``ArraysCache`` (ours converts it to a
`RecurrentCache`: restored only at checkpoints), mlx-lm's batch path keeps padded rows
exact, a cold run answers the script, and a recurrent state one token behind the KV
layer's history changes the answer. Against real servers with the official SDKs: tool
loops of two user turns on ``/v1/messages`` and the chat route (the reasoning given back
as OpenCode does), foresight on, answer what a ``--no-persist`` server answers on an
empty cache; and two requests sharing a prefix sent together answer as cold ones.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc
from mlx_lm.utils import load

from mlx_kvcache.caches import make_prompt_cache
from mlx_kvcache.caches.recurrent import RecurrentCache
from mlx_kvcache.serving.cache.padding import padded_rows_exact
from mlx_kvcache.testing.agent_sessions import Session
from mlx_kvcache.testing.agent_templates import CUE, WRONG, write_scripted_dir
from mlx_kvcache.testing.scripted_model import checksum
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(CAP)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return write_scripted_dir(tmp_path_factory.mktemp("hybrid") / "model", "qwen3", steps=2,
                              hybrid=True)


@pytest.fixture(scope="module")
def loaded(hybrid_dir):
    return load(str(hybrid_dir), trust_remote_code=True)


def _greedy(model, caches, ids, eos, limit=400):
    """The answer's ids after ``ids`` (fed into ``caches``), greedy, to ``eos``."""
    out = []
    logits = model(mx.array([ids]), cache=caches)
    for _ in range(limit):
        t = int(mx.argmax(logits[0, -1]))
        if t == eos:
            return out
        out.append(t)
        logits = model(mx.array([[t]]), cache=caches)
    raise AssertionError("no end of answer")


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": f"{text} {CUE}"}],
                                   add_generation_prompt=True)


# -- in process --------------------------------------------------------------------------------
def test_its_caches_are_a_kv_layer_and_a_recurrent_one_with_padded_rows_exact(loaded):
    model, _ = loaded
    assert [type(c) for c in mlc.make_prompt_cache(model)] == [mlc.KVCache, mlc.ArraysCache]
    assert [type(c).__name__ for c in make_prompt_cache(model)] == ["KVCache", "RecurrentCache"]
    # mlx-lm's batch path (left and right padding) leaves each row's state as alone: the
    # server may batch it (a state out of step would not be stored either way)
    assert padded_rows_exact(model, 100) == {"KVCache": True, "ArraysCache": True}


def test_a_cold_run_answers_the_script_and_the_state_tracks_every_token(loaded):
    model, tok = loaded
    ids = _prompt(tok, "Read the notes.")
    caches = make_prompt_cache(model)
    text = tok.decode(_greedy(model, caches, ids, tok.eos_token_id))
    assert text.startswith("<think>\nStep 1: I read notes/a.txt") and WRONG not in text
    assert '"name": "read_file"' in text
    rec = caches[1]
    assert isinstance(rec, RecurrentCache) and rec.offset == caches[0].offset
    hist = np.array(caches[0].keys[0, 0, : caches[0].offset, 0]).astype(np.int64) - 1
    assert np.array_equal(np.array(rec[1][0]), checksum(hist).astype(np.float32))


@pytest.mark.parametrize("off", [-1, 1], ids=["behind", "ahead"])
def test_a_recurrent_state_one_token_out_of_step_changes_the_answer(loaded, off):
    model, tok = loaded
    ids = _prompt(tok, "Read the notes.")
    eos = tok.eos_token_id
    right = _greedy(model, make_prompt_cache(model), ids, eos)
    # The KV layer holds ids[:-1] (restored there); the recurrent state is the one stored
    # one token earlier (behind) or later (ahead) — a restore from the wrong checkpoint.
    kv, rec = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=kv)
    model(mx.array([ids[: len(ids) - 1 + off]]), cache=rec)
    wrong = _greedy(model, [kv[0], rec[1]], ids[-1:], eos)
    assert right and wrong != right
    assert tok.decode(wrong) == WRONG  # said once, then the answer ends
    # The same restore with the state of the right offset answers as the cold run.
    kv, good = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=kv)
    model(mx.array([ids[:-1]]), cache=good)
    assert _greedy(model, [kv[0], good[1]], ids[-1:], eos) == right


# -- real servers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(hybrid_dir, tmp_path_factory):
    """(ours: foresight and work in flight on, a reference ``--no-persist
    --no-foresight`` server whose cache the tests clear before each request)."""
    root = tmp_path_factory.mktemp("hybrid-servers")
    with Server.ours(hybrid_dir, root / "ours.log", root / "home", "--no-persist",
                     "--trust-remote-code") as ours, \
            Server.ours(hybrid_dir, root / "cold.log", root / "home-cold", "--no-persist",
                        "--no-foresight", "--trust-remote-code") as cold:
        yield ours, cold


def _settled(server):
    return server.watch.wait("foresight to settle").until(
        lambda: server.cache()["foresight"]["settled"], poll=0.02)


def _strip(answer):
    """An answer without the ids each server makes up."""
    drop = ("id", "call_id", "tool_use_id")
    if isinstance(answer, list):
        return [{k: v for k, v in b.items() if k not in drop} for b in answer]
    out = {k: v for k, v in answer.items() if k != "tool_calls"}
    out["calls"] = [c["function"] for c in answer.get("tool_calls", [])]
    return out


@pytest.mark.parametrize("api,back", [("anthropic", None), ("chat", "reasoning_content")],
                         ids=["messages", "chat-opencode"])
def test_a_tool_loop_answers_as_an_empty_cache_does(servers, api, back):
    ours, cold = servers
    runs = {}
    for who, server in (("ours", ours), ("cold", cold)):
        server.request("DELETE", "/v1/cache")
        pause = ((lambda: _settled(ours)) if who == "ours"
                 else (lambda: cold.request("DELETE", "/v1/cache")))
        s = Session(server.port, api, True, stream=True, name=f"hybrid-{api}",
                    result_len=600, pause=pause, reasoning_back=back)
        answers = s.turn("Read the notes, please.") + s.turn("And once more, briefly.")
        runs[who] = (s, [_strip(a) for a in answers])
    (s, got), (c, want) = runs["ours"], runs["cold"]
    assert got == want, ours.tail()
    assert [st.called for st in s.steps] == [True, True, False] * 2
    assert WRONG not in str(got)  # (the cold run's state and history agree)
    assert all(st.cached == 0 for st in c.steps)  # cold: nothing read
    # ours read every later request's prefix from cache (restored at a checkpoint: the
    # recurrent state of exactly the tokens restored, or the answer above would differ)
    assert all(st.cached > st.prompt // 2 for st in s.steps[1:]), s.steps


def test_requests_sharing_a_prefix_sent_together_answer_as_cold_ones(servers):
    ours, cold = servers
    system = "You are a subagent. Read the files you are given with care. " * 20
    tasks = [f"Read part {k}. {CUE}" for k in (1, 2, 3)]

    def ask(server, task):
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="k",
                                   max_retries=0).messages.create(
            model="m", max_tokens=200, system=system,
            messages=[{"role": "user", "content": task}],
            tools=[{"name": "read_file", "input_schema": {"type": "object"}}],
            extra_body={"temperature": 0})

    ours.request("DELETE", "/v1/cache")
    got = [None] * len(tasks)

    def run(i):
        got[i] = ask(ours, tasks[i])
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CAP)
    want = []
    for task in tasks:
        cold.request("DELETE", "/v1/cache")
        want.append(ask(cold, task))
    for g, w in zip(got, want):
        assert g is not None
        assert _strip([b.model_dump() for b in g.content]) == \
            _strip([b.model_dump() for b in w.content])
        assert WRONG not in str(g.content)


def test_a_tool_step_restores_where_the_template_rewrote_the_last_prompt(hybrid_dir, tmp_path):
    """Qwen3 without thinking renders an empty reasoning block in the generation prompt
    only: each tool step's prompt leaves the last one 6 tokens before its end. The hybrid
    restores there (a checkpoint where the answer's turn opens), not at an earlier
    interval checkpoint — with foresight off, so nothing computed ahead stands in."""
    with Server.ours(hybrid_dir, tmp_path / "log.txt", tmp_path / "home", "--no-persist",
                     "--no-foresight", "--trust-remote-code") as server:
        s = Session(server.port, "chat", False, name="hybrid-chat-nothink", result_len=600)
        s.turn("Read the notes, please.")
    assert [st.called for st in s.steps] == [True, True, False], s.steps
    for before, step in zip(s.steps, s.steps[1:]):
        assert before.prompt - 8 <= step.cached < before.prompt, (before, step)
