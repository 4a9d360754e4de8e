"""The OpenAI Responses API (``POST /v1/responses``): the request's translation to a
`ChatCall`, the answer's events as the openai SDK parses them (validated against its types
and replayed through its own stream accumulator), and real servers spoken to with the
official ``openai`` client."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from mlx_kvcache.serving.engine.answer import Failed, Progress  # noqa: E402
from mlx_kvcache.serving.parsers.base import Call, Reasoning, Text  # noqa: E402
from mlx_kvcache.serving.routes.agents.call import AgentRequestError  # noqa: E402
from mlx_kvcache.serving.routes.agents.generation import Accounting  # noqa: E402
from fake_answers import ScriptedGenerator, EndlessAnswer, ScriptedAnswer, finished, runs  # noqa: E402
from mlx_kvcache.serving.routes.agents.responses import ResponseBuilder, parse_request, render

openai = pytest.importorskip("openai")
from openai.lib.streaming.responses._responses import ResponseStreamState  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
RESPONSE = TypeAdapter(Response)

CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"]}, "strict": False},
    {"type": "web_search"},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "description": "patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
]


# -- request -> ChatCall ------------------------------------------------------------------------
def test_string_input_and_instructions():
    call = parse_request({"model": "gpt-5", "instructions": "Be brief.", "input": "Hi"})
    assert call.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]
    assert call.labels == ["instructions", "input"]
    assert call.tools is None and call.max_tokens is None and call.sampling == {}
    # checkpoints where the next request comes back: after the instructions, after the
    # input (the latter only where the template makes the next request diverge there)
    assert call.breakpoints == [(0, 0)] and call.end_mark == (1, 0)
    assert parse_request({"model": "gpt-5", "instructions": "Be brief."}
                         | {"input": [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Yo"}]}).end_mark is None


def test_items_kept_in_place_and_calls_joined_to_their_turn():
    body = {"instructions": "base", "prompt_cache_key": "sess-1", "max_output_tokens": 40,
            "temperature": 0, "top_p": 0.5, "store": False, "metadata": {"a": "b"},
            "parallel_tool_calls": False, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "input": [
                {"type": "message", "role": "developer",
                 "content": [{"type": "input_text", "text": "<permissions>"}]},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "list "},
                             {"type": "input_text", "text": "files"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "think"}],
                 "encrypted_content": None},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "shell",
                 "arguments": "{\"cmd\": \"ls\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {"role": "system", "content": "nudge"},
                {"role": "user", "content": "thanks"},
            ]}
    call = parse_request(body)
    assert call.messages == [
        {"role": "system", "content": "base"},
        {"role": "system", "content": "<permissions>"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Sure.", "reasoning": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "shell", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "system", "content": "nudge"},
        {"role": "user", "content": "thanks"},
    ]
    assert call.labels == ["instructions", "input[0]", "input[1]", "input[3..4]", "input[5]",
                           "input[6]", "input[7]"]
    # the function tool and the custom one (a function of one string) reach the template
    assert call.tools == [{"type": "function", "function": {
        "name": "shell", "description": "Run a command",
        "parameters": CODEX_TOOLS[0]["parameters"]}},
        {"type": "function", "function": {
            "name": "apply_patch",
            "description": "patch\n\nThe input is free text following this lark grammar:\n"
                           "start: /.+/",
            "parameters": {"type": "object", "properties": {"input": {
                "type": "string", "description": "The tool's input: free text, sent as is."}},
                "required": ["input"]}}}]
    assert call.tool_choice == "auto" and call.max_tokens == 40
    assert call.sampling == {"temperature": 0.0, "top_p": 0.5}
    assert call.session == "sess-1"


def test_reasoning_goes_with_the_turn_right_after_it():
    call = parse_request({"input": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": "a"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
        {"role": "user", "content": "u"},
        {"type": "message", "role": "assistant", "content": "b"}]})
    # nothing readable in the first; the second precedes a user message, not a turn of its own
    assert call.messages == [{"role": "assistant", "content": "a"},
                             {"role": "user", "content": "u"},
                             {"role": "assistant", "content": "b"}]


def test_tool_choice_forms():
    base = {"input": "x", "tools": [{"type": "function", "name": "f"},
                                    {"type": "function", "name": "g"}, {"type": "web_search"}]}
    assert parse_request({**base, "tool_choice": {"type": "function", "name": "f"}}) \
        .tool_choice == {"type": "function", "function": {"name": "f"}}
    assert parse_request({**base, "tool_choice": "required"}).tool_choice == "required"
    assert parse_request({**base, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                  "tools": []}}).tool_choice == "auto"


def test_tool_choice_gives_the_template_what_it_allows():
    base = {"input": "x", "tools": [{"type": "function", "name": "f"},
                                    {"type": "function", "name": "g"}, {"type": "web_search"}]}
    names = lambda call: [t["function"]["name"] for t in call.tools or ()]  # noqa: E731
    assert names(parse_request(base)) == ["f", "g"]
    assert names(parse_request({**base, "tool_choice": "none"})) == []
    assert names(parse_request({**base, "tool_choice": {"type": "function", "name": "g"}})) \
        == ["g"]
    assert names(parse_request({**base, "tool_choice": "required"})) == ["f", "g"]
    allowed = {"type": "allowed_tools", "mode": "required",
               "tools": [{"type": "function", "name": "g"}, {"type": "web_search"}]}
    call = parse_request({**base, "tool_choice": allowed})
    assert names(call) == ["g"] and call.tool_choice == "required"
    assert names(parse_request({**base, "tool_choice": {**allowed, "tools": []}})) == []
    with pytest.raises(AgentRequestError) as e:
        parse_request({**base, "tool_choice": {**allowed, "tools": [
            {"type": "function", "name": "h"}]}})
    assert e.value.param == "tool_choice" and "'h'" in e.value.message
    for tools in (base["tools"], None):
        with pytest.raises(AgentRequestError) as e:
            parse_request({**base, "tools": tools,
                           "tool_choice": {"type": "function", "name": "web_search"}})
        assert e.value.status == 400 and e.value.param == "tool_choice"
        assert "'web_search'" in e.value.message


def test_reasoning_effort_turns_thinking_on_or_off():
    base = {"input": "Hi"}
    assert parse_request(base).thinking is None
    assert parse_request({**base, "reasoning": {"summary": "auto"}}).thinking is None
    for effort, on in (("none", False), ("minimal", False), ("low", True), ("medium", True),
                       ("high", True), ("xhigh", True)):
        assert parse_request({**base, "reasoning": {"effort": effort, "summary": "auto"}}
                             ).thinking is on


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": 7}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "file_id": "file_1"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image"}]}]},
     "input[0].content[1]"),
    ({"input": [{"type": "message", "role": "assistant", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
    ({"input": [{"type": "mystery"}]}, "input[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "top_p": 2}, "top_p"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "prompt_cache_key": 3}, "prompt_cache_key"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(AgentRequestError) as e:
        parse_request(body)
    assert e.value.status == 400
    assert getattr(e.value, "param", None) == param
    if param:
        assert param.split("[")[0].split(".")[0] in e.value.message


# -- Events -> the answer -----------------------------------------------------------------------
def events_of(*kinds, finish="stop"):
    out = []
    for i, k in enumerate(kinds):
        if k == "call":
            out.append(Call(i, "shell", "{\"cmd\": \"ls\"}"))
        else:
            out.append((Text if k == "text" else Reasoning)(f"{k} piece "))
    out.append(finished(finish, prompt=120, cached=100, output=9))
    return out


def replay(stream):
    """Every event validated against the SDK's types, then fed to its own accumulator."""
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for kind, ev in stream:
        assert kind == ev["type"]
        STREAM_EVENT.validate_python(ev)
        state.handle_event(STREAM_EVENT.validate_python(ev))
    return state


@pytest.mark.parametrize("kinds", [("text", "text"), ("reasoning", "text", "call"),
                                   ("call",), ("text", "call", "call"), ()])
def test_stream_parses_with_the_sdk(kinds):
    body = {"input": "x", "tools": CODEX_TOOLS[:1], "prompt_cache_key": "k"}
    stream = list(render(body, "served", events_of(*kinds)))
    assert [e["sequence_number"] for _, e in stream] == list(range(len(stream)))
    names = [k for k, _ in stream]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    state = replay(stream)
    final = stream[-1][1]["response"]
    RESPONSE.validate_python(final)
    parsed = state._completed_response  # what client.responses.stream() hands back
    assert parsed is not None and parsed.status == "completed"
    texts = [k for k in kinds if k == "text"]
    assert parsed.output_text == "".join(f"{k} piece " for k in texts)
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("shell", {"cmd": "ls"})] * kinds.count("call")
    # each call its own id (clients match outputs by call_id)
    assert all(c["call_id"].startswith("call_") for c in calls)
    assert len({c["call_id"] for c in calls}) == len(calls)
    assert final["usage"]["input_tokens"] == 120
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 100
    assert final["usage"]["total_tokens"] == 129
    # every item opened is closed, in order, before the response completes
    added = [e["output_index"] for k, e in stream if k == "response.output_item.added"]
    done = [e["output_index"] for k, e in stream if k == "response.output_item.done"]
    assert added == done == list(range(len(final["output"])))


def test_reasoning_item():
    stream = list(render({"input": "x"}, "m", events_of("reasoning", "reasoning", "text")))
    final = stream[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text",
                                              "text": "reasoning piece reasoning piece "}]
    assert "response.reasoning_text.delta" in [k for k, _ in stream]
    replay(stream)


def test_cut_short_is_incomplete():
    stream = list(render({"input": "x", "max_output_tokens": 1}, "m",
                         events_of("text", finish="length")))
    assert stream[-1][0] == "response.incomplete"
    final = stream[-1][1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert final["max_output_tokens"] == 1
    replay(stream)


def test_failure_mid_stream_is_response_failed():
    b = ResponseBuilder({"input": "x"}, "m")
    stream = b.start() + b.feed(Text("partial")) + b.fail("the model broke")
    assert stream[-1][0] == "response.failed"
    final = stream[-1][1]["response"]
    assert final["status"] == "failed" and final["error"]["message"] == "the model broke"
    # the open message is closed before the failure
    assert [k for k, _ in stream][-2] == "response.output_item.done"
    for _, ev in stream:
        STREAM_EVENT.validate_python(ev)
        assert "error" not in ev  # the SDK raises on a top-level "error" key


def test_output_fed_back_extends_the_conversation():
    """Codex re-sends the whole history with our output items in it: the next request's
    messages start with this one's, and the answer becomes one assistant turn."""
    body = {"instructions": "base", "input": [{"role": "user", "content": "go"}]}
    first = parse_request(body)
    final = list(render(body, "m", events_of("reasoning", "text", "call")))[-1][1]["response"]
    call_id = final["output"][-1]["call_id"]
    nxt = {**body, "input": body["input"] + final["output"] + [
        {"type": "function_call_output", "call_id": call_id, "output": "done"},
        {"role": "user", "content": "next"}]}
    second = parse_request(nxt)
    assert second.messages[:len(first.messages)] == first.messages
    turn = second.messages[len(first.messages)]
    assert turn == {"role": "assistant", "content": "text piece ", "reasoning": "reasoning piece ",
                    "tool_calls": [{"id": call_id, "type": "function", "function": {
                        "name": "shell", "arguments": "{\"cmd\": \"ls\"}"}}]}
    assert second.labels[:len(first.labels)] == first.labels


# -- real servers, the official client --------------------------------------------------------
# Every wait on a server is bounded by its progress (`mlx_kvcache.testing.waits`).
INSTRUCTIONS = "You are a coding agent. Keep answers short. " * 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from mlx_kvcache.testing import write_model_dir
    from mlx_kvcache.testing.agent_dirs import write_refusing_dir, write_tool_dir
    root = tmp_path_factory.mktemp("models")
    dirs = {k: write_model_dir(root / k, k) for k in ("llama", "qwen3_next")}
    # a Qwen-style template that raises on a system message after the first
    dirs["refusing"] = write_refusing_dir(root / "refusing")
    dirs["tool"] = write_tool_dir(root / "tool")
    return dirs


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    from mlx_kvcache.testing.servers import Server
    tmp = tmp_path_factory.mktemp("responses")
    with Server.ours(model_dirs["llama"], tmp / "ours.log", tmp, "--no-persist") as s:
        yield s


def client_of(s):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="local",
                         max_retries=0, timeout=None)


def conversation_items():
    """A conversation with a developer message mid-way, in Responses items and as chat."""
    items = [{"role": "developer", "content": "Sandbox: read-only."},
             {"role": "user", "content": [{"type": "input_text", "text": "What is in the "},
                                          {"type": "input_text", "text": "repository?"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Two files.", "annotations": []}]},
             {"type": "message", "role": "system", "content": "Reminder: be brief."},
             {"role": "user", "content": "Which ones?"}]
    chat = [{"role": "system", "content": INSTRUCTIONS},
            {"role": "system", "content": "Sandbox: read-only."},
            {"role": "user", "content": "What is in the repository?"},
            {"role": "assistant", "content": "Two files."},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": "Which ones?"}]
    return items, chat


def test_same_answer_as_chat_completions(server):
    items, chat = conversation_items()
    want = server.chat(chat, max_tokens=12)
    c = client_of(server)
    kw = dict(model="gpt-5-codex", instructions=INSTRUCTIONS, input=items, max_output_tokens=12,
              temperature=0)
    whole = c.responses.create(**kw)
    assert whole.model == "gpt-5-codex"  # the name the client sent, answered by the served model
    assert whole.output_text == want["choices"][0]["message"]["content"]
    assert whole.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == want["usage"]["completion_tokens"]
    status = "completed" if want["choices"][0]["finish_reason"] == "stop" else "incomplete"
    assert whole.status == status
    streamed, seqs, final = [], [], None
    for ev in c.responses.create(stream=True, **kw):
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            streamed.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seqs == list(range(len(seqs)))
    assert "".join(streamed) == whole.output_text == final.output_text
    assert final.status == status and final.id != whole.id
    # the whole prompt was read back from the cache this time (but the last token)
    assert final.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens - 1


@pytest.mark.parametrize("kind", ["llama", "qwen3_next", "refusing"])
def test_codex_session_reads_the_previous_prompt_from_cache(kind, model_dirs, tmp_path):
    """Codex's shape: the whole history every turn, ``prompt_cache_key``, a
    ``max_output_tokens=1`` probe first, non-function tools, reasoning and function-call
    items fed back, a developer message mid-session. Every turn after the first reads at
    least the whole previous prompt from the cache — on a hybrid model too, and where the
    template refuses the developer messages in place."""
    from mlx_kvcache.testing.servers import Server
    tools = CODEX_TOOLS
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "<permissions>workspace-write"}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "<environment_context>/repo"}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Fix the failing test, please."}]}]
    base = dict(model="gpt-5-codex", instructions=INSTRUCTIONS, tools=tools,
                tool_choice="auto", parallel_tool_calls=False, store=False,
                prompt_cache_key="019a-session", include=["reasoning.encrypted_content"])
    with Server.ours(model_dirs[kind], tmp_path / "ours.log", tmp_path, "--no-persist") as s:
        c = client_of(s)
        probe = c.responses.create(input=items, max_output_tokens=1, **base)
        assert probe.status == "incomplete" and probe.usage.output_tokens == 1
        assert probe.incomplete_details.reason == "max_output_tokens"
        prev = None
        for turn in range(5):
            final = None
            for ev in c.responses.create(input=items, max_output_tokens=6, stream=True, **base):
                if ev.type in ("response.completed", "response.incomplete"):
                    final = ev.response
            u = final.usage
            # the numbers of the log line and GET /v1/cache (listed once the answer ended)
            s.watch.wait("the request's log line").until(
                lambda: len(s.cache()["recent"]) >= turn + 2, poll=0.1)
            last = s.cache()["recent"][-1]
            assert (last["prompt_tokens"], last["cached_tokens"]) == \
                (u.input_tokens, u.input_tokens_details.cached_tokens)
            assert last.get("session") == "019a-session"
            if prev is not None:
                assert u.input_tokens > prev
                assert u.input_tokens_details.cached_tokens >= prev, (turn, u, s.cache()["recent"][-1])
            prev = u.input_tokens
            # Codex keeps the output items as they came, then the tool's answer
            items = items + [o.model_dump(exclude_none=True) for o in final.output] + [
                {"type": "reasoning", "id": f"rs_{turn}", "summary": [
                    {"type": "summary_text", "text": "Next I look at the tests."}]},
                {"type": "function_call", "call_id": f"call_{turn}", "name": "shell",
                 "arguments": json.dumps({"cmd": f"cat test_{turn}.py"})},
                {"type": "function_call_output", "call_id": f"call_{turn}",
                 "output": f"def test_{turn}(): assert {turn} == {turn}"}]
            if turn == 2:
                items.append({"type": "message", "role": "developer",
                              "content": [{"type": "input_text", "text": "Approvals: never."}]})


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    c = client_of(server)
    for kw in (dict(input=[{"type": "mystery"}]), dict(input="x", previous_response_id="resp_1"),
               dict(input="x", max_output_tokens=0), dict(input=[]),
               dict(input=[{"role": "user", "content": [{"type": "input_image",
                                                        "image_url": "data:,"}]}])):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", **kw)
        err = e.value.body
        assert err["type"] == "invalid_request_error" and err["message"]
    for raw in (b"{not json", b"[1, 2]", b'{"input": 5}'):
        status, body = server.request("POST", "/v1/responses", raw=raw)
        assert status == 400, (status, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    r = c.responses.create(model="m", input="still there?", max_output_tokens=3)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1


def test_tool_round_trip(model_dirs, tmp_path):
    """A function call out (streamed and not, parsed by mlx-lm's tool parser), its output
    back: the next turn reads the whole first prompt from the cache."""
    from mlx_kvcache.testing.agent_dirs import TOOL_CALL
    from mlx_kvcache.testing.servers import Server
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"type": "web_search"}]
    items = [{"role": "user", "content": "Weather in Paris?"}]
    with Server.ours(model_dirs["tool"], tmp_path / "ours.log", tmp_path, "--no-persist") as s:
        c = client_of(s)
        whole = c.responses.create(model="m", input=items, tools=tools, max_output_tokens=16,
                                   prompt_cache_key="s1")
        calls = [o for o in whole.output if o.type == "function_call"]
        assert whole.status == "completed" and len(calls) == 1, whole.output
        assert calls[0].name == TOOL_CALL["name"]
        assert json.loads(calls[0].arguments) == TOOL_CALL["arguments"]
        assert calls[0].call_id
        args, done = [], None
        for ev in c.responses.create(model="m", input=items, tools=tools, max_output_tokens=16,
                                     stream=True):
            if ev.type == "response.function_call_arguments.delta":
                args.append(ev.delta)
            if ev.type == "response.completed":
                done = ev.response
        assert json.loads("".join(args)) == TOOL_CALL["arguments"]
        assert [o.name for o in done.output if o.type == "function_call"] == ["get_weather"]
        nxt = items + [o.model_dump(exclude_none=True) for o in whole.output] + [
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
        again = c.responses.create(model="m", input=nxt, tools=tools, max_output_tokens=16,
                                   prompt_cache_key="s1")
        assert again.usage.input_tokens > whole.usage.input_tokens
        assert again.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens


# -- the HTTP glue, on a stand-in handler ----------------------------------------------------------
class FakeHandler:
    """What `serve_responses` uses of the live handler."""

    def __init__(self, body, raw=None):
        import io
        data = raw if raw is not None else json.dumps(body).encode()
        self.headers = {"Content-Length": str(len(data))}
        self.rfile, self.wfile = io.BytesIO(data), io.BytesIO()
        self.status, self.sent = None, {}
        self.response_generator = ScriptedGenerator()
        self.raw_body = None
        self.path = "/v1/responses"

    def send_response(self, code, message=None):
        self.status = code

    def send_header(self, k, v):
        self.sent[k] = v

    def end_headers(self):
        pass

    def by_api_key(self):
        return False

    def sse(self):
        out = []
        for block in self.wfile.getvalue().decode().split("\n\n"):
            lines = block.splitlines()
            if lines and lines[0].startswith("event: "):
                out.append((lines[0][7:], json.loads(lines[1][6:])))
        return out


def serve_with(monkeypatch, body, events=None, refusal=None, raw=None):
    from mlx_kvcache.serving.routes.agents import responses, wire
    closed = []

    def fake_run(generator, call, **kw):
        if refusal is not None:
            raise refusal
        return ScriptedAnswer(list(events), on_close=lambda: closed.append(True)), \
            Accounting(0, False)
    monkeypatch.setattr(wire, "run_call", fake_run)
    h = FakeHandler(body, raw)
    responses.serve_responses(h)
    return h, closed


def test_glue_streams_keepalives_and_a_failure(monkeypatch):
    evs = [Progress(10, 20), Text("par"), Failed("the answer failed: boom"), Text("never")]
    h, closed = serve_with(monkeypatch, {"model": "m", "input": "x", "stream": True}, evs)
    assert h.status == 200 and h.sent["Content-Type"] == "text/event-stream"
    assert b"keepalive" not in h.wfile.getvalue()  # a progress report alone writes nothing
    stream = h.sse()
    assert stream[-1][0] == "response.failed"
    assert stream[-1][1]["response"]["error"]["message"] == "the answer failed: boom"
    assert "never" not in h.wfile.getvalue().decode() and closed == [True]
    replay(stream)


def test_glue_whole_answer_and_errors(monkeypatch):
    h, closed = serve_with(monkeypatch, {"model": "m", "input": "x"}, events_of("text"))
    assert h.status == 200 and closed == [True]
    r = json.loads(h.wfile.getvalue())
    RESPONSE.validate_python(r)
    assert r["model"] == "m" and r["output"][0]["content"][0]["text"] == "text piece "
    h, _ = serve_with(monkeypatch, {"model": "m", "input": "x"}, [Failed("boom")])
    assert h.status == 500 and json.loads(h.wfile.getvalue())["error"]["message"] == "boom"
    # the front door's refusal, before any event, keeps its status and kind
    h, _ = serve_with(monkeypatch, {"model": "m", "input": "x"},
                      refusal=AgentRequestError("the server is stopping", 503, "overloaded_error"))
    assert h.status == 503
    assert json.loads(h.wfile.getvalue())["error"] == {
        "message": "the server is stopping", "type": "overloaded_error", "param": None,
        "code": None}
    h, _ = serve_with(monkeypatch, None, raw=b"\xff{")
    assert h.status == 400 and "not valid JSON" in json.loads(h.wfile.getvalue())["error"]["message"]


def test_glue_client_gone_ends_the_generation(monkeypatch):
    class Gone(FakeHandler):
        def __init__(self, *a):
            super().__init__(*a)
            self.writes = 0
            wfile = self.wfile

            class W:
                def write(_, data):
                    self.writes += 1
                    if self.writes > 1:
                        raise BrokenPipeError
                    wfile.write(data)

                def flush(_):
                    pass
            self.wfile = W()
    from mlx_kvcache.serving.routes.agents import responses, wire
    closed = []
    monkeypatch.setattr(wire, "run_call", runs(EndlessAnswer(
        Text("more"), on_close=lambda: closed.append(True))))
    responses.serve_responses(Gone({"model": "m", "input": "x", "stream": True}))
    assert closed == [True]
