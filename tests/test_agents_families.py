"""The families mlx-lm has no tool parser for — gpt-oss (harmony), Llama 3.x, DeepSeek V3.1
and R1 — answering with tool calls through both agent routes and the chat route, with the
official SDKs, streamed and not: each family's scripted model (`testing.family_dirs`: its
published chat template, its markup as whole tokens) runs a tool loop of several steps, the
client gets structured calls and the reasoning where the API carries it, every turn after
the first reads everything but its new tokens from cache (foresight computes the template's
rewrite of the answer ahead), and a call that does not parse comes back as text.
"""

from __future__ import annotations

import json

import pytest

import mlx_kvcache  # noqa: F401  (the fast BLAS first)

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.testing.agent_templates import CUE, STEP_PATHS  # noqa: E402
from mlx_kvcache.testing.family_dirs import FINAL, PARSER, write_family_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server  # noqa: E402

FAMILIES = ["gpt-oss", "llama3.1", "deepseek-v3.1", "deepseek-r1"]
#: Families whose scripted model reasons before each call (the API carries it back).
REASONS = {"gpt-oss", "deepseek-r1"}
STEPS = 3
#: Each tool result's text: the tokens the client adds per turn (one token per character).
RESULT = "0123456789abcdef" * 40
TOOL = {"name": "read_file", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"],
                                              "description": TOOL["description"],
                                              "parameters": TOOL["input_schema"]}}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = write_family_dir(root / "model", name, steps=STEPS)
    with Server.ours(model, root / "log.txt", root, "--no-persist", "--trust-remote-code",
                     "--max-tokens", "400") as s:
        yield name, s


def _settled(server):
    return server.watch.wait("foresight to settle").until(
        lambda: (lambda f: f if f["settled"] else None)(server.cache()["foresight"]), poll=0.02)


def _computed_within_new(computed: int, turn: int) -> None:
    """A turn after the first computes its new tokens (the tool result, or the user's
    message) and little more: the template's rewrite of the answer was computed ahead."""
    assert computed <= 1.05 * len(RESULT), (turn, computed)


def _user(text: str) -> str:
    return f"{text} {CUE}"


# -- Anthropic Messages ------------------------------------------------------------------------
def _anthropic_turn(c, msgs, stream: bool):
    kw = dict(model="m", max_tokens=400, tools=[TOOL], messages=msgs, system="You are an agent.",
              extra_body=GREEDY)
    if not stream:
        return c.messages.create(**kw)
    with c.messages.stream(**kw) as st:
        return st.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_loop(family, stream):
    name, s = family
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": _user(f"Read the notes ({name}, {stream}).")}]
    for k in range(STEPS + 1):
        r = _anthropic_turn(c, msgs, stream)
        kinds = [b.type for b in r.content if b.type != "text" or b.text.strip()]
        u = r.usage
        if k:
            _computed_within_new(u.input_tokens + u.cache_creation_input_tokens, k)
        if k < STEPS:
            assert r.stop_reason == "tool_use", r
            calls = [b for b in r.content if b.type == "tool_use"]
            assert [(b.name, b.input) for b in calls] == [("read_file", {"path": STEP_PATHS[k]})]
            assert kinds == (["thinking", "tool_use"] if name in REASONS else ["tool_use"])
        else:
            assert r.stop_reason == "end_turn"
            assert "".join(b.text for b in r.content if b.type == "text").strip() == FINAL
        # what Claude Code sends back: the blocks as they came, but whitespace-only text
        msgs.append({"role": "assistant", "content": [
            b.model_dump(exclude_none=True) for b in r.content
            if b.type != "text" or b.text.strip()]})
        _settled(s)
        if k < STEPS:
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": RESULT}
                for b in r.content if b.type == "tool_use"]})
    # a new question: templates that drop earlier reasoning (gpt-oss's analysis) rewrite
    # the history, computed ahead as well
    msgs.append({"role": "user", "content": _user(RESULT)})
    r = _anthropic_turn(c, msgs, stream)
    u = r.usage
    _computed_within_new(u.input_tokens + u.cache_creation_input_tokens, STEPS + 1)


# -- OpenAI Responses --------------------------------------------------------------------------
def test_responses_tool_loop(family):
    name, s = family
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0)
    items = [{"role": "user", "content": _user(f"Read the notes ({name}, responses).")}]
    tools = [{"type": "function", "name": TOOL["name"], "description": TOOL["description"],
              "parameters": TOOL["input_schema"]}]
    for k in range(STEPS + 1):
        r = c.responses.create(model="m", input=items, tools=tools, instructions="Agent.",
                               max_output_tokens=400, temperature=0.0)
        if k:
            _computed_within_new(r.usage.input_tokens
                                 - r.usage.input_tokens_details.cached_tokens, k)
        calls = [o for o in r.output if o.type == "function_call"]
        if k < STEPS:
            assert [(o.name, json.loads(o.arguments)) for o in calls] == \
                [("read_file", {"path": STEP_PATHS[k]})]
            assert any(o.type == "reasoning" for o in r.output) == (name in REASONS)
        else:
            assert not calls and r.output_text.strip() == FINAL
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call_output", "call_id": o.call_id, "output": RESULT}
                  for o in calls]
        _settled(s)


# -- chat completions ------------------------------------------------------------------------------
def _chat_turn(c, msgs, stream: bool):
    kw = dict(model="m", messages=msgs, tools=[CHAT_TOOL], max_tokens=400, temperature=0.0)
    if not stream:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [t.model_dump() for t in m.tool_calls or ()]
        return (r.choices[0].finish_reason, m.content or "", getattr(m, "reasoning", None) or "",
                calls, r.usage)
    text, reasoning, calls, finish, usage = "", "", {}, None, None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        usage = ch.usage or usage
        for choice in ch.choices:
            d = choice.delta
            text += d.content or ""
            reasoning += getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or ():
                e = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                "function": {"name": "", "arguments": ""}})
                e["function"]["name"] += tc.function.name or ""
                e["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return finish, text, reasoning, list(calls.values()), usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_tool_loop(family, stream):
    name, s = family
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "You are an agent."},
            {"role": "user", "content": _user(f"Read the notes ({name}, chat {stream}).")}]
    for k in range(STEPS + 1):
        finish, text, reasoning, calls, usage = _chat_turn(c, msgs, stream)
        if k:
            _computed_within_new(usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens,
                                 k)
        # (the front door's usage: what prompt lookup proposed, kept or not)
        d = usage.completion_tokens_details
        assert 0 <= d.accepted_prediction_tokens <= usage.completion_tokens
        assert d.rejected_prediction_tokens >= 0
        if k < STEPS:
            assert finish == "tool_calls"
            assert [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                    for t in calls] == [("read_file", {"path": STEP_PATHS[k]})]
            assert bool(reasoning.strip()) == (name in REASONS)
        else:
            assert finish == "stop" and not calls and text.strip() == FINAL
        answer = {"role": "assistant", "content": text, "tool_calls": calls or None}
        if reasoning:
            answer["reasoning_content"] = reasoning  # as OpenCode sends it back
        msgs.append({k2: v for k2, v in answer.items() if v is not None})
        msgs += [{"role": "tool", "tool_call_id": t["id"], "content": RESULT} for t in calls]
        _settled(s)


def test_the_start_log_names_the_parser(family):
    name, s = family
    assert f"output parser: {PARSER[name]}" in s.tail(200_000)


# -- a call that does not parse ------------------------------------------------------------------
@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """gpt-oss answering with a call whose arguments are cut off (no JSON object)."""
    root = tmp_path_factory.mktemp("broken")
    model = write_family_dir(root / "model", "gpt-oss", steps=1, broken=True)
    with Server.ours(model, root / "log.txt", root, "--no-persist", "--trust-remote-code") as s:
        yield s


def test_a_call_that_does_not_parse_comes_back_as_text(broken):
    s = broken
    a = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": _user("Read.")}]
    r = a.messages.create(model="m", max_tokens=300, tools=[TOOL], messages=msgs,
                          extra_body=GREEDY)
    text = "".join(b.text for b in r.content if b.type == "text")
    assert r.stop_reason == "end_turn" and "to=functions.read_file" in text
    assert not any(b.type == "tool_use" for b in r.content)  # (the stream's is closed)
    assert '{"path": "n<|call|>' in text
    with a.messages.stream(model="m", max_tokens=300, tools=[TOOL], messages=msgs,
                           extra_body=GREEDY) as st:
        final = st.get_final_message()
    assert final.stop_reason == "end_turn"
    assert '{"path": "n<|call|>' in "".join(b.text for b in final.content if b.type == "text")
    o = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0)
    r = o.chat.completions.create(model="m", messages=msgs, tools=[CHAT_TOOL], max_tokens=300,
                                  temperature=0.0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert '{"path": "n<|call|>' in r.choices[0].message.content
    assert "a tool call the model's parser cannot read" in s.tail(200_000)
