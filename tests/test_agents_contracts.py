"""The agent routes keep the APIs' contracts where a real session leans on them (issue 38):

* streams are never silent: Anthropic ``ping`` events, Responses ``: keep-alive`` comments,
  while the request waits, its prompt is processed and between tokens;
* tool calls are never lost: a call the model's parser cannot read comes back as the
  model's text with the stop reason that matches (``end_turn`` / ``completed``); a custom
  tool (Codex's ``apply_patch``) is offered as a function of one string and returned as a
  ``custom_tool_call``, and replayed from ``custom_tool_call`` / ``custom_tool_call_output``;
* an assistant message last is continued, not closed (Anthropic's prefill).

Real servers with scripted models (`agent_dirs`), the official ``anthropic`` and ``openai``
SDKs and raw HTTP; the keep-alive timer's own behaviour against scripted events in process.
"""

from __future__ import annotations

import http.client
import io
import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.serving.routes.agents import anthropic as messages_route  # noqa: E402
from mlx_kvcache.serving.routes.agents import responses as responses_route  # noqa: E402
from mlx_kvcache.serving.routes.agents import wire  # noqa: E402
from mlx_kvcache.serving.engine.answer import Progress  # noqa: E402
from mlx_kvcache.serving.parsers.base import Text  # noqa: E402
from mlx_kvcache.serving.routes.agents.call import AgentRequestError  # noqa: E402
from mlx_kvcache.serving.routes.agents.generation import Accounting  # noqa: E402
from fake_answers import ScriptedGenerator, FakeGenerator, ScriptedAnswer, finished  # noqa: E402
from mlx_kvcache.testing.agent_dirs import (  # noqa: E402
    BAD_CALL, PATCH, PATCH_CALL, SCRIPT_TEXT, write_script_dir, write_tool_dir)
from mlx_kvcache.testing.servers import Server  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)

PING = b'event: ping\ndata: {"type": "ping"}\n\n'
COMMENT = b": keep-alive\n\n"
#: The test servers' keep-alive interval (seconds): far below any prefill of `LONG`.
QUICK = "0.002"
#: A prompt whose prefill, in steps of 32 tokens, takes many keep-alive intervals.
LONG = "x" * 3000
GREEDY = {"temperature": 0}


# -- the keep-alive timer, against scripted events (no model, no clock) ------------------------
class _Handler:
    """What `wire.serve` writes to, with the body it reads."""

    def __init__(self, body) -> None:
        data = json.dumps(body).encode()
        self.headers = {"Content-Length": str(len(data))}
        self.rfile, self.wfile = io.BytesIO(data), io.BytesIO()
        self.status = None
        self.response_generator = ScriptedGenerator()
        self.raw_body = None
        self.path = "/v1/messages"

    def send_response(self, code, message=None):
        self.status = code

    def send_header(self, k, v):
        pass

    def end_headers(self):
        pass

    def by_api_key(self):  # (`CacheAPIHandler.by_api_key`: the cache namespace's source)
        return False


def _script(waits: int, refuse: bool = False):
    """A ``run`` for `wire.serve`: the request waits ``waits`` intervals for the generation
    thread (each a ``waiting()`` call), then answers "a", silence, "b", silence, done —
    or is refused."""
    def run(generator, call, waiting=None, every=None):
        for _ in range(waits):
            if waiting is not None:
                waiting()
        if refuse:
            raise AgentRequestError("no memory for this request", 503, "overloaded_error")
        return ScriptedAnswer([Progress(1, 5), None, Text("a"), None, None, Text("b"), None,
                               finished("stop", 5, 0, 2)]), Accounting(5, True)
    return run


def _served(route, body, run):
    h = _Handler(body)
    wire.serve(h, route, run)
    return h.status, h.wfile.getvalue()


def test_anthropic_pings_while_waiting_and_between_tokens():
    body = {"model": "m", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    status, out = _served(messages_route.ROUTE, body, _script(waits=2))
    assert status == 200
    # two pings while it waited (before message_start), the opening one, one in the
    # prefill's silence, one between the tokens per silent interval
    head, rest = out.split(b"event: message_start", 1)
    assert head == PING * 2
    first, second = rest.split(b'"text": "a"', 1)[1].split(b'"text": "b"', 1)
    assert first.count(PING) == 2 and second.split(b"message_delta", 1)[0].count(PING) == 1
    assert rest.split(b"event: content_block_start", 1)[0].count(PING) == 2  # start + silence
    # not streamed: nothing but the answer
    status, whole = _served(messages_route.ROUTE, {**body, "stream": False}, _script(waits=2))
    assert status == 200 and json.loads(whole)["content"] == [{"type": "text", "text": "ab"}]


def test_a_refusal_after_the_pings_began_is_an_error_event():
    body = {"model": "m", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    status, out = _served(messages_route.ROUTE, body, _script(waits=1, refuse=True))
    assert status == 200 and out.startswith(PING)
    err = json.loads(out.split(b"event: error\ndata: ", 1)[1])
    assert err == {"type": "error", "error": {"type": "overloaded_error",
                                              "message": "no memory for this request"}}
    # refused before the first interval passed: an HTTP status, as before
    status, out = _served(messages_route.ROUTE, body, _script(waits=0, refuse=True))
    assert status == 503 and json.loads(out)["error"]["type"] == "overloaded_error"
    status, out = _served(responses_route.ROUTE, {"input": "x", "stream": True},
                          _script(waits=1, refuse=True))
    assert status == 200 and out.startswith(COMMENT)
    ev = json.loads(out.split(b"event: error\ndata: ", 1)[1])
    from openai.types.responses import ResponseErrorEvent
    assert ResponseErrorEvent.model_validate(ev).message == "no memory for this request"


def test_responses_keep_alive_comments_while_waiting_and_between_tokens():
    status, out = _served(responses_route.ROUTE, {"model": "m", "input": "x", "stream": True},
                          _script(waits=3))
    assert status == 200
    head, rest = out.split(b"event: response.created", 1)
    assert head == COMMENT * 3
    between = rest.split(b'"delta": "a"', 1)[1].split(b'"delta": "b"', 1)[0]
    assert between.count(COMMENT) == 2
    # every SSE parser skips comment lines: the events parse as the SDK's
    from openai._streaming import SSEDecoder
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    kinds = [TypeAdapter(ResponseStreamEvent).validate_python(sse.json()).type
             for sse in SSEDecoder().iter_bytes(iter([out]))]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_keepalive_interval_is_the_constant_unless_the_environment_lowers_it(monkeypatch):
    monkeypatch.delenv(wire.KEEPALIVE_ENV, raising=False)
    assert wire.keepalive_interval() == wire.KEEPALIVE_S <= 10
    monkeypatch.setenv(wire.KEEPALIVE_ENV, "0.25")
    assert wire.keepalive_interval() == 0.25
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(wire.KEEPALIVE_ENV, bad)
        assert wire.keepalive_interval() == wire.KEEPALIVE_S


# -- a real server: the script model ------------------------------------------------------------
@pytest.fixture(scope="module")
def script(tmp_path_factory):
    root = tmp_path_factory.mktemp("script")
    model = write_script_dir(root / "script")
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist",
                     "--prefill-step-size", "32",
                     env={wire.KEEPALIVE_ENV: QUICK}) as s:
        s.model = model
        yield s


def _anthropic(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                               max_retries=0)


def _openai(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0)


def _raw(server, path, body) -> bytes:
    """The whole raw reply of a streamed request (the server closes the stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CAP)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        return r.read()
    finally:
        conn.close()


def _cold(model, messages, **kw):
    """The prompt's ids as the model's tokenizer renders it, without a server (the
    messages' content and call arguments prepared as mlx-lm's chat route prepares them)."""
    import copy

    from mlx_lm.server import process_message_content
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    messages = copy.deepcopy(messages)
    process_message_content(messages)
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return text, tok.encode(text, add_special_tokens=False)


def test_a_long_prefill_is_never_silent(script):
    body = {"model": "m", "max_tokens": 4, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "ab"}]}
    out = _raw(script, "/v1/messages", body)
    before = out.split(b"event: content_block_start", 1)[0]
    assert before.count(PING) > 1  # the opening ping, then while the prompt was processed
    # (another text: nothing of it in the cache yet)
    out = _raw(script, "/v1/responses", {"model": "m", "input": "y" * len(LONG), "stream": True,
                                         "max_output_tokens": 2, **GREEDY})
    assert out.split(b"event: response.output_item.added", 1)[0].count(COMMENT) >= 1
    # the same through the anthropic SDK's raw stream (its event iterator skips pings)
    with _anthropic(script).messages.with_streaming_response.create(
            model="m", max_tokens=4, stream=True, extra_body=GREEDY,
            messages=[{"role": "user", "content": "z" * len(LONG)}]) as r:
        lines = list(r.iter_lines())
    assert lines[:lines.index("event: content_block_start")].count("event: ping") > 1
    # the SDKs read such streams as if the keep-alives were not there
    with _anthropic(script).messages.stream(model="m", max_tokens=4, extra_body=GREEDY,
                                            messages=body["messages"][:1] + [
                                                {"role": "assistant", "content": "ab"}]) as st:
        assert st.get_final_message().content[0].text == SCRIPT_TEXT[2:6]


def test_an_unreadable_tool_call_comes_back_as_text(script):
    tools = [{"name": "get_weather", "description": "The weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    raw = f"<tool_call>{BAD_CALL}</tool_call>"
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    c = _anthropic(script)
    r = c.messages.create(model="m", max_tokens=16, messages=msgs, tools=tools, extra_body=GREEDY)
    assert [(b.type, b.text) for b in r.content] == [("text", raw)]
    assert r.stop_reason == "end_turn"
    with c.messages.stream(model="m", max_tokens=16, messages=msgs, tools=tools,
                           extra_body=GREEDY) as st:
        kinds = [e.type for e in st]
        final = st.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == raw
    assert "input_json" not in kinds
    o = _openai(script)
    fn = [{"type": "function", "name": "get_weather", "parameters": tools[0]["input_schema"]}]
    resp = o.responses.create(model="m", input="Weather in Paris?", tools=fn, **GREEDY)
    assert resp.status == "completed" and resp.output_text == raw
    assert [i.type for i in resp.output] == ["message"]
    with o.responses.stream(model="m", input="Weather in Paris?", tools=fn, **GREEDY) as st:
        final = st.get_final_response()
    assert final.status == "completed" and final.output_text == raw
    assert "is returned as text" in script.tail(20000)


def test_an_assistant_prefill_is_continued(script):
    c = _anthropic(script)
    msgs = [{"role": "user", "content": "Say the letters."},
            {"role": "assistant", "content": [{"type": "text", "text": "abc"}]}]
    r = c.messages.create(model="m", max_tokens=16, messages=msgs, extra_body=GREEDY)
    assert [b.text for b in r.content] == [SCRIPT_TEXT[3:]] and r.stop_reason == "end_turn"
    text, cold = _cold(script.model, [{"role": "user", "content": "Say the letters."},
                                      {"role": "assistant", "content": "abc"}],
                       continue_final_message=True, add_generation_prompt=False)
    assert text.endswith("<|assistant|>abc")  # open: no end of turn, no new turn
    assert c.messages.count_tokens(model="m", messages=msgs).input_tokens == len(cold)
    with c.messages.stream(model="m", max_tokens=16, messages=msgs, extra_body=GREEDY) as st:
        assert "".join(st.text_stream) == SCRIPT_TEXT[3:]
    # Responses: an input that ends with the assistant's text goes on from it
    o = _openai(script)
    resp = o.responses.create(model="m", **GREEDY, input=[
        {"role": "user", "content": "Say the letters."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "abcde"}]}])
    assert resp.output_text == SCRIPT_TEXT[5:] and resp.status == "completed"
    assert resp.usage.input_tokens == len(cold) + 2
    # a closed turn (the user spoke last) starts a new answer: the model's tool call
    assert c.messages.create(model="m", max_tokens=16, extra_body=GREEDY,
                             messages=msgs[:1]).content[0].text.startswith("<tool_call>")


# -- a real server: Codex's apply_patch -------------------------------------------------------
@pytest.fixture(scope="module")
def patcher(tmp_path_factory):
    root = tmp_path_factory.mktemp("patch")
    model = write_tool_dir(root / "patch", call=PATCH_CALL)
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist") as s:
        s.model = model
        yield s


APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: '
                                        '"*** Begin Patch" LF'}}


def test_custom_tool_round_trip(patcher):
    o = _openai(patcher)
    first = [{"role": "user", "content": [{"type": "input_text", "text": "Add hello.txt"}]}]
    resp = o.responses.create(model="gpt-5-codex", input=first, tools=[APPLY_PATCH], **GREEDY)
    (call,) = resp.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.input == PATCH and resp.status == "completed"
    with o.responses.stream(model="gpt-5-codex", input=first, tools=[APPLY_PATCH],
                            **GREEDY) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert kinds.count("response.custom_tool_call_input.delta") == 1
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.custom_tool_call_input.done") < kinds.index("response.output_item.done")
    assert final.output[0].type == "custom_tool_call" and final.output[0].input == PATCH
    # the next turn replays the call and its output, rendered as the model was offered it
    second = first + [{"type": "custom_tool_call", "call_id": call.call_id,
                       "name": "apply_patch", "input": call.input},
                      {"type": "custom_tool_call_output", "call_id": call.call_id,
                       "output": "Done!"}]
    again = o.responses.create(model="gpt-5-codex", input=second, tools=[APPLY_PATCH],
                               **GREEDY)
    body = {"input": second, "tools": [APPLY_PATCH]}
    parsed = responses_route.parse_request(body)
    assert parsed.messages[1]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": json.dumps({"input": PATCH})}
    assert parsed.tools[0]["function"]["parameters"]["required"] == ["input"]
    assert "lark grammar" in parsed.tools[0]["function"]["description"]
    text, cold = _cold(patcher.model, parsed.messages, tools=parsed.tools,
                       add_generation_prompt=True)
    assert "Done!" in text and "Begin Patch" in text
    assert again.usage.input_tokens == len(cold)
    assert again.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens - 1


def test_a_function_tool_call_streams_in_each_apis_shape(patcher):
    # the same call offered as a function: function_call / tool_use, arguments streamed
    fn = {"type": "function", "name": "apply_patch", "parameters": {
        "type": "object", "properties": {"input": {"type": "string"}}}}
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in
              _raw(patcher, "/v1/responses", {"model": "m", "input": "Patch it", "tools": [fn],
                                              "stream": True, **GREEDY}).split(b"\n\n")
              if block.startswith(b"event: ")]
    kinds = [e["type"] for e in events]
    assert kinds[kinds.index("response.output_item.added"):-1] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    done = events[kinds.index("response.function_call_arguments.done")]
    assert json.loads(done["arguments"]) == {"input": PATCH}
    tool = {"name": "apply_patch", "input_schema": fn["parameters"]}
    out = _raw(patcher, "/v1/messages", {"model": "m", "max_tokens": 16, "stream": True,
                                         "tools": [tool], **GREEDY,
                                         "messages": [{"role": "user", "content": "Patch it"}]})
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in out.split(b"\n\n")
              if block.startswith(b"event: ") and b"event: ping" not in block]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0]["partial_json"]) == {"input": PATCH}
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] \
        == "tool_use"


def test_a_thinking_models_prefill_gets_no_think_injected(tmp_path):
    # Thinking off, the template's generation prompt opens an empty <think></think>; a
    # continued prefill has no generation prompt, so none is injected before the answer.
    from types import SimpleNamespace

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_kvcache.serving.routes.agents.generation import count_tokens
    from mlx_kvcache.testing.agent_dirs import write_thinking_dir
    model = write_thinking_dir(tmp_path / "think", switch=True)
    handler = FakeGenerator(load_tokenizer(model))
    user = {"role": "user", "content": "Go."}
    body = {"model": "m", "thinking": {"type": "disabled"},
            "messages": [user, {"role": "assistant", "content": "Sure"}]}
    n = count_tokens(handler, messages_route.parse_request(body, count_only=True))
    text, cold = _cold(model, [user, {"role": "assistant", "content": "Sure"}],
                       continue_final_message=True, add_generation_prompt=False,
                       enable_thinking=False)
    assert text.endswith("<|assistant|>Sure") and n == len(cold)
    closed = count_tokens(handler, messages_route.parse_request(
        {**body, "messages": [user]}, count_only=True))
    text, cold = _cold(model, [user], add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think></think>") and closed == len(cold)


def test_a_chat_stream_gets_a_keepalive_comment_after_a_silent_interval(monkeypatch):
    # mlx-lm's chat route writes nothing while a tool call is open, or between slow
    # tokens: once its stream's headers are out, the generator's wait for the next token
    # calls the ticket's keep-alive, which writes a comment when an interval passed in
    # silence (and nothing otherwise).
    from types import SimpleNamespace

    from mlx_kvcache.serving.guards.lifecycle import Ticket, set_ticket
    from mlx_kvcache.serving.routes.handler import KEEPALIVE_ENV, CacheAPIHandler
    h = CacheAPIHandler.__new__(CacheAPIHandler)
    h.wfile, h.headers, h.request_version = io.BytesIO(), {}, "HTTP/1.1"
    h.requestline, h.command, h.client_address = "POST /v1/chat/completions HTTP/1.1", \
        "POST", ("127.0.0.1", 0)
    h.response_generator = SimpleNamespace(cli_args=SimpleNamespace(allowed_origins=["*"]))
    h.log_message = lambda *a: None
    ticket = Ticket()
    set_ticket(ticket)
    try:
        h._set_stream_headers(200)
        h.end_headers()
    finally:
        set_ticket(None)
    assert ticket.keepalive is not None
    head = h.wfile.getvalue()
    monkeypatch.setenv(KEEPALIVE_ENV, "3600")
    ticket.keepalive()  # written just now: nothing to add
    assert h.wfile.getvalue() == head
    monkeypatch.setenv(KEEPALIVE_ENV, "1e-9")
    ticket.keepalive()
    assert h.wfile.getvalue() == head + b": keepalive\n\n"
