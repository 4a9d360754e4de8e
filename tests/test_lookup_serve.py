"""Prompt lookup through `mlx-kvcache serve` on models that copy (`testing.copy_model`):
an answer repeating the user's text with a few changes — proposals accepted in long
runs, rejected inside a pass at each change (inside the hybrid's recurrent layers'
pass, past the window's wrap: the window is 8 tokens) — is plain decoding's on every
route, streamed and not, on the batch path (one row, and rows joining) and the
sequential one (a seed; --kv-bits); usage, the ``[cache]`` line and ``GET /v1/cache``
count what was proposed and accepted."""

import json
import threading
import time

import anthropic
import openai
import pytest

from mlx_kvcache.testing.copy_dirs import chain_table, write_copy_dir
from mlx_kvcache.testing.dirs import CHARS, SPECIALS
from mlx_kvcache.testing.servers import Server, answer, same_answer

IDS = {t: i for i, t in enumerate(SPECIALS + CHARS)}
TEXT = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: The answer: the text, one letter replaced, one dropped, a few added.
ANSWER = TEXT.replace("n", "!").replace("P", "").replace("9", "9+-*")
OTHER = "@#$%&=?~^|"  # a second chain (a completion of "@"), none of its tokens above
MESSAGES = [{"role": "user", "content": f"Copy this: {TEXT}"}]
LOGPROBS = dict(logprobs=True, top_logprobs=5)


def chains():
    return [[IDS["<|assistant|>"], *(IDS[c] for c in ANSWER), IDS["</s>"]],
            [IDS[c] for c in OTHER] + [IDS["</s>"]]]


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_next"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lookup-{request.param}")
    d = write_copy_dir(tmp / "model", request.param, succ=chain_table(chains(), len(IDS)))
    with Server.ours(d, tmp / "log.txt", tmp, "--trust-remote-code", "--no-persist") as s:
        s.kind = request.param
        yield s


def decoding_since(server, sent):
    return server.entry_since(sent)["decoding"]


def test_chat_is_plain_decodings_with_long_accepted_runs(server):
    """Batch path, one row: the same tokens and top-5 log-probs with lookup as without
    (the request's own prompt_lookup_num_tokens: 0), most tokens from accepted runs."""
    t0 = time.time()
    on = server.chat(MESSAGES, max_tokens=100, **LOGPROBS)
    d_on = decoding_since(server, t0)
    t1 = time.time()
    off = server.chat(MESSAGES, max_tokens=100, prompt_lookup_num_tokens=0, **LOGPROBS)
    d_off = decoding_since(server, t1)
    same_answer(on, off)
    assert answer(on)[0] == ANSWER
    n = len(ANSWER) + 1  # (and the end of sequence)
    assert d_off == dict(drafted_tokens=0, accepted_tokens=0, lookup_drafted_tokens=0,
                         lookup_accepted_tokens=0, forward_passes=n, passes_saved=0)
    assert d_on["lookup_accepted_tokens"] >= n // 2, d_on
    assert d_on["lookup_drafted_tokens"] > d_on["lookup_accepted_tokens"]  # the changes
    assert d_on["forward_passes"] + d_on["passes_saved"] == n
    assert d_on["forward_passes"] < 2 * n // 3  # (a hybrid replays what it kept of a rejected pass)
    details = on["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": d_on["accepted_tokens"],
                       "rejected_prediction_tokens": d_on["drafted_tokens"] - d_on["accepted_tokens"]}
    assert off["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    line = [ln for ln in server.tail(20000).splitlines() if "[cache]" in ln
            and "lookup drafted" in ln][-1]
    assert f"lookup drafted {d_on['lookup_drafted_tokens']} accepted {d_on['lookup_accepted_tokens']}" in line


def test_sequential_path_and_streams(server):
    """A seed sends the request down mlx-lm's sequential path (our decoder there); a
    stream and a text completion on the batch path: all plain decoding's answer."""
    t0 = time.time()
    seq = server.chat(MESSAGES, max_tokens=100, seed=7, temperature=0, **LOGPROBS)
    d = decoding_since(server, t0)
    same_answer(seq, server.chat(MESSAGES, max_tokens=100, seed=7, temperature=0,
                                 prompt_lookup_num_tokens=0, **LOGPROBS))
    assert d["lookup_accepted_tokens"] > len(ANSWER) // 2, d
    chunks = list(server.stream_chat(MESSAGES, max_tokens=100,
                                     stream_options={"include_usage": True}))
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c.get("choices"))
    assert text == ANSWER
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    # Sampling with a seed asks for the seed's samples: no lookup (a round draws as many
    # as it verifies, and that is timed); greedy with a seed keeps it (above).
    t1 = time.time()
    assert answer(server.chat(MESSAGES, max_tokens=100, seed=3, temperature=1.0))[0] == ANSWER
    assert "decoding" not in server.entry_since(t1)  # (mlx-lm's own decoding: nothing counted)
    # A text completion that opens the answer's turn itself.
    done = server.complete(f"<|user|>Copy this: {TEXT}</s><|assistant|>", max_tokens=100)
    assert done["choices"][0]["text"] == ANSWER


def test_agent_routes(server):
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                                 max_retries=0)
    t0 = time.time()
    r = client.messages.create(model="m", max_tokens=100, messages=MESSAGES,
                               extra_body={"temperature": 0})
    assert "".join(b.text for b in r.content if b.type == "text") == ANSWER
    assert decoding_since(server, t0)["lookup_accepted_tokens"] > 0
    with client.messages.stream(model="m", max_tokens=100, messages=MESSAGES,
                                extra_body={"temperature": 0}) as st:
        assert "".join(st.text_stream) == ANSWER
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                       max_retries=0)
    t1 = time.time()
    r = oa.responses.create(model="m", input=MESSAGES, max_output_tokens=100, temperature=0)
    assert r.output_text == ANSWER
    assert decoding_since(server, t1)["lookup_accepted_tokens"] > 0
    events = oa.responses.create(model="m", input=MESSAGES, max_output_tokens=100,
                                 temperature=0, stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER


def test_rows_join_the_batch_and_leave_it(server):
    """Two answers at once (mlx-lm steps both rows), then the longer alone (rounds again):
    each is its plain answer."""
    out = {}
    threads = [threading.Thread(target=lambda: out.update(long=server.chat(MESSAGES, 100))),
               threading.Thread(target=lambda: out.update(short=server.complete("@", 6)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answer(out["long"])[0] == ANSWER
    assert answer(out["short"])[0] == OTHER[1:7]


def test_bad_prompt_lookup_num_tokens_is_a_400(server):
    for bad in (-1, "3", 2.5, True):
        status, body = server.request("POST", "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 2, "prompt_lookup_num_tokens": bad})
        assert status == 400 and "prompt_lookup_num_tokens" in json.dumps(body), (bad, body)


def test_agent_routes_take_the_requests_own_setting(server):
    """``prompt_lookup_num_tokens`` on /v1/messages and /v1/responses: 0 decodes without
    proposals (the same answer); a bad one is a 400 naming it, on either route."""
    t0 = time.time()
    status, body = server.request("POST", "/v1/messages", {
        "model": "m", "max_tokens": 100, "messages": MESSAGES, "temperature": 0,
        "prompt_lookup_num_tokens": 0})
    assert status == 200, body
    assert "".join(b["text"] for b in body["content"] if b["type"] == "text") == ANSWER
    assert server.entry_since(t0).get("decoding", {}).get("lookup_drafted_tokens", 0) == 0
    for path, body in (("/v1/messages", {"model": "m", "max_tokens": 4, "messages": MESSAGES}),
                       ("/v1/responses", {"model": "m", "max_output_tokens": 4,
                                          "input": MESSAGES})):
        for bad in (-1, "3", True):
            status, out = server.request("POST", path, {**body, "prompt_lookup_num_tokens": bad})
            assert status == 400 and "prompt_lookup_num_tokens" in json.dumps(out), \
                (path, bad, out)


def test_kv_bits_and_switched_off(tmp_path):
    """--kv-bits (the sequential path, rows quantized from token 16 on) with lookup is
    plain decoding's; --no-prompt-lookup turns it off for every request."""
    d = write_copy_dir(tmp_path / "model", "llama_hd32", succ=chain_table(chains(), len(IDS)))
    with Server.ours(d, tmp_path / "log.txt", tmp_path, "--trust-remote-code", "--no-persist",
                     "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "16") as s:
        t0 = time.time()
        on = s.chat(MESSAGES, max_tokens=100, **LOGPROBS)
        assert decoding_since(s, t0)["lookup_accepted_tokens"] > len(ANSWER) // 2
        same_answer(on, s.chat(MESSAGES, max_tokens=100, prompt_lookup_num_tokens=0, **LOGPROBS))
    with Server.ours(d, tmp_path / "log2.txt", tmp_path, "--trust-remote-code", "--no-persist",
                     "--no-prompt-lookup") as s:
        t0 = time.time()
        r = s.chat(MESSAGES, max_tokens=100, prompt_lookup_num_tokens=8)
        assert answer(r)[0] == ANSWER
        assert decoding_since(s, t0)["drafted_tokens"] == 0
