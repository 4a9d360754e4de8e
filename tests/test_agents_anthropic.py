"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` against real `mlx-kvcache serve`
processes, the official ``anthropic`` SDK as the client: the same answers as the chat
route, the event sequence the SDK parses, honest usage, a tool round trip through mlx-lm's
tool-call parser, stop sequences, and malformed bodies answered 400 in Anthropic's shape
while the server keeps serving."""

from __future__ import annotations

import json
import time

import pytest

anthropic = pytest.importorskip("anthropic")

from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.agent_dirs import (  # noqa: E402
    ANSWER, LONG_THOUGHT, THOUGHT, TOOL_CALL, write_thinking_dir, write_tool_dir)
from mlx_kvcache.testing.servers import Server  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)


def _prompt(u) -> int:
    """The prompt's tokens by Anthropic's usage: its three input counts add up to it."""
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens

SYSTEM = "You are terse."
CONVO = [{"role": "user", "content": "Hello there, how are you today?"},
         {"role": "assistant", "content": "Fine."},
         {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                      {"type": "text", "text": "about ships."}]}]
GREEDY = {"temperature": 0}  # the 2026 SDK takes no sampling arguments: extra_body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    model = write_model_dir(root / "llama", "llama")
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist",
                     "--drop-lines", r"Current time: ") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="local",
                               max_retries=0)


def _chat(server, max_tokens=8, **extra):
    """The chat route's answer to the same conversation."""
    msgs = [{"role": "system", "content": SYSTEM}, *CONVO]
    return server.chat(msgs, max_tokens=max_tokens, temperature=0, **extra)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_answers_equal_the_chat_route(server, client):
    want = _chat(server)
    text = want["choices"][0]["message"]["content"]
    server.request("DELETE", "/v1/cache")
    r = client.messages.create(model="claude-sonnet-5", max_tokens=8, system=SYSTEM,
                               messages=CONVO, extra_body=GREEDY)
    assert _text(r) == text and r.model == "claude-sonnet-5"
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 8
    assert r.id.startswith("msg_") and r.role == "assistant" and r.type == "message"
    # Streamed, and on ?beta=true (Claude Code's path): the same, in the SDK's events.
    with client.beta.messages.stream(model="claude-opus-9", max_tokens=8, system=SYSTEM,
                                     messages=CONVO, extra_body=GREEDY) as st:
        kinds = [e.type for e in st]
        final = st.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.model == "claude-opus-9" and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") \
        < kinds.index("message_delta")


def test_raw_stream_events(server, client):
    n = client.messages.count_tokens(model="m", messages=CONVO).input_tokens
    raw = client.messages.create(model="m", max_tokens=4, messages=CONVO, stream=True,
                                 extra_body=GREEDY)
    events = list(raw)
    kinds = [e.type for e in events]
    start, delta = events[0].message.usage, events[-2].usage
    # message_start knows the prompt's length (and, on the batch path, what was restored);
    # message_delta has the final numbers.
    assert _prompt(start) == n
    assert _prompt(delta) == n and delta.output_tokens == 4
    assert kinds[:2] == ["message_start", "content_block_start"] or \
        kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "content_block_start",
                                "content_block_stop", "ping"}


def test_usage_is_honest_and_agrees_with_the_cache(server, client):
    server.request("DELETE", "/v1/cache")
    n = client.messages.count_tokens(model="m", system=SYSTEM, messages=CONVO).input_tokens
    assert n == _chat(server, max_tokens=1)["usage"]["prompt_tokens"]  # the prompt's tokens
    first = client.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=CONVO,
                                   extra_body=GREEDY).usage
    sent = time.time()
    again = client.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=CONVO,
                                   extra_body=GREEDY).usage
    recent = server.entry_since(sent)
    assert _prompt(again) == n
    assert again.cache_read_input_tokens == recent["cached_tokens"] == n - 1  # full hit
    assert again.input_tokens == recent["prompt_tokens"] - recent["cached_tokens"]
    # The chat route's request above stored the prompt: the first read all but one token.
    assert first.cache_read_input_tokens == n - 1
    # No cache_control breakpoint: nothing is reported as created; the three add up.
    assert again.cache_creation_input_tokens == first.cache_creation_input_tokens == 0
    assert _prompt(first) == n


def test_volatile_lines_do_not_break_the_prefix(server, client):
    def ask(minute):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cch={minute};\n"
                                           f"Current time: 12:{minute:02d}\nYou are terse."}]
        return client.messages.create(model="m", max_tokens=2, system=system, messages=CONVO,
                                      extra_body=GREEDY).usage
    server.request("DELETE", "/v1/cache")
    ask(1)
    sent = time.time()
    u = ask(2)
    assert u.input_tokens == 1  # everything but the last token, which is always computed
    assert server.entry_since(sent)["reuse"]["kind"] == "hit"


def test_stop_sequences(server, client):
    text = _chat(server, max_tokens=12)["choices"][0]["message"]["content"]
    # One character is one token here: stop at the first plain character after the start.
    i, c = next((i, c) for i, c in enumerate(text) if i >= 2 and c.isalnum()
                and "<" not in text[:i + 1])
    r = client.messages.create(model="m", max_tokens=12, system=SYSTEM, messages=CONVO,
                               stop_sequences=[c, "\x07never"], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == c
    assert _text(r) == text[:text.index(c)]


BAD = [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": "hi"}, "messages"),
    ({"model": "m", "max_tokens": 0, "messages": CONVO}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "content"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "video"),
    ({"model": "m", "max_tokens": 4, "messages": CONVO, "temperature": "hot"}, "temperature"),
    ({"model": "m", "max_tokens": 4, "messages": CONVO, "stop_sequences": [""]}, "stop_sequences"),
    ({"model": "m", "max_tokens": 4, "messages": CONVO, "stream": "yes"}, "stream"),
    ({"model": "m", "max_tokens": 4, "messages": CONVO, "tools": [{"description": "x"}]}, "name"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}, "input"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}, "images"),
    ({"model": "m", "max_tokens": 4, "system": 7, "messages": CONVO}, "system"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]},
     "content"),
]


@pytest.mark.parametrize("body,says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_bodies_get_anthropic_400s(server, body, says):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens"):
        status, out = server.request("POST", path, raw=raw)
        if path.endswith("count_tokens") and isinstance(body, dict) and \
                any(k in says for k in ("max_tokens", "temperature", "stop", "stream")):
            assert status == 200  # fields count_tokens does not read
            continue
        assert status == 400, (path, status, out)
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        assert says in out["error"]["message"], out


def test_server_keeps_serving_after_bad_input(server, client):
    for body, _ in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        server.request("POST", "/v1/messages", raw=raw)
    assert server.request("GET", "/health")[0] == 200
    r = client.messages.create(model="m", max_tokens=2, messages=CONVO, extra_body=GREEDY)
    assert r.usage.output_tokens == 2


def test_unknown_route_is_404(server):
    status, out = server.request("POST", "/v1/messages/nothing", body={})
    assert status == 404


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    model = write_tool_dir(root / "tool")
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist") as s:
        yield s


TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_tool_round_trip(tool_server):
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{tool_server.port}", api_key="x",
                            max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.messages.create(model="claude-sonnet-5", max_tokens=16, messages=msgs, tools=TOOLS)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == TOOL_CALL["name"] and call.input == TOOL_CALL["arguments"]
    assert call.id.startswith("toolu_")
    first_prompt = _prompt(r.usage)
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": "sunny, 21 C"}],
                                           "cache_control": {"type": "ephemeral"}}]}]
    sent = time.time()
    with c.messages.stream(model="claude-sonnet-5", max_tokens=16, messages=msgs,
                           tools=TOOLS) as st:
        kinds = [e.type for e in st]
        again = st.get_final_message()
    assert "input_json" in kinds
    assert again.stop_reason == "tool_use" and again.content[-1].input == TOOL_CALL["arguments"]
    # The tool result came back after the call it answers, rendered as the call was made.
    assert again.usage.cache_read_input_tokens >= first_prompt
    n = c.messages.count_tokens(model="m", messages=msgs, tools=TOOLS).input_tokens
    assert n == _prompt(again.usage)
    rendered = tool_server.entry_since(sent)
    assert rendered["prompt_tokens"] == n


def test_tool_choice_gives_the_template_what_it_allows(tool_server):
    """``none``: no tools reach the template; a named tool: only that one (a 400 when it
    is not among tools); ``any``: all of them (a template cannot force a call)."""
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{tool_server.port}", api_key="x",
                            max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    more = TOOLS + [{"name": "get_time", "description": "The time in a city",
                     "input_schema": {"type": "object", "properties": {}}}]

    def count(tools=None, **kw):
        return c.messages.count_tokens(model="m", messages=msgs, **(
            {"tools": tools} if tools else {}), **kw).input_tokens

    assert count(more, tool_choice={"type": "none"}) == count()
    assert count(more, tool_choice={"type": "tool", "name": "get_weather"}) == count(TOOLS)
    assert count(more, tool_choice={"type": "any"}) == count(more) > count(TOOLS) > count()
    status, out = tool_server.request("POST", "/v1/messages", body={
        "model": "m", "max_tokens": 4, "messages": msgs, "tools": more,
        "tool_choice": {"type": "tool", "name": "get_mood"}})
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    assert "get_mood" in out["error"]["message"] and "get_weather, get_time" in \
        out["error"]["message"]
    # With no tools given, the model answers as it would without tools (this one calls
    # its tool whatever it is told: a template cannot forbid a call either).
    r = c.messages.create(model="m", max_tokens=16, messages=msgs, tools=more,
                          tool_choice={"type": "none"})
    plain = c.messages.create(model="m", max_tokens=16, messages=msgs)
    assert [b.model_dump(exclude={"id"}) for b in r.content] == \
        [b.model_dump(exclude={"id"}) for b in plain.content]
    assert _prompt(r.usage) == count()


def test_concurrent_answers_equal_sequential_ones(server, client):
    import threading

    convos = [[{"role": "user", "content": f"Conversation number {i}: tell me something."}]
              for i in range(3)]

    def ask(msgs, stream):
        if stream:
            with client.messages.stream(model="m", max_tokens=6, messages=msgs,
                                        extra_body=GREEDY) as st:
                return _text(st.get_final_message())
        return _text(client.messages.create(model="m", max_tokens=6, messages=msgs,
                                            extra_body=GREEDY))

    want = [ask(m, False) for m in convos]
    server.request("DELETE", "/v1/cache")
    got = [None] * 3

    def go(i):
        got[i] = ask(convos[i], i % 2 == 0)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        server.watch.wait("a client thread").until(lambda: not t.is_alive())
    assert got == want


def test_a_client_leaving_mid_stream_leaves_the_server_serving(server, client):
    import socket

    body = json.dumps({"model": "m", "max_tokens": 4000, "stream": True,
                       "messages": [{"role": "user", "content": "Go on and on."}]}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"content_block_delta" not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        assert seen.split(b"\r\n", 1)[0].endswith(b"200 OK")
    # Gone mid-answer: the route notices at its next write and returns (mlx-lm's batch
    # path then drops the generation, as for a chat client that leaves).
    server.watch.wait("the abandoned answer's route to return").until(
        lambda: server.cache()["open_requests"] == 0)
    r = client.messages.create(model="m", max_tokens=2, messages=CONVO, extra_body=GREEDY)
    assert r.usage.output_tokens == 2


def test_thinking_out_and_back(tmp_path):
    model = write_thinking_dir(tmp_path / "think")
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x",
                                max_retries=0)
        msgs = [{"role": "user", "content": "Do it."}]
        with c.messages.stream(model="m", max_tokens=16, messages=msgs) as st:
            deltas = [e.delta.type for e in st if e.type == "content_block_delta"]
            r = st.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in r.content] == [("thinking", THOUGHT), ("text", ANSWER)]
        assert "thinking_delta" in deltas and "text_delta" in deltas
        assert r.stop_reason == "end_turn"
        first = _prompt(r.usage)
        # The turn sent back with its thinking renders as the model wrote it: the next
        # prompt reads the previous prompt and the whole answer from the cache.
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in r.content]},
                 {"role": "user", "content": "Again."}]
        again = c.messages.create(model="m", max_tokens=16, messages=msgs)
        assert again.usage.cache_read_input_tokens >= first + r.usage.output_tokens - 1
        # Thinking blocks are signed (Claude Code drops unsigned ones): streamed as a
        # signature_delta, the same signature whole; one coming back is rendered whatever
        # its signature (ours, another server's, none), and Claude Code's
        # context_management and betas are accepted.
        sig = r.content[0].signature
        assert sig and "signature_delta" in deltas
        assert again.content[0].type == "thinking" and again.content[0].signature == sig
        for signature in (sig, "c2lnbmVkIGVsc2V3aGVyZQ==", None):
            block = {"type": "thinking", "thinking": THOUGHT}
            if signature is not None:
                block["signature"] = signature
            back = msgs[:1] + [{"role": "assistant", "content": [
                block, {"type": "text", "text": ANSWER}]}, msgs[-1]]
            out = c.beta.messages.create(
                model="m", max_tokens=16, messages=back,
                betas=["context-management-2025-06-27", "interleaved-thinking-2025-05-14",
                       "fine-grained-tool-streaming-2025-05-14", "prompt-caching-2024-07-31"],
                context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
                thinking={"type": "enabled", "budget_tokens": 1024})
            assert [b.type for b in out.content] == ["thinking", "text"]
            assert _prompt(out.usage) == _prompt(again.usage)  # rendered alike


@pytest.mark.parametrize("path", ["batch", "sequential", "draft"])
def test_budget_tokens_caps_the_reasoning(tmp_path, path):
    model = write_thinking_dir(tmp_path / "long", long=True)
    extra = {"batch": [], "sequential": ["--kv-bits", "8", "--kv-group-size", "32",
                                         "--quantized-kv-start", "0"],
             # (fixed: the adaptive policy never drafts with a draft this large)
             "draft": ["--draft-model", str(model), "--draft-policy", "fixed"]}[path]
    msgs = [{"role": "user", "content": "Do it."}]
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist",
                     *extra) as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x",
                                max_retries=0)

        def blocks(r):
            return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                    for b in r.content]
        free = c.messages.create(model="m", max_tokens=32, messages=msgs)
        assert blocks(free) == [("thinking", LONG_THOUGHT), ("text", ANSWER)]
        # After three tokens of reasoning the end of thinking is forced; the model answers.
        capped = c.messages.create(model="m", max_tokens=32, messages=msgs,
                                   thinking={"type": "enabled", "budget_tokens": 3})
        assert blocks(capped) == [("thinking", LONG_THOUGHT[:3]), ("text", ANSWER)]
        assert capped.stop_reason == "end_turn"
        with c.messages.stream(model="m", max_tokens=32, messages=msgs,
                               thinking={"type": "enabled", "budget_tokens": 7}) as st:
            assert blocks(st.get_final_message()) == [("thinking", LONG_THOUGHT[:7]),
                                                      ("text", ANSWER)]
        # A budget the reasoning stays under changes nothing; the next request neither.
        roomy = c.messages.create(model="m", max_tokens=32, messages=msgs,
                                  thinking={"type": "enabled", "budget_tokens": 50})
        assert blocks(roomy) == blocks(free)
        assert blocks(c.messages.create(model="m", max_tokens=32, messages=msgs)) == blocks(free)
        # On every path the streamed message_start has the end's input counts (it waits
        # for the prompt cache's fetch), the cache's read included.
        events = list(c.messages.create(model="m", max_tokens=32, messages=msgs, stream=True))
        start, end = events[0].message.usage, events[-2].usage
        assert start.cache_read_input_tokens == end.cache_read_input_tokens > 0
        assert (start.input_tokens, _prompt(start)) == (end.input_tokens, _prompt(end))


def test_a_reasoning_budget_reads_where_the_reasoning_opened():
    import mlx.core as mx

    from mlx_kvcache.serving.engine.reasoning_budget import ReasoningBudget

    b = ReasoningBudget(2, start_id=5, end_id=6)
    logits = mx.zeros((1, 8))
    assert b.spent([1, 2, 3]) is None and b.spent([5, 1, 6, 2]) is None  # closed
    assert b.spent([5, 6, 5]) == 0 and b.spent([1, 5, 2, 3]) == 2
    assert (b(mx.array([1, 5, 2]), logits) == logits).all()  # one spent: free
    forced = b(mx.array([1, 5, 2, 3]), logits)
    assert forced.argmax().item() == 6 and mx.isinf(forced).sum().item() == 7
    assert (b(mx.array([5, 2, 3, 6, 4]), logits) == logits).all()  # reasoning over
    with pytest.raises(ValueError, match="positive"):
        ReasoningBudget(0, 5, 6)


def test_thinking_switch_reaches_a_template_that_honours_it(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_kvcache.serving.engine import templates

    plain = write_thinking_dir(tmp_path / "plain")
    model = write_thinking_dir(tmp_path / "switch", switch=True)
    assert not templates.honours_thinking(load_tokenizer(plain))
    assert templates.honours_thinking(load_tokenizer(model))
    msgs = [{"role": "user", "content": "Do it."}]
    on = {"type": "enabled", "budget_tokens": 2048}
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x",
                                max_retries=0)

        def blocks(r):
            return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                    for b in r.content]
        off = c.messages.create(model="m", max_tokens=16, messages=msgs,
                                thinking={"type": "disabled"})
        assert blocks(off) == [("text", ANSWER)]
        with c.messages.stream(model="m", max_tokens=16, messages=msgs, thinking=on) as st:
            assert blocks(st.get_final_message()) == [("thinking", THOUGHT), ("text", ANSWER)]
        assert blocks(c.messages.create(model="m", max_tokens=16, messages=msgs)) == \
            [("thinking", THOUGHT), ("text", ANSWER)]  # the template's default
        # The prompt as mlx-lm rendered it: off adds the empty "<think></think>".
        n = {k: c.messages.count_tokens(model="m", messages=msgs, thinking=t).input_tokens
             for k, t in (("on", on), ("off", {"type": "disabled"}))}
        assert n["off"] == n["on"] + 2
        assert _prompt(off.usage) == n["off"]
        status, out = s.request("POST", "/v1/messages", body={
            "model": "m", "max_tokens": 4, "messages": msgs, "thinking": {"type": "sometimes"}})
        assert status == 400 and "thinking" in out["error"]["message"]
        # The Responses API's reasoning.effort is the same switch.
        import openai
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x",
                           max_retries=0)
        quick = oc.responses.create(model="m", max_output_tokens=16, input="Do it.",
                                    reasoning={"effort": "none"})
        assert [o.type for o in quick.output] == ["message"]
        assert quick.output_text == ANSWER
        deep = oc.responses.create(model="m", max_output_tokens=16, input="Do it.",
                                   reasoning={"effort": "high", "summary": "auto"})
        assert [o.type for o in deep.output] == ["reasoning", "message"]
        assert deep.output_text == ANSWER
        assert quick.usage.input_tokens == n["off"] and deep.usage.input_tokens == n["on"]


def test_a_stop_refuses_in_anthropic_shape_and_ends_open_answers(tmp_path):
    import signal
    import threading

    model = write_model_dir(tmp_path / "llama", "llama")
    s = Server.ours(model, tmp_path / "log.txt", tmp_path, "--no-persist",
                    "--shutdown-grace", "120")
    try:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x", max_retries=0)
        events, box = [], {}

        def long_answer():
            try:
                with c.messages.stream(model="m", max_tokens=100_000, messages=CONVO) as st:
                    for e in st:
                        events.append(e)
                    box["final"] = st.get_final_message()
            except BaseException as e:  # inspected below
                box["error"] = e
        t = threading.Thread(target=long_answer, daemon=True)
        t.start()
        s.watch.wait("the first streamed delta").until(
            lambda: any(e.type == "content_block_delta" for e in events) or not t.is_alive())
        s.send_signal(signal.SIGTERM)

        def refused():
            status, out = s.request("POST", "/v1/messages", body={
                "model": "m", "max_tokens": 2, "messages": CONVO})
            return (status, out) if status == 503 else None
        status, out = s.watch.wait("the server to refuse new requests").until(refused)
        assert out == {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "the server is stopping"}}
        assert t.is_alive()  # the open answer goes on during the grace period
        s.send_signal(signal.SIGTERM)  # a second signal ends it now, properly
        s.watch.wait("the open answer to end").until(lambda: not t.is_alive())
        assert "error" not in box, box
        assert box["final"].stop_reason == "max_tokens"
        assert events[-1].type == "message_stop"
        assert s.wait_exit() == 0, s.tail()
    finally:
        s.stop()
