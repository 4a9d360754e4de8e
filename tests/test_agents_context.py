"""The agent routes keep the APIs' contracts where real clients lean on them, against real
`mlx-kvcache serve` processes, through the official ``anthropic`` and ``openai`` SDKs and
raw HTTP: answers without a client limit run to what the context leaves (Codex sends no
``max_output_tokens``), a prompt over the context is refused before any work in each API's
words, ``/v1/models`` gives the context length, Anthropic usage adds up to the prompt in
``message_start`` and at the end alike, every name the served model answers to shares one
batch, and the log names the client's session.

The model (`write_long_dir`) never ends its answer and has a 640-token context, so every
limit shows in ``output_tokens``."""

from __future__ import annotations

import http.client
import json
import time

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.testing.agent_dirs import LONG_ANSWER, write_long_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)

CTX = 640
ASK = [{"role": "user", "content": "Write at length."}]
GREEDY = {"temperature": 0}


def _prompt(u) -> int:
    """The prompt's tokens by Anthropic's usage: its three input counts add up to it."""
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


# -- in process ------------------------------------------------------------------------------
def _config_dir(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_the_context_length_comes_from_one_place(tmp_path):
    from types import SimpleNamespace as NS

    from mlx_kvcache.serving.guards.context import context_length

    cases = {"plain": ({"max_position_embeddings": 4096, "sliding_window": 512}, 4096),
             "vision": ({"model_type": "x", "text_config": {"max_position_embeddings": 8192}},
                        8192),
             "gguf_like": ({"n_ctx": 2048}, 2048),
             "window_only": ({"sliding_window": 512}, None)}
    for name, (config, want) in cases.items():
        args = NS(model=_config_dir(tmp_path / name, config), context_length=None)
        assert context_length(args) == want, name
        # --context-length wins over the config
        assert context_length(NS(model=args.model, context_length=1000)) == 1000
    # No config names it: the loaded model's arguments may.
    args = NS(model=str(tmp_path / "window_only"), context_length=None)
    assert context_length(args, model=NS(args=NS(max_seq_len=3000))) == 3000


def test_the_memory_limit_bounds_the_served_context(tmp_path):
    from types import SimpleNamespace as NS

    from mlx_kvcache.serving.guards.context import memory_tokens, served_context
    from mlx_kvcache.serving.guards.footprint import Footprint

    fp = Footprint(weights=1000, kv_fixed=0, kv_per_token=1.0, act_per_token=0.0, step=512)
    # need(T) = 2 * T rounded up to mlx-lm's 256-token steps: 2 * 512 fits 2048 - 1000
    # beside the weights, 2 * 768 does not.
    assert memory_tokens(NS(footprint=fp, limit=2048)) == 512
    assert fp.need(512, 0) <= 1048 < fp.need(513, 0)
    assert memory_tokens(NS(footprint=fp, limit=None)) is None  # --memory-limit 0
    assert memory_tokens(NS(footprint=None, limit=2048)) is None  # not measured
    assert memory_tokens(NS(footprint=fp, limit=1000)) == 0
    args = NS(model=_config_dir(tmp_path / "m", {"max_position_embeddings": 4096}),
              context_length=None)
    gen = NS(model_provider=NS(cli_args=args, model_key=(args.model, None, None), model=None),
             memory=NS(footprint=fp, limit=2048), served=lambda: None)
    assert served_context(gen) == 512  # the machine holds less than the model's 4096
    gen.memory.limit = 1 << 20
    assert served_context(gen) == 4096


def test_max_tokens_given_is_told_from_the_default():
    import argparse

    from mlx_kvcache.serving.guards.context import explicit_max_tokens, mark_default_max_tokens

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=512)
    mark_default_max_tokens(parser)
    default = parser.parse_args([])
    assert default.max_tokens == 512 and explicit_max_tokens(default) is None
    assert explicit_max_tokens(parser.parse_args(["--max-tokens", "512"])) == 512


def test_answer_limits():
    from mlx_kvcache.serving.guards.context import ContextTooLong, answer_tokens

    assert answer_tokens(100, 30, None, None) == 70  # no limit: what the context leaves
    assert answer_tokens(100, 30, None, 40) == 40  # the user's --max-tokens
    assert answer_tokens(100, 30, 1000, 40) == 70  # a client's limit, clamped
    assert answer_tokens(100, 99, 5, None) == 1
    assert answer_tokens(None, 10**6, None, None) is None  # unknown context: the server's
    with pytest.raises(ContextTooLong, match=r"^prompt is too long: 100 tokens > 99 maximum$"):
        answer_tokens(100, 100, 5, None)


def test_usage_splits_the_prompt():
    from mlx_kvcache.serving.routes.agents.call import Usage

    u = Usage.split(100, 60, 90, stores=True, output_tokens=7)
    assert (u.cached_tokens, u.created_tokens, u.input_tokens) == (60, 30, 10)
    assert u.cached_tokens + u.created_tokens + u.input_tokens == u.prompt_tokens == 100
    assert Usage.split(100, 60, 90, stores=False).created_tokens == 0  # nothing stored
    assert Usage.split(100, 95, 90, stores=True).input_tokens == 5  # read past the mark
    assert Usage.split(100, 0, 0, stores=True).input_tokens == 100  # no breakpoint


def test_the_session_inside_claude_codes_user_id():
    from mlx_kvcache.serving.routes.agents.anthropic import session_of

    assert session_of(json.dumps({"device_id": "d", "account_uuid": "a",
                                  "session_id": "s-1"})) == "s-1"
    assert session_of("user_ab12_account_1-2_session_3f-4e") == "3f-4e"
    assert session_of(json.dumps({"device_id": "d"})) == json.dumps({"device_id": "d"})
    assert session_of("someone") == "someone"


def test_every_served_name_is_one_batch_key(tmp_path):
    from types import SimpleNamespace as NS

    from mlx_lm.server import ModelDescription

    from mlx_kvcache.serving.routes.model_names import DEFAULT, batch_key

    cli = NS(model=str(tmp_path), served_model_name=None)
    other = tmp_path / "other"
    other.mkdir()
    for name, want in (("claude-sonnet-5", DEFAULT), ("gpt-4o", DEFAULT), (DEFAULT, DEFAULT),
                       (str(tmp_path), DEFAULT), (str(other), str(other))):
        args = NS(model=ModelDescription(model=name, draft=DEFAULT, adapter=None))
        assert batch_key(cli, args).model == ModelDescription(want, DEFAULT, None), name


# -- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_long_dir(tmp_path_factory.mktemp("long") / "model", CTX)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist") as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="local",
                               max_retries=0)


@pytest.fixture(scope="module")
def codex(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="local",
                         max_retries=0)


def test_without_a_client_limit_the_answer_runs_to_the_context(server, claude, codex):
    n = claude.messages.count_tokens(model="m", messages=ASK).input_tokens
    room = CTX - n
    assert room > 512  # past mlx-lm's --max-tokens default, which no longer applies here
    # Codex sends no max_output_tokens: whole and streamed.
    r = codex.responses.create(model="gpt-5-codex", input="Write at length.", extra_body=GREEDY)
    assert r.usage.input_tokens == n and r.usage.output_tokens == room
    assert r.output_text.startswith(LONG_ANSWER)
    assert r.status == "incomplete"  # this model never ends: the context did
    final = list(codex.responses.create(model="gpt-5-codex", input="Write at length.",
                                        stream=True, extra_body=GREEDY))[-1]
    assert final.type == "response.incomplete" and final.response.usage.output_tokens == room
    # Anthropic without max_tokens (raw HTTP: the SDK always sends one), whole and streamed.
    status, out = server.request("POST", "/v1/messages", {"model": "m", "messages": ASK,
                                                          **GREEDY})
    assert status == 200 and out["usage"]["output_tokens"] == room, out
    assert out["stop_reason"] == "max_tokens"
    events = list(claude.messages.create(model="m", max_tokens=100_000, messages=ASK,
                                         stream=True, extra_body=GREEDY))
    # A client limit past the context is clamped to what it leaves.
    assert events[-2].type == "message_delta" and events[-2].usage.output_tokens == room
    # The chat route keeps mlx-lm's default (--max-tokens), clamped to the context too.
    status, out = server.request("POST", "/v1/chat/completions", {"messages": ASK, **GREEDY})
    assert status == 200 and out["usage"]["completion_tokens"] == 512
    assert server.chat(ASK, max_tokens=100_000)["usage"]["completion_tokens"] == room
    # serve said so at start, with the clients' settings.
    log = server.tail(200_000)
    assert f"{CTX} tokens (model config)" in log
    assert f"model_context_window = {CTX}" in log
    assert f"CLAUDE_CODE_AUTO_COMPACT_WINDOW={CTX}" in log


def test_models_list_the_context_length(server):
    status, listing = server.request("GET", "/v1/models")
    assert status == 200
    (entry,) = listing["data"]
    assert entry["context_length"] == entry["max_model_len"] == CTX
    status, one = server.request("GET", "/v1/models/claude-sonnet-5")
    assert status == 200 and one["context_length"] == CTX


def _sized(tokens: int):
    """A one-message conversation whose prompt is ``tokens`` long (one token per character;
    the template adds ``<|user|>``, ``</s>`` and ``<|assistant|>``)."""
    return [{"role": "user", "content": "x" * (tokens - 3)}]


def test_a_prompt_over_the_context_is_refused_before_any_work(server, claude, codex):
    fits, over = _sized(CTX - 1), _sized(CTX)
    assert claude.messages.count_tokens(model="m", messages=over).input_tokens == CTX
    before = server.cache()["recent"]
    want = f"prompt is too long: {CTX} tokens > {CTX - 1} maximum"
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="m", max_tokens=4, messages=over, stream=stream)
        assert e.value.status_code == 400
        assert e.value.body["error"] == {"type": "invalid_request_error", "message": want}
        with pytest.raises(openai.BadRequestError) as e:
            codex.responses.create(model="m", input=over[0]["content"], stream=stream)
        assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
        assert f"{CTX} tokens" in e.value.message and f"{CTX - 1} maximum" in e.value.message
    # The chat route too, in OpenAI's shape, and it goes on serving on a new connection.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            codex.chat.completions.create(model="m", messages=over, max_tokens=4,
                                          stream=stream)
        assert e.value.code == "context_length_exceeded"
        assert e.value.body["message"] == want and e.value.body["type"] == "invalid_request_error"
    assert server.cache()["recent"] == before  # nothing was fetched, computed or stored
    # One token short of the context: the answer has room for one token.
    r = claude.messages.create(model="m", max_tokens=4, messages=fits, extra_body=GREEDY)
    assert r.usage.output_tokens == 1 and r.stop_reason == "max_tokens"
    assert _prompt(r.usage) == CTX - 1


def test_a_chat_stream_waiting_to_be_taken_is_kept_alive_and_refused_in_it(tmp_path):
    import threading

    from mlx_kvcache.serving.routes.handler import KEEPALIVE_ENV

    # A request with a seed is served alone (mlx-lm's sequential path): while it runs,
    # streamed requests behind it wait in the queue. Their streams open with a keep-alive
    # comment once they waited an interval; one refused when it is finally taken (a prompt
    # over the context) gets OpenAI's error inside its stream. The one ahead would run for
    # thousands of tokens: its client leaves once both waiting streams opened.
    ctx = 4096
    model = write_long_dir(tmp_path / "long", ctx)
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist",
                     env={KEEPALIVE_ENV: "0.002"}) as s:
        codex = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="local",
                              max_retries=0)
        ahead = codex.chat.completions.create(model="m", messages=ASK, max_tokens=ctx - 100,
                                              seed=1, stream=True, **GREEDY)
        next(iter(ahead))  # it runs
        got, opened = {}, {"ok": threading.Event(), "over": threading.Event()}

        def waiting_ok():
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=CAP)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(
                {"model": "m", "messages": ASK, "max_tokens": 5, "stream": True, **GREEDY}))
            r = conn.getresponse()
            opened["ok"].set()
            got["ok"] = (r.status, r.read())

        def waiting_over():
            try:
                stream = codex.chat.completions.create(model="m", messages=_sized(ctx),
                                                       max_tokens=4, stream=True)
                opened["over"].set()
                for _ in stream:
                    pass
            except openai.APIError as e:
                got["over"] = e
                opened["over"].set()
        threads = [threading.Thread(target=f) for f in (waiting_ok, waiting_over)]
        for t in threads:
            t.start()
        s.watch.wait("the waiting streams to open").until(
            lambda: all(e.is_set() for e in opened.values()), poll=0.05)
        ahead.close()  # its client leaves: it stops, and the waiting ones are taken
        for t in threads:
            t.join(CAP)
        status, raw = got["ok"]
        assert status == 200 and raw.startswith(b": keepalive\n\n"), raw[:200]
        assert raw.rstrip().endswith(b"data: [DONE]")
        chunks = [json.loads(line[6:]) for line in raw.split(b"\n")
                  if line.startswith(b"data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c.get("choices"))
        alone = codex.chat.completions.create(model="m", messages=ASK, max_tokens=5, **GREEDY)
        assert text == alone.choices[0].message.content
        e = got["over"]
        assert not isinstance(e, openai.BadRequestError)  # (a status, had it not waited)
        assert f"{ctx} tokens > {ctx - 1} maximum" in e.message, e.message
        assert e.body["code"] == "context_length_exceeded", e.body


def test_explicit_max_tokens_and_context_length(model, tmp_path):
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist",
                     "--max-tokens", "40", "--context-length", "300") as s:
        codex = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x",
                              max_retries=0)
        r = codex.responses.create(model="m", input="Write at length.", extra_body=GREEDY)
        assert r.usage.output_tokens == 40  # the user's --max-tokens, given explicitly
        assert s.request("GET", "/v1/models")[1]["data"][0]["context_length"] == 300
        with pytest.raises(openai.BadRequestError) as e:
            codex.responses.create(model="m", input="x" * 300)
        assert "299 maximum" in e.value.message
        log = s.tail(200_000)
        assert "300 tokens (--context-length)" in log and "model_max_output_tokens = 40" in log


def test_usage_adds_up_at_the_start_and_the_end(server, claude, codex):
    system = [{"type": "text", "text": "You write.", "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Write at length, please.",
                                          "cache_control": {"type": "ephemeral"}}]}]
    n = claude.messages.count_tokens(model="m", system=system, messages=msgs).input_tokens

    def streamed():
        events = list(claude.messages.create(model="m", max_tokens=3, system=system,
                                             messages=msgs, stream=True, extra_body=GREEDY))
        start, end = events[0].message.usage, events[-2].usage
        assert (start.input_tokens, start.cache_creation_input_tokens,
                start.cache_read_input_tokens) == (end.input_tokens,
                                                   end.cache_creation_input_tokens,
                                                   end.cache_read_input_tokens)
        assert _prompt(start) == _prompt(end) == n and end.output_tokens == 3
        return end

    server.request("DELETE", "/v1/cache")
    cold = streamed()
    # Computed up to the last breakpoint (the user's text) is created; after it (the
    # template's "</s><|assistant|>") is input.
    assert cold.cache_read_input_tokens == 0
    assert cold.input_tokens == 2 and cold.cache_creation_input_tokens == n - 2
    warm = streamed()
    assert (warm.input_tokens, warm.cache_creation_input_tokens,
            warm.cache_read_input_tokens) == (1, 0, n - 1)
    whole = claude.messages.create(model="m", max_tokens=3, system=system, messages=msgs,
                                   extra_body=GREEDY).usage
    assert (whole.input_tokens, whole.cache_creation_input_tokens,
            whole.cache_read_input_tokens) == (1, 0, n - 1)
    # Responses: input_tokens is the whole prompt, cached_tokens what was read.
    ask = "Write at length, pardon."
    m = claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": ask}])
    first = codex.responses.create(model="m", input=ask, max_output_tokens=3,
                                   extra_body=GREEDY).usage
    assert first.input_tokens == m.input_tokens
    again = list(codex.responses.create(model="m", input=ask, max_output_tokens=3,
                                        stream=True, extra_body=GREEDY))[-1].response.usage
    assert again.input_tokens == m.input_tokens
    assert again.input_tokens_details.cached_tokens == m.input_tokens - 1


def test_sessions_are_the_clients(server, claude, codex):
    names = {
        json.dumps({"device_id": "d" * 64, "account_uuid": "acc",
                    "session_id": "6f1c2d3e-0000-4000-8000-000000000001"}):
            "6f1c2d3e-0000-4000-8000-000000000001",
        "user_" + "a" * 64 + "_account_11111111-2222-3333-4444-555555555555_session_"
        "99999999-8888-7777-6666-555555555555": "99999999-8888-7777-6666-555555555555",
        "plain-user": "plain-user",
    }
    for user_id, session in names.items():
        sent = time.time()  # (the entry of this request: it is listed after its answer)
        claude.messages.create(model="m", max_tokens=1, messages=ASK,
                               metadata={"user_id": user_id}, extra_body=GREEDY)
        assert server.entry_since(sent)["session"] == session
    sent = time.time()
    codex.responses.create(model="m", input="Write.", max_output_tokens=1,
                           prompt_cache_key="codex-thread-7", extra_body=GREEDY)
    assert server.entry_since(sent)["session"] == "codex-thread-7"
    assert "session 6f1c2d3e-0000-4000-8000-000000000001" in server.tail(200_000)


def test_every_name_of_the_served_model_shares_one_batch(model, tmp_path):
    """A chat request naming the model its own way runs in the batch of a ``/v1/messages``
    answer: it ends, and is listed in ``recent``, while that long answer still runs (8000
    tokens, seconds at the least; its client leaves first). Were the names not one
    model, mlx-lm would drain its batch first: the chat request would wait for the long
    answer's end, listed before it."""
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist",
                     "--context-length", "8192") as server:
        long = server.stream("/v1/messages", {
            "model": "claude-opus-main", "max_tokens": 8000, "messages": ASK,
            "stream": True, "metadata": {"user_id": "long-one"}, **GREEDY})
        try:
            for ev in long:  # until the long answer is being generated
                if ev.get("type") == "content_block_delta":
                    break
            side = [{"role": "user", "content": "A side question."}]
            status, chat = server.request("POST", "/v1/chat/completions", {
                "model": "claude-haiku-side", "max_tokens": 2, "messages": side})
            assert status == 200 and chat["usage"]["completion_tokens"] == 2
            listed = server.entry_since(0)  # the newest: the side question's
            assert listed["prompt_tokens"] == chat["usage"]["prompt_tokens"]
            assert not [e for e in server.cache()["recent"] if e.get("session") == "long-one"]
        finally:
            long.close()  # the client leaves: the long answer ends
        server.watch.wait("the abandoned answer's route to return").until(
            lambda: server.cache()["open_requests"] == 0)
