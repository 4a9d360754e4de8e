"""The agents benchmark's tools: the scripted model's parallel calls and subagent script,
the recording proxy, and the cache-perfect replay reference (`testing.agent_replay`)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from mlx_kvcache.testing import scripted_model
from mlx_kvcache.testing.agent_replay import (Exchange, Recorder, classify, perfect,
                                              replay_ids, usage_of)
from mlx_kvcache.testing.agent_templates import CUE, SUBCUE, write_scripted_dir


def _answer(tok, script, messages, tools):
    """What the scripted model says after ``messages`` (its whole answer, decoded)."""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    ids = list(tok.encode(text, add_special_tokens=False))
    out = []
    while True:
        t = scripted_model.plan(script, np.asarray(ids + out))
        if t == script["eos"]:
            return tok.decode(out)
        out.append(t)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    from transformers import AutoTokenizer
    d = write_scripted_dir(
        tmp_path_factory.mktemp("parallel"), "qwen3",
        step_calls=[[("Agent", {"prompt": f"read a {SUBCUE}"}),
                     ("Agent", {"prompt": f"read b {SUBCUE}"})]],
        sub_calls=[[("Read", {"file_path": "/x"})]])
    return AutoTokenizer.from_pretrained(str(d)), json.loads((d / "config.json").read_text())["script"]


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("Agent", "Read")]


def test_a_step_calls_two_agents_at_once_and_their_results_end_the_loop(parallel):
    tok, script = parallel
    msgs = [{"role": "user", "content": f"go {CUE}"}]
    first = _answer(tok, script, msgs, TOOLS)
    assert first.count("<tool_call>") == 2 and '"read a <|t|>"' in first
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "Agent", "arguments": {"prompt": p}}}
             for i, p in enumerate(("a", "b"))]
    msgs += [{"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c0", "content": "launched"},
             {"role": "tool", "tool_call_id": "c1", "content": "launched"}]
    assert _answer(tok, script, msgs, TOOLS).endswith("All parts are read.")


def test_a_task_with_the_sub_cue_follows_the_sub_script_even_after_the_parents(parallel):
    tok, script = parallel
    fresh = [{"role": "user", "content": f"read a {SUBCUE}"}]
    assert '"name": "Read"' in _answer(tok, script, fresh, TOOLS)
    # a fork: the parent's conversation (its cue) and then the task
    fork = [{"role": "user", "content": f"go {CUE}"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": f"now read a {SUBCUE}"}]
    assert '"name": "Read"' in _answer(tok, script, fork, TOOLS)
    fork += [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "r", "type": "function", "function": {"name": "Read", "arguments": {}}}]},
             {"role": "tool", "tool_call_id": "r", "content": "text"}]
    assert _answer(tok, script, fork, TOOLS).endswith("All parts are read.")
    # the parent's own next question goes back to the main script
    parent = fork + [{"role": "user", "content": f"again {CUE}"}]
    assert _answer(tok, script, parent, TOOLS).count('"name": "Agent"') == 2


def test_perfect_replay_computes_what_no_earlier_prompt_and_answer_covers():
    a = ([1, 2, 3, 4], [5, 6])
    b = ([1, 2, 3, 4, 5, 6, 7], [8])       # extends a's prompt and answer: 1 new
    c = ([1, 2, 3, 9, 9], [1])             # a sibling of a: shares 3
    d = ([1, 2, 3, 4, 5, 6, 7, 8], [])     # b's prompt + answer exactly: one token
    e = ([7, 7], [])                       # nothing shared
    assert perfect([a, b, c, d, e]) == [4, 1, 2, 1, 2]


def test_usage_of_each_api_stream_and_body():
    msg = ('event: message_start\ndata: {"type":"message_start","message":{"usage":'
           '{"input_tokens":10,"cache_read_input_tokens":90,"cache_creation_input_tokens":5,'
           '"output_tokens":1}}}\n\ndata: {"type":"message_delta","usage":{"output_tokens":7}}\n')
    assert usage_of("/v1/messages", msg) == (105, 90)
    chat = ('data: {"choices":[]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":50,'
            '"prompt_tokens_details":{"cached_tokens":40}}}\n\ndata: [DONE]\n')
    assert usage_of("/v1/chat/completions", chat) == (50, 40)
    resp = json.dumps({"usage": {"input_tokens": 30, "input_tokens_details":
                                 {"cached_tokens": 20}}})
    assert usage_of("/v1/responses", resp) == (30, 20)
    assert usage_of("/v1/chat/completions", "data: {}\n") is None


def test_recorder_forwards_streams_and_records_each_request():
    class Up(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(3):
                self.wfile.write(f"data: {json.dumps({'k': k})}\n\n".encode())
            usage = {"prompt_tokens": len(body["messages"]),
                     "prompt_tokens_details": {"cached_tokens": 1}}
            self.wfile.write(f"data: {json.dumps({'usage': usage})}\n\n".encode())

    up = ThreadingHTTPServer(("127.0.0.1", 0), Up)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    import http.client
    try:
        with Recorder(up.server_address[1]) as rec:
            for agent in (None, "a1"):
                c = http.client.HTTPConnection("127.0.0.1", rec.port, timeout=30)
                heads = {"Content-Type": "application/json"}
                if agent:
                    heads["x-claude-code-agent-id"] = agent
                c.request("POST", "/v1/chat/completions?beta=true", json.dumps(
                    {"messages": [1, 2, 3], "tools": [{"name": "t"}]}), heads)
                got = c.getresponse().read().decode()
                assert got.count("data:") == 4
            ex = rec.exchanges
            assert [e.path for e in ex] == ["/v1/chat/completions"] * 2
            assert all(e.generation and e.usage == (3, 1) for e in ex)
            assert [classify(e) for e in ex] == ["main", "subagent"]
    finally:
        up.shutdown()
        up.server_close()


def test_the_replay_reads_a_token_log_line_only_once_it_parses(tmp_path):
    log = tmp_path / "tokens.jsonl"
    line = json.dumps({"prompt": [1, 2, 3], "answer": [4]}) + "\n"

    class Up(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with open(log, "a") as f:  # as a read racing a long append once saw it: a gap
                f.write(line[:12] + " " * (len(line) - 13) + "\n")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    up = ThreadingHTTPServer(("127.0.0.1", 0), Up)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    looks = []

    def logged(ready):
        looks.append(ready())  # the line with a gap is not one yet
        log.write_text(line)   # the append completes
        looks.append(ready())
    try:
        ex = Exchange(0.0, "POST", "/v1/chat/completions", {}, {"messages": []}, status=200)
        assert replay_ids([ex], up.server_address[1], log, logged) == [([1, 2, 3], [4])]
        assert looks == [False, True]
    finally:
        up.shutdown()
        up.server_close()
