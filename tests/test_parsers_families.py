"""The parsers against what they replace and what they serve:

* mlx-lm's entry reads a generated stream exactly as mlx-lm 0.32's own chat route does
  (same text, reasoning, calls) — on the scripted Qwen3 and GLM-4.5 models and the
  tool / thinking models, tool loops, a stop word and a token limit included — except that
  a call mlx-lm drops comes out as `UnreadCall` with its markup;
* the family model directories (gpt-oss, Llama 3.x, DeepSeek V3.1 / R1) load in mlx-lm and
  its chat route serves them (their calls come back as text there: no parser of its own),
  while the registry's parser reads the same tokens as calls; and a tool loop of several
  steps runs through each family's published template.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from mlx_kvcache.serving.parsers.base import Call, Reasoning, Text, UnreadCall
from mlx_kvcache.serving.parsers.registry import parser_for, prompt_state
from mlx_kvcache.testing.agent_dirs import (BAD_CALL, write_script_dir, write_thinking_dir,
                                            write_tool_dir)
from mlx_kvcache.testing.agent_templates import CUE, STEP_PATHS, write_scripted_dir
from mlx_kvcache.testing.family_dirs import FINAL, PARSER, THOUGHT, write_family_dir
from mlx_kvcache.testing.servers import Server

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
FAMILIES = ["gpt-oss", "llama3.1", "llama3.2", "deepseek-v3.1", "deepseek-r1"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("parser-dirs")
    out = {"qwen3": write_scripted_dir(root / "qwen3", "qwen3"),
           "glm45": write_scripted_dir(root / "glm45", "glm45"),
           "tool": write_tool_dir(root / "tool"), "thinking": write_thinking_dir(root / "think"),
           "script": write_script_dir(root / "script")}
    for fam in FAMILIES:
        out[fam] = write_family_dir(root / fam, fam)
    return out


@pytest.fixture(scope="module")
def stock(dirs, tmp_path_factory):
    """One stock ``mlx_lm server``; each request names the directory it runs on."""
    home = tmp_path_factory.mktemp("stock")
    with Server.stock(dirs["qwen3"], home / "stock.log", home, "--trust-remote-code") as s:
        yield s


def _tokenizer(d: Path):
    from mlx_lm.utils import load_tokenizer
    config = json.loads((d / "config.json").read_text())
    return load_tokenizer(d, eos_token_ids=config.get("eos_token_id"))


def _ask(stock, d: Path, messages, tools=None, **extra) -> Tuple[Dict[str, Any], List[int]]:
    """mlx-lm's chat route's answer (its message and finish reason) and its tokens."""
    r = stock.chat(messages, model=str(d), tools=tools, top_logprobs=0,
                   **{"max_tokens": 400, **extra})
    choice = r["choices"][0]
    return choice, [c["id"] for c in choice["logprobs"]["content"]]


def _feed(parser, tok, ids: List[int], finish: str) -> List[Any]:
    """``ids`` fed as mlx-lm's server decodes them (its batch path)."""
    detok = tok.detokenizer
    out: List[Any] = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if not (last and finish == "stop"):
            detok.add_token(t)
        if last:
            detok.finalize()
        out += parser.feed(t, detok.last_segment, finish if last else None)
    return out


def _read(d: Path, messages, tools, ids, finish_reason, stop_words=(), **template):
    """Our parser's outputs for mlx-lm's tokens: (text, reasoning, calls, unread, parser);
    the prompt (for its state) rendered as mlx-lm's chat route renders it."""
    from mlx_lm.server import process_message_content

    tok = _tokenizer(d)
    messages = copy.deepcopy(messages)
    process_message_content(messages)  # mlx-lm's: arguments become objects
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                     **template)
    parser = parser_for(tok)(tools, prompt_state(tok, prompt), stop_words)
    out = _feed(parser, tok, ids, "length" if finish_reason == "length" else "stop")
    text = "".join(o.text for o in out if isinstance(o, Text))
    reasoning = "".join(o.text for o in out if isinstance(o, Reasoning))
    calls = [(o.name, o.arguments) for o in out if isinstance(o, Call)]
    return text, reasoning, calls, [o for o in out if isinstance(o, UnreadCall)], parser


def _step_messages(k: int, family_args: bool = False) -> List[Dict[str, Any]]:
    """A user turn with ``k`` tool steps done (each call answered with its file's text)."""
    msgs: List[Dict[str, Any]] = [{"role": "user", "content": f"Read the notes {CUE}"}]
    for i in range(k):
        args = json.dumps({"path": STEP_PATHS[i]})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "read_file", "arguments": args}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"part {i}"})
    return msgs


CASES = [  # (dir, tool steps done, tools offered, extra request fields)
    ("qwen3", 0, True, {}), ("qwen3", 1, True, {}), ("qwen3", 3, True, {}),
    ("qwen3", 1, True, {"stop": ["notes/b"]}),      # a stop word inside the reasoning
    ("qwen3", 0, True, {"max_tokens": 60}),          # the token limit inside the call
    ("qwen3", 0, True, {"max_tokens": 20}),          # ... inside the reasoning
    ("glm45", 0, True, {}), ("glm45", 3, True, {}),
    ("tool", 0, True, {}), ("thinking", 0, False, {}), ("script", 0, True, {}),
]


@pytest.mark.parametrize("name,steps,offer,extra", CASES)
def test_mlx_lms_entry_reads_as_mlx_lms_chat_route(stock, dirs, name, steps, offer, extra):
    d = dirs[name]
    tools = TOOLS if offer else None
    messages = _step_messages(steps)
    choice, ids = _ask(stock, d, messages, tools, **extra)
    msg = choice["message"]
    text, reasoning, calls, unread, parser = _read(d, messages, tools, ids,
                                                   choice["finish_reason"],
                                                   extra.get("stop", ()))
    assert parser_for(_tokenizer(d)).name.startswith("mlx_lm")
    assert text == (msg.get("content") or "")
    assert reasoning == (msg.get("reasoning") or "")
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in msg.get("tool_calls") or []]
    assert parser.made_calls == bool(calls)
    # Where mlx-lm drops a call it cannot read, ours keeps its markup.
    if name == "script":
        assert not calls and unread == [UnreadCall(f"<tool_call>{BAD_CALL}</tool_call>",
                                                   unread[0].problem)]
    elif extra.get("max_tokens") == 60:
        assert choice["finish_reason"] == "length" and not calls
        assert len(unread) == 1 and unread[0].raw.startswith('<tool_call>\n{"name": "read_')
        assert not unread[0].raw.endswith("</tool_call>")
    else:
        assert not unread
    if extra.get("stop"):  # the stop word ended the answer and is taken out
        assert choice["finish_reason"] == "stop" and reasoning.startswith("\nStep 2: I read ")
        assert "notes/b" not in reasoning and not calls
    if extra.get("max_tokens") == 20:
        assert choice["finish_reason"] == "length" and reasoning and not calls
    if name == "qwen3" and steps == 3:
        assert text.strip() == "All parts are read."  # the loop's end: the tokens say so


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_dirs_load_and_mlx_lm_serves_their_calls_as_text(stock, dirs, fam):
    d = dirs[fam]
    messages = _step_messages(0)
    choice, ids = _ask(stock, d, messages, TOOLS)
    msg = choice["message"]
    assert not msg.get("tool_calls") and choice["finish_reason"] == "stop"
    raw = (msg.get("reasoning") or "") + (msg.get("content") or "")
    assert "read_file" in raw and "notes/a.txt" in raw  # the call, as mlx-lm's text
    text, reasoning, calls, unread, parser = _read(d, messages, TOOLS, ids, "stop")
    assert parser_for(_tokenizer(d)).name == PARSER[fam]
    assert calls == [("read_file", json.dumps({"path": STEP_PATHS[0]}))] and not unread
    assert parser.made_calls and not text.strip()
    reasons = fam in ("gpt-oss", "deepseek-r1")  # V3.1's template defaults thinking off
    assert reasoning.strip() == (THOUGHT.format(k=1, path=STEP_PATHS[0]) if reasons else "")


def _generate(model, tok, prompt: List[int], limit: int = 400) -> Tuple[List[int], str]:
    from mlx_lm.generate import stream_generate
    ids, finish = [], "length"
    for g in stream_generate(model, tok, prompt, max_tokens=limit):
        ids.append(g.token)
        if g.token in tok.eos_token_ids:
            finish = "stop"
            break
    return ids, finish


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_tool_loop_runs_through_each_family_template(dirs, fam):
    """Three calls, each answered, then the final answer: the model reads the rendered
    conversation (its template's, arguments as strings), the registry's parser its
    answers. gpt-oss keeps a call's analysis only until a final answer follows."""
    from mlx_lm import load

    model, tok = load(str(dirs[fam]), trust_remote_code=True)
    messages: List[Dict[str, Any]] = [{"role": "user", "content": f"Read the notes {CUE}"}]
    for step in range(4):
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        ids, finish = _generate(model, tok, prompt)
        parser = parser_for(tok)(TOOLS, prompt_state(tok, prompt))
        out = _feed(parser, tok, ids, finish)
        calls = [o for o in out if isinstance(o, Call)]
        thought = "".join(o.text for o in out if isinstance(o, Reasoning)).strip()
        if step < 3:
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [
                ("read_file", {"path": STEP_PATHS[step]})], (step, out)
            messages.append({"role": "assistant", "content": "", "thinking": thought,
                             "reasoning_content": thought, "tool_calls": [
                                 {"id": f"c{step}", "type": "function", "function": {
                                     "name": "read_file", "arguments": calls[0].arguments}}]})
            messages.append({"role": "tool", "tool_call_id": f"c{step}",
                             "content": f"part {step}"})
        else:
            assert not calls
            assert "".join(o.text for o in out if isinstance(o, Text)).strip() == FINAL
            messages.append({"role": "assistant", "content": FINAL})
    if fam == "gpt-oss":
        first = THOUGHT.format(k=1, path=STEP_PATHS[0])
        during = tok.decode(tok.apply_chat_template(messages[:3], tools=TOOLS,
                                                    add_generation_prompt=True))
        after = tok.decode(tok.apply_chat_template(
            messages + [{"role": "user", "content": f"And now? {CUE}"}], tools=TOOLS,
            add_generation_prompt=True))
        assert first in during and first not in after  # the analysis is dropped


@pytest.mark.parametrize("fam", ["deepseek-v3.1", "deepseek-r1"])
def test_deepseek_templates_need_arguments_as_strings(dirs, fam):
    """DeepSeek's published templates concatenate ``arguments``: mlx-lm's chat route,
    which turns them into an object before rendering, cannot render a DeepSeek tool loop."""
    tok = _tokenizer(dirs[fam])
    messages = _step_messages(1)
    assert "notes/a.txt" in tok.decode(tok.apply_chat_template(messages, tools=TOOLS,
                                                               add_generation_prompt=True))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"path": STEP_PATHS[0]}
    with pytest.raises(TypeError):
        tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
