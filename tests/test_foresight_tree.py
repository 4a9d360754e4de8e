"""Foresight in a session that is a tree of requests, on every route, and never at a
request's cost:

* Claude Code's subagents (``x-claude-code-agent-id``) and its session-title side request
  (no tools, a JSON schema, 256 tokens) carry the main session's id: they never take,
  settle or replace the main loop's foreseen prefix, whose next request still computes
  only what it adds;
* the chat-completions route foresees a thinking model's tool loop — the answer given back
  as OpenCode gives it (``reasoning_content``), the template dropping the loop's reasoning
  at the next question — on mlx-lm's own chat route;
* a ``DELETE /v1/cache`` wins over an offer rendered before it, in memory and on disk;
* under a budget that holds about one session, foresight makes no session compute more
  than the same traffic does with ``--no-foresight``;
* in process: an idle chunk is sized from the measured prefill rate; what a finished
  prompt alone holds goes first under the budget (`PrefixManager.age_tail`).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from mlx_kvcache.caches import make_prompt_cache
from mlx_kvcache.prefix.manager import PrefixManager
from mlx_kvcache.serving.cache import foresight as fs_mod
from mlx_kvcache.serving.cache.foresight import Foresight
from mlx_kvcache.testing.agent_sessions import Session
from mlx_kvcache.testing.agent_templates import write_scripted_dir
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP
from models import V, build

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(CAP)

#: Markup a turn adds around its new text (test_foresight's bound).
MARKUP = 40


# -- in process --------------------------------------------------------------------------------
def test_an_offer_rendered_before_a_clear_is_dropped():
    fs = Foresight()
    epoch = fs.expect()
    fs.clear()
    fs.offer("s", [1, 2, 3], epoch=epoch)
    r = fs.report()
    assert r["queued"] == 0 and r["cleared"] == 1 and r["settled"]
    fs.offer("s", [1, 2, 3], expected=False, epoch=fs.expect())
    assert fs.report()["queued"] == 1


def test_an_idle_chunk_takes_about_the_yield_time_at_the_measured_rate():
    fs = Foresight()
    assert fs.chunk(2048) == fs_mod.FIRST_CHUNK  # nothing measured yet
    fs.measured(1000, 10.0)  # 10 ms a token
    assert fs.chunk(2048) == int(fs_mod.YIELD_S / 0.01)
    assert fs.chunk(8) == 8  # never past the prefill step
    fs.measured(10, 100.0)  # a very slow rate: never below the smallest chunk
    assert fs.chunk(2048) == fs_mod.MIN_CHUNK


def test_what_a_finished_prompt_alone_holds_goes_first():
    import mlx.core as mx
    m = build("llama")
    mgr = PrefixManager(lambda: make_prompt_cache(m), max_bytes=1 << 30)
    rng = random.Random(5)
    shared = [rng.randrange(1, V) for _ in range(64)]
    a = shared + [rng.randrange(1, V) for _ in range(40)]
    b = shared + [rng.randrange(1, V) for _ in range(40)]
    for seq in (a, b):
        caches = make_prompt_cache(m)
        m(mx.array(seq)[None], cache=caches)
        mgr.record(caches, seq)
    mgr.age_tail(a)
    path, matched = mgr.trie.find(np.asarray(a))
    assert matched == len(a)
    assert [(n.end, n.last_used == 0) for n in path] == [(64, False), (len(a), True)]
    # under the budget it goes before b's, the shared prefix stays
    mgr.fit_bytes(mgr.trie.nbytes - 1)
    assert mgr.trie.find(np.asarray(a))[1] == 64 and mgr.trie.find(np.asarray(b))[1] == len(b)


# -- servers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    return root, write_scripted_dir(root / "qwen3", "qwen3", steps=2)


def _serve(model, name, *extra):
    root, path = model
    return Server.ours(path, root / f"{name}.log", root / f"{name}-home", "--trust-remote-code",
                       *extra)


@pytest.fixture(scope="module")
def qwen(model):
    with _serve(model, "on", "--no-persist") as s:
        yield s


def _settled(server):
    return server.watch.wait("foresight to settle").until(
        lambda: (lambda f: f if f["settled"] else None)(server.cache()["foresight"]), poll=0.02)


def _only_new_computed(s, server, steps=None):
    for st in (steps or s.steps)[1:]:
        assert st.added <= st.computed <= st.added + MARKUP, (s.steps, server.tail())


def test_subagents_and_a_title_never_take_the_main_loops_foreseen_prefix(qwen):
    pause = lambda: _settled(qwen)  # noqa: E731
    main = Session(qwen.port, "anthropic", name="tree", pause=pause)
    main.user("Read the notes, please.")
    main.ask()  # a tool call: the main loop's next request is foreseen
    before = _settled(qwen)
    # While its tool runs: a subagent of the same session runs a task of its own, and the
    # client asks for the session's title.
    sub = Session(qwen.port, "anthropic", name="tree", pause=pause,
                  headers={"x-claude-code-agent-id": "agent-1"})
    sub.turn("A task of the subagent.")
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{qwen.port}", api_key="x",
                            max_retries=0)
    c.messages.create(model="m", max_tokens=256, metadata={"user_id": "tree"},
                      messages=[{"role": "user", "content": "Title this: read the notes."}],
                      extra_body={"temperature": 0, "output_config": {"format": {
                          "type": "json_schema", "schema": {"type": "object"}}}})
    after = _settled(qwen)
    assert after["replaced"] == before["replaced"]  # none took the main loop's job
    main.ask()
    main.ask()  # the loop's end (two steps, then the answer)
    _only_new_computed(main, qwen)
    _only_new_computed(sub, qwen)


def test_the_chat_route_foresees_a_thinking_tool_loop(model, qwen):
    s = Session(qwen.port, "chat", thinking=True, name="chat-tree", result_len=600,
                pause=lambda: _settled(qwen), reasoning_back="reasoning_content")
    s.turn("Read the notes, please.")
    s.turn("And once more, briefly.")
    _only_new_computed(s, qwen)
    with _serve(model, "off", "--no-persist", "--no-foresight") as off:
        t = Session(off.port, "chat", thinking=True, name="chat-tree", result_len=600,
                    reasoning_back="reasoning_content")
        t.turn("Read the notes, please.")
        t.turn("And once more, briefly.")
    # without foresight the next question recomputes the loop whose reasoning the template
    # drops; with it, only the question
    assert t.steps[3].computed > t.steps[3].added + 200, t.steps
    assert [st.called for st in s.steps] == [st.called for st in t.steps]


def test_a_delete_wins_over_foresight_in_memory_and_on_disk(model):
    root, _ = model
    with _serve(model, "delete", "--cache-dir", str(root / "delete-cache")) as s:
        a = Session(s.port, "anthropic", name="gone")
        a.user("Read the notes, please.")
        a.ask()  # its end counts a rendering; the DELETE races it
        s.request("DELETE", "/v1/cache")
        _settled(s)
        r = s.cache()
        assert r["nodes"] == 0 and r["bytes_held"] == 0, r
        s.stop()
    with _serve(model, "delete2", "--cache-dir", str(root / "delete-cache")) as s:
        r = s.cache()
        assert r["nodes"] == 0 and r["disk_bytes"] == 0, r


def _traffic(port, pause):
    """Three sessions taking turns: each user turn a tool loop of two steps."""
    sessions = [Session(port, "anthropic", name=f"b{i}", result_len=500, pause=pause)
                for i in range(3)]
    for k in range(2):
        for s in sessions:
            s.turn("Read the notes, please." if k == 0 else "Again, briefly.")
    return sum(st.computed for s in sessions for st in s.steps)


@pytest.mark.parametrize("size", ["16K", "48K"])
def test_under_a_small_budget_foresight_costs_no_session_more(model, size):
    # 16K: less than one session (jobs that would recompute it are skipped: no room);
    # 48K: about one and a half
    budget = ("--prompt-cache-bytes", size, "--no-persist")
    with _serve(model, f"small-off-{size}", *budget, "--no-foresight") as off:
        without = _traffic(off.port, None)
    with _serve(model, f"small-on-{size}", *budget) as on:
        with_ = _traffic(on.port, lambda: _settled(on))
        report = on.cache()["foresight"]
    assert with_ <= without, (with_, without, report)
    if size == "16K":
        assert report["no_room"] > 0, report
