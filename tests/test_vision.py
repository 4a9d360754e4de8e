"""Images end to end on a vision model: a tiny random-weight Muse Spark
(`mlx_kvcache.testing.vision_dir`, mlx-lm 0.32.2's one model with an image processor)
served by stock ``mlx_lm.server`` and by ``mlx-kvcache serve`` (``--trust-remote-code``:
the directory's model file runs Muse Spark's Metal kernels in plain MLX on this CPU).

* the chat route with an image part answers at temperature 0 with stock's tokens and
  top-5 log-probs (to 1e-4), in memory and with the disk store on; a repeat is a full hit
  (the whole prompt, keyed with its image, bar the last token) with the same answer; a
  restart serves it from disk with the same answer;
* another image with the same text is another prompt: stock's answer for that image, only
  the text before the image reused (never the first image's rows), and each image's
  repeat is then its own full hit;
* with a sliding window that wraps inside the prompt (no rewinding), image prompts
  restore their text before the first image, and answer as stock does;
* Anthropic's ``/v1/messages`` with an ``image`` block (official ``anthropic`` SDK)
  and OpenAI's ``/v1/responses`` with an ``input_image`` part (official ``openai`` SDK)
  answer as the chat route does, a repeat from cache; a stored-file image is a 400.
"""

from __future__ import annotations

import copy
import signal
import time

import pytest

import PIL  # noqa: E402,F401 - mlx-lm decodes and resizes images with Pillow (a test extra)

from mlx_kvcache.testing.servers import Server, answer, same_answer  # noqa: E402
from mlx_kvcache.testing.vision_dir import (  # noqa: E402
    IMAGE_TOKENS, image_data_url, write_vision_dir)
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)


def _prompt(u) -> int:
    """The prompt's tokens by Anthropic's usage: its three input counts add up to it."""
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens

SYSTEM = "You look at pictures."
BEFORE, AFTER = "What is in this picture? ", " Be brief."
SIDE = 16  # 16 x 16 pixels: 2 x 2 image tokens of 8 x 8 pixels
N_IMAGE = (SIDE // 8) ** 2
TRUST = "--trust-remote-code"  # the directory's model.py (see vision_dir)
# Where the first patch token is: <|system|> SYSTEM </s> <|user|> BEFORE <|image_start|>
# (the character tokenizer: one token per character).
FIRST_PATCH = 1 + len(SYSTEM) + 1 + 1 + len(BEFORE) + 1
# ... then the patches, <|image_end|>, AFTER, </s>, <|assistant|>.
PROMPT_TOKENS = FIRST_PATCH + N_IMAGE + 1 + len(AFTER) + 2


def image(seed: int) -> str:
    return image_data_url(SIDE, SIDE, seed)


def conversation(url: str):
    """A system message, then a user message with text, an image and text."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": BEFORE},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": AFTER}]}]


def ask(server: Server, url: str, max_tokens: int = 8):
    return server.chat(conversation(url), max_tokens=max_tokens)


def ask_listed(server: Server, url: str):
    """`ask`, and the request's entry in ``GET /v1/cache`` (its `recent` list: made at the
    request's final insert, just after the answer reached the client)."""
    sent = time.time()
    r = ask(server, url)
    return r, server.entry_since(sent)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = write_vision_dir(tmp_path_factory.mktemp("vision") / "muse_spark")
    assert IMAGE_TOKENS[1] in (d / "tokenizer.json").read_text()
    return d


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    """Stock mlx_lm.server's answers to image 1 and image 2 (same text), each cold."""
    root = tmp_path_factory.mktemp("stock")
    with Server.stock(model_dir, root / "stock.log", root, TRUST) as s:
        one = ask(s, image(1))
        two = ask(s, image(2))
        # The processor expanded the image: the prompt holds its patch tokens.
        assert one["usage"]["prompt_tokens"] == PROMPT_TOKENS, (one["usage"], s.tail())
        assert answer(one)[2] == 0
    return {1: one, 2: two}


def test_the_images_matter(stock):
    """Two images, same text, different answers (the test below could not tell them apart
    otherwise): the log-probs at the first step differ."""
    (_, first1), (_, first2) = answer(stock[1])[1][0], answer(stock[2])[1][0]
    assert max(abs(a - b) for (_, a), (_, b) in zip(first1, first2)) > 1e-3, (first1, first2)


@pytest.mark.parametrize("persist", [False, True], ids=["no-persist", "cache-dir"])
def test_image_prompts_answer_as_stock_and_are_reused(persist, model_dir, stock, tmp_path):
    cache_dir = tmp_path / "cache"
    store = ["--cache-dir", str(cache_dir)] if persist else ["--no-persist"]
    with Server.ours(model_dir, tmp_path / "ours.log", tmp_path, TRUST, *store) as s:
        one, entry = ask_listed(s, image(1))
        same_answer(stock[1], one)
        assert answer(one)[2] == 0
        assert entry["path"] == "sequential" and entry["prompt_tokens"] == PROMPT_TOKENS

        # The same request again: the whole prompt (keyed with its image) is restored, all
        # but the last token, which is computed for its logits; the same answer.
        again, entry = ask_listed(s, image(1))
        same_answer(one, again)
        assert answer(again)[2] == entry["cached_tokens"] == PROMPT_TOKENS - 1, (entry, s.tail())
        assert entry["reuse"]["kind"] == "hit", entry

        # Another image, same text: stock's answer for that image, not the first image's
        # rows; only the text before the image is reused (up to its first patch token).
        two, entry = ask_listed(s, image(2))
        same_answer(stock[2], two)
        assert 0 < answer(two)[2] <= FIRST_PATCH, (answer(two)[2], entry, s.tail())
        assert entry["cached_tokens"] == answer(two)[2]
        assert entry["reuse"]["kind"] == "image", entry
        assert entry["reuse"]["diverged_at"] == FIRST_PATCH, entry

        # Both are held now, each under its own image: each repeat is a full hit on its own.
        for n in (2, 1):
            r = ask(s, image(n))
            same_answer(stock[n], r)
            assert answer(r)[2] == PROMPT_TOKENS - 1, (n, answer(r)[2], s.tail())
        if persist:
            assert s.stop(signal.SIGTERM) == 0, s.tail()
    if not persist:
        return
    # A restart reads the image-keyed prompt back from disk: the same answer as stock.
    with Server.ours(model_dir, tmp_path / "ours2.log", tmp_path, TRUST, *store) as s:
        r = ask(s, image(1))
        same_answer(stock[1], r)
        assert answer(r)[2] == PROMPT_TOKENS - 1, (answer(r)[2], s.tail())
        rep = s.cache()
        assert rep["disk_tokens"] == answer(r)[2] and rep["disk_bytes"] > 0, rep
        # ... and not for the other image's prompt (its text prefix at most).
        r = ask(s, image(3))
        assert answer(r)[2] <= FIRST_PATCH, (answer(r)[2], s.tail())


def test_a_window_that_wraps_reuses_the_text_before_the_image(tmp_path):
    """A sliding window of 16 tokens: the rotating cache wraps inside the prompt and cannot
    be rewound, so a stored prompt + answer restores nowhere before its end. The
    sequential path checkpoints image prompts on the text before the first image only (an
    image's rows come from its pixels, in mlx-lm's prefill): from the first divergence on,
    each image prompt restores exactly its text before the image — stock reuses nothing —
    and answers as stock does."""
    d = write_vision_dir(tmp_path / "muse_spark_window16", sliding_window=16)
    order = (1, 2, 1, 2)
    with Server.stock(d, tmp_path / "stock.log", tmp_path, TRUST) as s:
        want = [ask(s, image(n)) for n in order]
    with Server.ours(d, tmp_path / "ours.log", tmp_path, TRUST, "--no-persist") as s:
        got = [ask(s, image(n)) for n in order]
        kinds = [e["reuse"]["kind"] for e in s.cache()["recent"]]
    for a, b in zip(want, got):
        same_answer(a, b)
    cached = [answer(r)[2] for r in got]
    assert [answer(r)[2] for r in want] == [0, 0, 0, 0]
    # The second request diverges at the image and takes the stop there; the repeats
    # restore it (an exact repeat too: no stop is ever taken inside or after an image).
    assert cached == [0, 0, FIRST_PATCH, FIRST_PATCH], (cached, kinds)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    with Server.ours(model_dir, root / "ours.log", root, TRUST, "--no-persist") as s:
        yield s


def test_anthropic_image_block_answers_as_the_chat_route(server, stock):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                                 max_retries=0)
    url = image(1)
    data = url.partition(",")[2]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": BEFORE},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": AFTER}]}]
    want = ask(server, url)
    same_answer(stock[1], want)
    text = answer(want)[0]
    assert text
    server.request("DELETE", "/v1/cache")
    for _ in range(2):  # cold, then a full hit: the same text
        r = client.messages.create(model="claude-x", max_tokens=8, system=SYSTEM,
                                   messages=copy.deepcopy(messages),
                                   extra_body={"temperature": 0})
        assert "".join(b.text for b in r.content if b.type == "text") == text
        assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 8
        # The usage counts the processor's prompt (the image's patch tokens).
        assert _prompt(r.usage) == PROMPT_TOKENS
    assert r.usage.cache_read_input_tokens == PROMPT_TOKENS - 1
    # count_tokens counts the prompt the processor makes, as the usage does.
    assert client.messages.count_tokens(model="claude-x", system=SYSTEM,
                                        messages=copy.deepcopy(messages)).input_tokens == PROMPT_TOKENS
    # Streamed: the same text.
    with client.messages.stream(model="claude-x", max_tokens=8, system=SYSTEM,
                                messages=copy.deepcopy(messages),
                                extra_body={"temperature": 0}) as st:
        final = st.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == text


def test_responses_input_image_answers_as_the_chat_route(server, stock):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                           max_retries=0)
    content = [{"type": "input_text", "text": BEFORE},
               {"type": "input_image", "image_url": image(1)},
               {"type": "input_text", "text": AFTER}]
    text = answer(stock[1])[0]
    server.request("DELETE", "/v1/cache")
    for _ in range(2):  # cold, then a full hit: the chat route's text for this image
        r = client.responses.create(model="gpt-x", instructions=SYSTEM, max_output_tokens=8,
                                    temperature=0,
                                    input=[{"role": "user", "content": copy.deepcopy(content)}])
        assert r.output_text == text
        assert r.usage.input_tokens == PROMPT_TOKENS  # the processor's prompt
    assert r.usage.input_tokens_details.cached_tokens == PROMPT_TOKENS - 1
    # Another image: its own answer, not the first one's rows.
    other = copy.deepcopy(content)
    other[1]["image_url"] = image(2)
    r = client.responses.create(model="gpt-x", instructions=SYSTEM, max_output_tokens=8,
                                temperature=0, input=[{"role": "user", "content": other}])
    assert r.output_text == answer(stock[2])[0]
    assert r.usage.input_tokens_details.cached_tokens <= FIRST_PATCH
    # An image as a stored file cannot be served by a stateless server: a 400 naming it.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-x", max_output_tokens=8, input=[{
            "role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}])
    assert "input[0].content[0]" in str(e.value), e.value
