"""The agent routes (and mlx-lm's chat route through our handler) under hostile and heavy
input (issue 39): the served model's tokenizer after a chat request loaded another model,
a 4xx in the route's shape for every malformed body, bounded work per request, images
neither fetched nor decoded unless allowed, a client that leaves stopping its request, and
Responses options that are not implemented refused by name. Raw HTTP where the problem is
the bytes, the official SDKs where a user would meet it."""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from mlx_kvcache.serving.routes.agents import conversation, responses  # noqa: E402
from mlx_kvcache.serving.routes.agents.call import SkippedTools  # noqa: E402
from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.agent_dirs import (  # noqa: E402
    write_char_tokenizer, write_tool_template_dir)
from mlx_kvcache.testing.dirs import CHAT_TEMPLATE, DIR_VOCAB  # noqa: E402
from mlx_kvcache.testing.servers import Server, peak_rss_kib  # noqa: E402
from mlx_kvcache.testing.vision_dir import black_png  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)

GREEDY = {"temperature": 0}
CONVO = [{"role": "user", "content": "Hello there, how are you today?"}]
AGENT_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
#: Words model B's tokenizer holds as one token each (model A spells them by character).
B_WORDS = ["Hello", "there", "how", "are", "you", "today"]


def _write_b(path: Path) -> Path:
    """Model B: another llama whose vocabulary has `B_WORDS` as whole tokens."""
    write_model_dir(path, "llama", seed=7, vocab_size=DIR_VOCAB + len(B_WORDS))
    assert write_char_tokenizer(path, CHAT_TEMPLATE, B_WORDS) == DIR_VOCAB + len(B_WORDS)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return root, write_model_dir(root / "a", "llama"), _write_b(root / "b")


@pytest.fixture(scope="module")
def server(dirs):
    root, a, _ = dirs
    with Server.ours(a, root / "log.txt", root / "home", "--no-persist",
                     "--body-timeout", "1", "--max-body-bytes", "8M",
                     "--allow-model-switch") as s:
        yield s


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    from mlx_kvcache.testing.vision_dir import write_vision_dir

    return write_vision_dir(tmp_path_factory.mktemp("vision") / "muse_spark")


@pytest.fixture(scope="module")
def vision(vision_dir, tmp_path_factory):
    """A model with an image processor (its directory's code: --trust-remote-code)."""
    root = tmp_path_factory.mktemp("vision_server")
    with Server.ours(vision_dir, root / "log.txt", root, "--no-persist",
                     "--trust-remote-code") as s:
        yield s


def _messages(server, path="/v1/messages", **extra):
    body = {"model": "m", "max_tokens": 6, "messages": CONVO, **GREEDY, **extra}
    status, out = server.request("POST", path, body)
    assert status == 200, (status, out, server.tail())
    return out


def _responses(server, **extra):
    body = {"model": "m", "input": CONVO[0]["content"], "max_output_tokens": 6, **GREEDY,
            **extra}
    status, out = server.request("POST", "/v1/responses", body)
    assert status == 200, (status, out, server.tail())
    return out


def _text(msg) -> str:
    return "".join(b["text"] for b in msg["content"] if b["type"] == "text")


# -- 1. never a wrong tokenizer -------------------------------------------------------------
def test_a_model_switch_leaves_the_agent_routes_on_the_served_tokenizer(server, dirs):
    _, _, b = dirs
    server.request("DELETE", "/v1/cache")
    n = _messages(server, "/v1/messages/count_tokens")["input_tokens"]
    sent = time.time()
    cold = _messages(server)
    cold_entry = server.entry_since(sent)
    cold_r = _responses(server)
    assert cold_entry["prompt_tokens"] == n
    # A chat request naming model B (a local path: mlx-lm loads it) ...
    status, out = server.request("POST", "/v1/chat/completions", {
        "model": str(b), "messages": CONVO, "max_tokens": 2, "temperature": 0})
    assert status == 200, (status, out)
    assert out["usage"]["prompt_tokens"] < n  # B's vocabulary spells the words whole
    # ... and the agent routes still encode with, and run on, the served model A.
    assert _messages(server, "/v1/messages/count_tokens")["input_tokens"] == n
    server.request("POST", "/v1/chat/completions", {
        "model": str(b), "messages": CONVO, "max_tokens": 2, "temperature": 0})
    sent = time.time()
    again = _messages(server)
    entry = server.entry_since(sent)
    assert _text(again) == _text(cold) and again["usage"]["output_tokens"] == 6
    assert entry["prompt_tokens"] == n
    # What it stored is A's ids of this prompt, and the switch to B and back kept it: the
    # same request again reads all but the last token from the cache.
    assert entry["cached_tokens"] == n - 1
    sent = time.time()
    assert _text(_messages(server)) == _text(cold)
    assert server.entry_since(sent)["cached_tokens"] == n - 1
    server.request("POST", "/v1/chat/completions", {
        "model": str(b), "messages": CONVO, "max_tokens": 2, "temperature": 0})
    r = _responses(server)
    assert r["output"][0]["content"][0]["text"] == cold_r["output"][0]["content"][0]["text"]
    assert r["usage"]["input_tokens"] == cold_r["usage"]["input_tokens"]


# -- 2. every malformed body gets a 4xx in its route's shape --------------------------------
def _shape_ok(path: str, out) -> bool:
    if path.startswith("/v1/messages"):
        return out["type"] == "error" and out["error"]["type"] in (
            "invalid_request_error", "request_too_large")
    if path == "/v1/responses":
        return set(out["error"]) >= {"message", "type", "param", "code"}
    # mlx-lm's chat route: its string, or OpenAI's error object where ours refuses first
    err = out.get("error")
    return isinstance(err, str) or isinstance(err, dict) and isinstance(err.get("message"), str)


ALL_ROUTES = (*AGENT_ROUTES, "/v1/chat/completions")


@pytest.mark.parametrize("raw,says", [
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "too deeply"),
    (b"\xff\xfe{}", "UTF-8"),
], ids=["nested-arrays", "nested-objects", "not-utf8"])
def test_bodies_the_json_reader_chokes_on_get_400(server, raw, says):
    for path in ALL_ROUTES:
        status, out = server.request("POST", path, raw=raw)
        assert status == 400 and _shape_ok(path, out), (path, status, out)
        msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
        assert says in msg, (path, msg)
    assert server.request("GET", "/health")[0] == 200


def test_a_non_object_body_gets_400(server):
    for path in ALL_ROUTES:
        for raw in (b"[1, 2]", b'"text"', b"7", b"null"):
            status, out = server.request("POST", path, raw=raw)
            assert status == 400 and _shape_ok(path, out), (path, raw, status, out)


SURROGATES = [
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a\ud800b"}]}]}, "input[0].content[0].text"),
    ("/v1/responses", {"model": "m", "input": "x", "instructions": "\udfff"}, "instructions"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {"q": "\ud800"}}]}]},
     "messages[1].content[0].input.q"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": CONVO, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {
            "q": {"type": "string", "description": "\ud834"}}}}]},
     "tools[0].input_schema.properties.q.description"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": CONVO, "tools": [
        {"name": "f", "input_schema": {"type": "object", "\udc00": 1}}]}, "input_schema"),
    # mlx-lm's routes, through our handler
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"max_tokens": 2, "messages": CONVO, "tools": [
        {"type": "function", "function": {"name": "f", "description": "\udfff",
                                          "parameters": {}}}]},
     "tools[0].function.description"),
    ("/v1/completions", {"max_tokens": 2, "prompt": "x\ud800"}, "prompt"),
]


@pytest.mark.parametrize("path,body,where", SURROGATES, ids=[w for _, _, w in SURROGATES])
def test_lone_surrogates_are_named_in_a_400(server, path, body, where):
    status, out = server.request("POST", path, raw=json.dumps(body).encode())
    assert status == 400 and _shape_ok(path, out), (status, out)
    msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
    assert where in msg and "surrogate" in msg, msg
    if path == "/v1/responses":
        assert out["error"]["param"].startswith(where.split(".")[0])
    # a surrogate pair is text, and served
    ok = json.loads(json.dumps(body).replace("\\ud800", "\\ud83d\\ude00"))
    if "\\ud800" in json.dumps(body):
        assert server.request("POST", path, raw=json.dumps(ok).encode())[0] == 200


def _raw_http(server, head: bytes, body: bytes = b"", half_close: bool = False) -> bytes:
    """What the server answers ``head`` (request line and headers) and ``body`` on a raw
    socket, reading until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=CAP) as s:
        s.sendall(head + body)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def _status_and_json(reply: bytes):
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_content_length_over_the_cap_is_413_unread(server):
    for path in ALL_ROUTES:
        reply = _raw_http(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                  f"application/json\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
        status, out = _status_and_json(reply)
        assert status == 413 and _shape_ok(path, out), (path, reply[:300])
        msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
        assert "--max-body-bytes" in msg


@pytest.mark.parametrize("half_close", [True, False], ids=["client-closed", "client-stalled"])
def test_a_body_shorter_than_its_length_is_400_not_a_hang(server, half_close):
    # The client announces 1000 bytes and sends 10: closed, the server reads EOF at once
    # (400); stalled, it waits out --body-timeout (1 s here), then answers 408.
    for path in ALL_ROUTES:
        reply = _raw_http(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000"
                                  "\r\n\r\n".encode(), b'{"model": ', half_close=half_close)
        status, out = _status_and_json(reply)
        assert status == (400 if half_close else 408) and _shape_ok(path, out), \
            (path, reply[:300])
        msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
        assert "10 of the 1000 bytes" in msg
    assert server.request("GET", "/health")[0] == 200


# -- 4. bounded work per request -----------------------------------------------------------
def _marked_tools(n: int, marked: int):
    return [{"name": f"tool_{k}", "description": "d", "input_schema": {"type": "object"},
             **({"cache_control": {"type": "ephemeral"}} if k >= n - marked else {})}
            for k in range(n)]


def test_more_than_four_cache_control_blocks_get_anthropics_400(server):
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                                 max_retries=0)
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"part {k} ",
                                          "cache_control": {"type": "ephemeral"}}
                                         for k in range(300)]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=2, messages=msgs, extra_body=GREEDY)
    assert e.value.status_code == 400
    assert "A maximum of 4 blocks with cache_control may be provided. Found 300." in str(e.value)
    # 1,000 marked tools: refused before anything is rendered
    status, out = server.request("POST", "/v1/messages", {
        "model": "m", "max_tokens": 2, "messages": CONVO, "tools": _marked_tools(1000, 1000)})
    assert status == 400 and "Found 1000." in out["error"]["message"]
    # Two marked tools, a marked system block and a marked message: four, served.
    r = client.messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        tools=_marked_tools(5, 2), extra_body=GREEDY)
    assert r.usage.output_tokens == 2


class _CountingTokenizer:
    """A tokenizer that counts its chat template renders."""

    def __init__(self, tokenizer) -> None:
        self._t, self.renders = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self._t, name)

    def apply_chat_template(self, *a, **kw):
        self.renders += 1
        return self._t.apply_chat_template(*a, **kw)


def test_rendering_is_a_bounded_number_of_renders(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = write_tool_template_dir(tmp_path / "tools")
    tok = _CountingTokenizer(load_tokenizer(path))  # (`TOOL_TEMPLATE`: renders each tool)
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "parameters": {}}}
             for k in range(1000)]
    msgs = [{"role": "user", "content": "hi"}]
    conv = conversation.Conversation.from_call(msgs, breakpoints=[(0, 0)])
    lay = conversation.layout(tok, conv, tools, marked_tools=[996, 997, 998, 999])
    # one render of the prompt, two per marked tool (at most four marks: the API's cap)
    assert tok.renders <= 1 + 2 * 4 and len(lay.cuts) >= 2
    unmarked = _CountingTokenizer(tok._t)
    conversation.layout(unmarked, conversation.Conversation.from_call(msgs), tools)
    assert unmarked.renders == 1


def test_parts_a_template_rewrites_cost_a_bounded_number_of_scans(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    # A template that trims each message: a part starting with a space is never found
    # as sent, and each look for it scanned the rest of the prompt (parts x prompt).
    trimming = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    write_char_tokenizer(tmp_path, trimming)
    tok = load_tokenizer(tmp_path)
    n = 3000
    msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": " x"} for k in range(n)]
    lay = conversation.layout(tok, conversation.Conversation.from_call(msgs), None)
    # Two scans' worth of misses (~the prompt's length in characters each, ~4 characters
    # a message): the layout stopped naming messages after a few, not after all 3,000.
    assert 0 < len(lay.marks) < n // 100
    assert lay.prompt_tokens == len(tok.apply_chat_template(msgs, add_generation_prompt=True))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_unique_tool_types_are_not_remembered_or_logged_each(server):
    log = Path(server.log)
    before_log, before_rss = log.stat().st_size, _rss_kib(server.proc.pid)
    pad = "x" * 200
    for rnd in range(3):
        tools = [{"type": f"tool_type_{rnd}_{k}_{pad}"} for k in range(10_000)]
        body = {"model": "m", "input": "hi", "max_output_tokens": 1, "tools": tools}
        status, out = server.request("POST", "/v1/responses", body)
        assert status == 200, out
        mtools = [{"type": f"server_{rnd}_{k}_{pad}", "name": "x"} for k in range(10_000)]
        status, out = server.request("POST", "/v1/messages/count_tokens",
                                     {"model": "m", "messages": CONVO, "tools": mtools})
        assert status == 200, out
    # 60,000 distinct ~220-character type strings (13 MB) were sent: the log grew by a few
    # lines, the process by no copy of them.
    grown = log.stat().st_size - before_log
    assert grown < 20_000, grown
    assert _rss_kib(server.proc.pid) - before_rss < 30_000
    # in process: a fixed number of names kept, each cut short
    skipped = SkippedTools("test")
    for rnd in range(20):
        skipped.note([f"t{rnd}_{k}_{pad}" for k in range(10_000)])
    assert len(skipped) == SkippedTools.KEPT
    # (this worker may have parsed requests with skipped tool types in other tests)
    assert len(responses.SKIPPED) <= SkippedTools.KEPT


def _image_bodies(url: str, b64: str = ""):
    """The same image to every route, in each route's form."""
    anth_src = ({"type": "base64", "media_type": "image/png", "data": b64} if b64
                else {"type": "url", "url": url})
    anth = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": anth_src}, {"type": "text", "text": "what?"}]}]}
    return [("/v1/messages", anth), ("/v1/messages/count_tokens", anth),
            ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url},
                {"type": "input_text", "text": "what?"}]}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what?"}]}], "max_tokens": 2})]


def test_an_image_over_the_pixel_cap_is_refused_from_its_header(vision):
    server = vision
    png = black_png(13_000, 13_000)
    b64 = base64.b64encode(png).decode()
    before = _rss_kib(server.proc.pid)
    for _ in range(2):
        for path, body in _image_bodies(f"data:image/png;base64,{b64}", b64):
            status, out = server.request("POST", path, body)
            assert status == 400 and _shape_ok(path, out), (path, status, out)
            msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
            assert "13000 x 13000" in msg and "--max-image-pixels" in msg, msg
    # Eight refusals of a ~500 MB image: no decoding (the bodies themselves are ~0.7 MB).
    assert _rss_kib(server.proc.pid) - before < 60_000


def test_images_the_limit_can_never_take_are_refused_before_decoding_or_encoding(vision_dir,
                                                                                    tmp_path):
    from mlx_kvcache.testing.vision_dir import image_data_url

    # The limit leaves 300 MB beside the model's weights (under 1 MB).
    with Server.ours(vision_dir, tmp_path / "log.txt", tmp_path, "--no-persist",
                     "--trust-remote-code", "--memory-limit", "300M") as s:
        pid = s.proc.pid
        # 6,000 x 6,000 pixels (under the pixel cap) take ~500 MB to decode: every route
        # refuses them with its 400, before anything decodes them.
        b64 = base64.b64encode(black_png(6_000, 6_000)).decode()
        before = peak_rss_kib(pid, reset=True)
        for path, body in _image_bodies(f"data:image/png;base64,{b64}", b64):
            status, out = s.request("POST", path, body)
            assert status == 400 and _shape_ok(path, out), (path, status, out)
            msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
            assert "never be decoded" in msg and "--memory-limit" in msg, msg
        assert peak_rss_kib(pid) - before < 100_000  # (decoding one would add ~500,000 KiB)
        assert s.cache()["memory"]["never_fit"] == 4
        # 512 x 512 pixels decode in 4 MB, but the processor makes them 4,096 tokens, and
        # this vision tower's attention takes ~2 GB to encode them (measured at start from
        # two small images): refused before the encoding — counted, as count_tokens only
        # decodes.
        b64 = base64.b64encode(black_png(512, 512)).decode()
        before = peak_rss_kib(pid, reset=True)
        for path, body in _image_bodies(f"data:image/png;base64,{b64}", b64):
            status, out = s.request("POST", path, body)
            if path == "/v1/messages/count_tokens":
                assert status == 200 and out["input_tokens"] > 4096, out
                continue
            assert status == 400 and _shape_ok(path, out), (path, status, out)
            msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
            assert "encoding its 1 image of 4096 tokens" in msg and "--memory-limit" in msg, msg
        assert peak_rss_kib(pid) - before < 100_000  # (encoding it would add ~2,000,000 KiB)
        small = image_data_url(16, 16)
        for path, body in _image_bodies(small, small.split(",", 1)[1]):
            status, out = s.request("POST", path, body)
            assert status == 200, (path, status, out)


def test_count_tokens_decodes_on_the_generation_thread_one_at_a_time(vision):
    from concurrent.futures import ThreadPoolExecutor

    # Four clients count a 3,000 x 3,000 image each (~130 MB to decode) at once. Decoded in
    # their HTTP threads they would hold up to four decodings together; decoded where the
    # message route decodes them (the generation thread, admitted by the memory guard),
    # one at a time.
    b64 = base64.b64encode(black_png(3_000, 3_000)).decode()
    body = dict(_image_bodies("", b64))["/v1/messages/count_tokens"]
    pid = vision.proc.pid
    before = peak_rss_kib(pid, reset=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: vision.request("POST", "/v1/messages/count_tokens",
                                                     body), range(4)))
    assert all(status == 200 for status, _ in got), got
    assert len({out["input_tokens"] for _, out in got}) == 1
    grown = peak_rss_kib(pid) - before
    # One decoding at a time: ~90 MiB measured (a 3,000² image held at 4 B a pixel is
    # 36 MB, past glibc's largest mmap threshold: always mapped afresh, so at least that is
    # seen); four at once in HTTP threads grew it by 328 MiB.
    assert 30_000 < grown < 200_000, grown


class _ImageHost:
    """An HTTP server on loopback serving one PNG, counting its requests."""

    def __init__(self, png: bytes) -> None:
        import http.server
        import threading

        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/probe.png"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> "_ImageHost":
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_image_urls_are_not_fetched_without_the_flag(vision, server):
    from mlx_kvcache.testing.vision_dir import png_bytes

    with _ImageHost(png_bytes(16, 16)) as host:
        for srv, routes in ((vision, None), (server, ("/v1/chat/completions",))):
            for path, body in _image_bodies(host.url):
                if routes is not None and path not in routes:
                    continue  # (a text model's agent routes say it serves no images)
                status, out = srv.request("POST", path, body)
                assert status == 400 and _shape_ok(path, out), (path, status, out)
                msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
                assert "--allow-image-urls" in msg, msg
    assert host.hits == []


def test_with_the_flag_every_route_serves_image_urls_count_tokens_too(vision_dir, tmp_path):
    from mlx_kvcache.testing.vision_dir import png_bytes

    png = png_bytes(16, 16)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    with _ImageHost(png) as host, Server.ours(vision_dir, tmp_path / "log.txt", tmp_path,
                                              "--no-persist", "--trust-remote-code",
                                              "--allow-image-urls") as s:
        by_url = dict(_image_bodies(host.url))
        by_data = dict(_image_bodies(data_url, base64.b64encode(png).decode()))
        n = s.request("POST", "/v1/messages/count_tokens", by_data["/v1/messages"])[1]
        status, counted = s.request("POST", "/v1/messages/count_tokens", by_url["/v1/messages"])
        assert status == 200 and counted == n, (counted, n)
        status, out = s.request("POST", "/v1/messages", {**by_url["/v1/messages"], **GREEDY})
        assert status == 200, out
        assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] == \
            n["input_tokens"]
        assert len(host.hits) == 2
        # the pixel cap holds for fetched images too
        with _ImageHost(black_png(13_000, 13_000)) as big:
            for path, body in _image_bodies(big.url):
                status, out = s.request("POST", path, body)
                assert status == 400 and _shape_ok(path, out), (path, status, out)
                msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
                assert "--max-image-pixels" in msg, msg


# -- 5. a client that leaves; Responses options not implemented ------------------------------
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_a_non_streamed_request_stops_when_its_client_leaves(server, path):
    # Greedy, this model answers this prompt with 3,000 tokens (no end of sequence).
    max_tokens = 3000
    body = {"/v1/messages": {"model": "m", "max_tokens": max_tokens, "messages": CONVO},
            "/v1/responses": {"model": "m", "input": CONVO[0]["content"],
                              "max_output_tokens": max_tokens},
            "/v1/chat/completions": {"messages": CONVO, "max_tokens": max_tokens}}[path]
    body.update(GREEDY)
    raw = json.dumps(body).encode()
    log = Path(server.log)
    start = log.stat().st_size
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    # Leave once the request is open, long before its 3,000 tokens.
    server.watch.wait("the request to open").until(
        lambda: server.cache()["open_requests"] >= 1, poll=0.05)
    s.close()

    def stopped():
        text = log.read_bytes()[start:].decode(errors="replace")
        m = re.search(r"its client left; the answer stopped after (\d+) tokens", text)
        return (int(m.group(1)),) if m else None
    (answered,) = server.watch.wait("the answer to stop").until(stopped, poll=0.05)
    assert answered < max_tokens // 2
    server.watch.wait("the request to close").until(
        lambda: server.cache()["open_requests"] == 0, poll=0.05)


BAD_OPTIONS = [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"store": True}, "store"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
]


@pytest.mark.parametrize("extra,param", BAD_OPTIONS, ids=[p for _, p in BAD_OPTIONS])
def test_responses_options_not_implemented_are_refused_by_name(server, extra, param):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", max_output_tokens=2,
                                extra_body=extra)
    err = e.value.body
    assert err["param"] == param and param.split(".")[0] in err["message"], err


def test_responses_options_that_ask_for_nothing_pass(server):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                           max_retries=0)
    r = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False,
                                include=["reasoning.encrypted_content"],
                                text={"format": {"type": "text"}, "verbosity": "low"},
                                background=False, temperature=0)
    assert r.usage.output_tokens == 2
