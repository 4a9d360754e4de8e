"""The typed front door (`serving.engine.answer`, which the agent routes call) against
mlx-lm's own chat route, on the scripted Qwen3 and GLM-4.5 models: the same conversation
sent through both gives the same prompt tokens and the same answer tokens (the server's
token log, ``MLX_KVCACHE_REQUEST_LOG``), and the same events — text, reasoning, tool calls
(names and arguments), the stop reason and the counts — streamed and not.
"""

from __future__ import annotations

import json

import pytest

import mlx_kvcache  # noqa: F401  (the fast BLAS first)

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.testing.agent_templates import CUE, STEP_PATHS, write_scripted_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server  # noqa: E402

SYSTEM = "You are a careful agent."
TOOL = {"name": "read_file", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
RESULT = "the notes say: " + "abc " * 20
STOP_OF = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length",
           "stop_sequence": "stop"}


@pytest.fixture(scope="module", params=["qwen3", "glm45"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = write_scripted_dir(root / "model", request.param, steps=2)
    log = root / "tokens.jsonl"
    with Server.ours(model, root / "log.txt", root, "--no-persist", "--trust-remote-code",
                     "--no-foresight", env={"MLX_KVCACHE_REQUEST_LOG": str(log)}) as s:
        yield s, log


def _conversations():
    """The conversations both routes get: a first question, then after each of two tool
    steps (the chat form, and the same as Anthropic messages)."""
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Read the notes {CUE}"}]
    msgs = [{"role": "user", "content": f"Read the notes {CUE}"}]
    yield chat, msgs
    for k in range(2):
        cid = f"call_{k}"
        chat = chat + [{"role": "assistant", "content": "",
                        "reasoning_content": f"Step {k + 1}: I call read_file next.\n",
                        "tool_calls": [{"id": cid, "type": "function", "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": STEP_PATHS[k]})}}]},
                       {"role": "tool", "tool_call_id": cid, "content": RESULT}]
        msgs = msgs + [{"role": "assistant", "content": [
                           {"type": "thinking", "thinking": f"Step {k + 1}: I call read_file "
                                                            "next.\n", "signature": "x"},
                           {"type": "tool_use", "id": cid, "name": "read_file",
                            "input": {"path": STEP_PATHS[k]}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid,
                                                     "content": RESULT}]}]
        yield chat, msgs


def _chat(c, msgs, stream):
    # (the key order the Anthropic route's conversion gives: the same rendered tools)
    tools = [{"type": "function", "function": {"name": TOOL["name"],
                                               "parameters": TOOL["input_schema"],
                                               "description": TOOL["description"]}}]
    kw = dict(model="m", messages=msgs, tools=tools, max_tokens=200, temperature=0.0)
    if not stream:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        return {"text": m.content or "", "reasoning": getattr(m, "reasoning", None) or "",
                "calls": [(t.function.name, json.loads(t.function.arguments))
                          for t in m.tool_calls or ()],
                "stop": r.choices[0].finish_reason, "prompt": r.usage.prompt_tokens,
                "output": r.usage.completion_tokens}
    out = {"text": "", "reasoning": "", "calls": {}, "stop": None}
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        if ch.usage:
            out["prompt"], out["output"] = ch.usage.prompt_tokens, ch.usage.completion_tokens
        for choice in ch.choices:
            d = choice.delta
            out["text"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or ():
                e = out["calls"].setdefault(tc.index, ["", ""])
                e[0] += tc.function.name or ""
                e[1] += tc.function.arguments or ""
            out["stop"] = choice.finish_reason or out["stop"]
    out["calls"] = [(n, json.loads(a)) for n, a in out["calls"].values()]
    return out


def _messages(c, msgs, stream):
    kw = dict(model="m", max_tokens=200, system=SYSTEM, tools=[TOOL], messages=msgs,
              extra_body={"temperature": 0.0})
    if stream:
        with c.messages.stream(**kw) as st:
            r = st.get_final_message()
    else:
        r = c.messages.create(**kw)
    u = r.usage
    return {"text": "".join(b.text for b in r.content if b.type == "text"),
            "reasoning": "".join(b.thinking for b in r.content if b.type == "thinking"),
            "calls": [(b.name, b.input) for b in r.content if b.type == "tool_use"],
            "stop": STOP_OF[r.stop_reason],
            "prompt": u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
            "output": u.output_tokens}


def _logged(server, log, n):
    """The first ``n`` finished requests of the token log, once it has them (each is written
    as its request ends, which may come after its answer was sent): (prompt, answer) ids."""
    def read():
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] \
            if log.exists() else []
        return lines if len(lines) >= n else None
    lines = server.watch.wait("the token log").until(read, poll=0.02)
    return [(r["prompt"], r["answer"]) for r in lines[:n]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_front_door_equals_mlx_lms_chat_route(served, stream):
    s, log = served
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="x", max_retries=0)
    start = len(log.read_text().splitlines()) if log.exists() else 0
    for n, (chat, msgs) in enumerate(_conversations()):
        theirs = _chat(oa, chat, stream)   # mlx-lm's chat route
        ours = _messages(an, msgs, stream)  # the front door
        tokens = _logged(s, log, start + 2 * n + 2)[-2:]
        assert tokens[0] == tokens[1]  # the same prompt, the same answer, token for token
        # the text Anthropic's client keeps (it drops whitespace-only text blocks)
        assert ours["text"].strip() == theirs["text"].strip()
        assert {**ours, "text": None} == {**theirs, "text": None}
        assert ours["calls"] or ours["text"]
