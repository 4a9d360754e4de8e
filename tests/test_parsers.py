"""The output parsers (`serving/parsers`) on token streams made with each family's own
tokenizer (`testing.family_dirs`): one token per character, and a byte-level BPE (a
character's bytes across tokens, several characters per token) with the content cut into
tokens at any points (hypothesis) — the outputs, merged, are the same. No model, no server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_kvcache.serving.parsers.base import (Call, CallArguments, CallBegin, CallCut,
                                              Reasoning, Text, UnreadCall)
from mlx_kvcache.serving.parsers.registry import entry_names, parser_for, prompt_state
from mlx_kvcache.testing.agent_templates import write_scripted_dir
from mlx_kvcache.testing.family_dirs import PARSER, write_family_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": n, "description": f"{n} a thing",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    for n in ("read_file", "write_file", "brave_search")]
#: Text the BPE tokenizers learn their merges from (so content splits into varied tokens).
CORPUS = ["Step 1: I read notes/a.txt next. All parts are read. The answer is 42.",
          '{"name": "read_file", "parameters": {"path": "notes/a.txt"}}',
          "naïve café — 東京 🚀 ünïcödé, and plain words: the quick brown fox", "```json\n{}\n```"]

# -- streams ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> Dict[Tuple[str, str], Any]:
    """(family, "chars" | "bpe") -> mlx-lm's TokenizerWrapper of that family."""
    from mlx_lm.tokenizer_utils import load

    out = {}
    for fam in PARSER:
        for kind in ("chars", "bpe"):
            d = tmp_path_factory.mktemp(f"{fam}-{kind}")
            write_family_tokenizer(d, fam, CORPUS if kind == "bpe" else None)
            out[fam, kind] = load(Path(d))
    return out


def encode(tok, segments: Sequence, cuts: Sequence[int] = ()) -> List[int]:
    """Token ids of ``segments``: a ``str`` is content, encoded in pieces cut at ``cuts``
    (character offsets into the content, taken modulo its length); ``("m", s)`` is markup,
    encoded whole (its added tokens); ``("c", s)``: ``s`` character by character, each
    encoded alone (markup written as characters)."""
    ids: List[int] = []
    for seg in segments:
        if isinstance(seg, tuple) and seg[0] == "m":
            ids += tok.encode(seg[1], add_special_tokens=False)
        elif isinstance(seg, tuple):
            for ch in seg[1]:
                ids += tok.convert_tokens_to_ids([ch]) if ch in tok.get_vocab() else \
                    tok.encode(ch, add_special_tokens=False)
        else:
            points = sorted({c % len(seg) for c in cuts} | {0, len(seg)}) if seg else [0]
            for a, b in zip(points, points[1:]):
                ids += tok.encode(seg[a:b], add_special_tokens=False)
    return ids


def run(parser, tok, ids: Sequence[int], finish: str = "stop") -> List[Any]:
    """Feed ``ids`` token by token, the last one with ``finish``, each with its text as
    mlx-lm's server makes it (its batch path: the detokenizer's segment; a stop token is
    not decoded); the outputs."""
    detok = tok.detokenizer
    out = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if not (last and finish == "stop"):
            detok.add_token(t)
        if last:
            detok.finalize()
        out += parser.feed(t, detok.last_segment, finish if last else None)
    return out


def merged(outputs: Sequence[Any]) -> List[Any]:
    """Adjacent text, reasoning and argument deltas joined (how they are written no longer
    shows); checks each begun call's contract on the way."""
    out: List[Any] = []
    sent: Dict[int, str] = {}
    for o in outputs:
        if isinstance(o, CallArguments):
            sent[o.index] = sent.get(o.index, "") + o.delta
        if isinstance(o, (Call, CallCut)) and o.index in sent:
            assert o.arguments.startswith(sent[o.index]), (o, sent[o.index])
        last = out[-1] if out else None
        if isinstance(o, (Text, Reasoning)) and type(last) is type(o):
            out[-1] = type(o)(last.text + o.text)
        elif isinstance(o, CallArguments) and isinstance(last, CallArguments):
            out[-1] = CallArguments(o.index, last.delta + o.delta)
        elif not (isinstance(o, (Text, Reasoning)) and not o.text):
            out.append(o)
    begun = [o.index for o in out if isinstance(o, CallBegin)]
    ended = [o.index for o in out if isinstance(o, (Call, CallCut, UnreadCall))
             and o.index is not None]
    assert sorted(set(begun)) == sorted(set(begun) & set(ended)), out
    return out


def parse(tok, segments, finish="stop", tools=TOOLS, state="normal", stops=(), cuts=()):
    p = parser_for(tok)(tools, state, stops)
    out = merged(run(p, tok, encode(tok, segments, cuts), finish))
    return out, p


ARGS = '{"path": "notes/a.txt"}'

# -- the registry -------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", sorted(PARSER))
def test_the_registry_chooses_each_family_by_its_markup(toks, fam):
    chosen = parser_for(toks[fam, "chars"])
    assert chosen.name == PARSER[fam] and chosen.why
    assert chosen.name in chosen.describe() and chosen.name in entry_names()


def test_the_registry_keeps_mlx_lm_where_it_has_a_parser(tmp_path):
    from mlx_lm.tokenizer_utils import load

    qwen = load(write_scripted_dir(tmp_path / "qwen3", "qwen3"))
    glm = load(write_scripted_dir(tmp_path / "glm", "glm45"))
    assert parser_for(qwen).name == "mlx_lm:json_tools"
    assert parser_for(glm).name == "mlx_lm:glm47"
    with pytest.raises(ValueError, match="harmony.*does not fit"):
        parser_for(qwen, "harmony")
    with pytest.raises(ValueError, match="no output parser 'nope'.*harmony"):
        parser_for(qwen, "nope")
    assert parser_for(qwen, "mlx_lm:json_tools").name == "mlx_lm:json_tools"
    assert parser_for(qwen, "mlx_lm").name == "mlx_lm"


def test_the_registry_falls_back_to_mlx_lms_text_split(tmp_path):
    from mlx_lm.tokenizer_utils import load

    from mlx_kvcache.testing.dirs import write_tokenizer_dir
    write_tokenizer_dir(tmp_path)
    tok = load(tmp_path)
    chosen = parser_for(tok)
    assert chosen.name == "mlx_lm"
    p = chosen()
    out = run(p, tok, tok.encode("plain <b>", add_special_tokens=False) + [tok.eos_token_id])
    assert merged(out) == [Text("plain <b>")] and not p.made_calls


def test_prompt_state_is_mlx_lms_rule(toks):
    r1 = toks["deepseek-r1", "chars"]
    prompt = r1.apply_chat_template([{"role": "user", "content": "hi"}],
                                    add_generation_prompt=True)
    assert prompt_state(r1, prompt) == "reasoning"  # R1's prompt opens <think>
    v31 = toks["deepseek-v3.1", "chars"]
    prompt = v31.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True)
    assert prompt_state(v31, prompt) == "normal"  # thinking off: </think>
    assert prompt_state(toks["gpt-oss", "chars"], [1, 2, 3]) == "normal"


# -- harmony -----------------------------------------------------------------------------------------
H_CALL = ("m", "<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>")


@pytest.mark.parametrize("kind", ["chars", "bpe"])
def test_harmony_reasoning_then_a_streamed_call(toks, kind):
    tok = toks["gpt-oss", kind]
    out, p = parse(tok, [("m", "<|channel|>analysis<|message|>"), "I read a next.",
                         ("m", "<|end|><|start|>assistant"), H_CALL, ARGS, ("m", "<|call|>")])
    assert out == [Reasoning("I read a next."), CallBegin(0, "read_file"),
                   CallArguments(0, ARGS), Call(0, "read_file", ARGS)]
    assert p.made_calls


def test_harmony_recipient_before_the_channel_as_the_template_renders_it(toks):
    tok = toks["gpt-oss", "chars"]
    out, _ = parse(tok, [" to=functions.write_file", ("m", "<|channel|>"), "commentary json",
                         ("m", "<|message|>"), '{"path": "b"}', ("m", "<|call|>")])
    assert out[0] == CallBegin(0, "write_file") and out[-1] == Call(0, "write_file",
                                                                   '{"path": "b"}')


def test_harmony_final_answer_and_a_preamble_are_text(toks):
    tok = toks["gpt-oss", "bpe"]
    out, p = parse(tok, [("m", "<|channel|>analysis<|message|>"), "think",
                         ("m", "<|end|><|start|>assistant<|channel|>"), "commentary",
                         ("m", "<|message|>"), "On it. ",
                         ("m", "<|end|><|start|>assistant<|channel|>"), "final",
                         ("m", "<|message|>"), "Done: 東京 🚀", ("m", "<|return|>")])
    assert out == [Reasoning("think"), Text("On it. Done: 東京 🚀")] and not p.made_calls


def test_harmony_several_calls_when_call_is_not_the_end(toks):
    tok = toks["gpt-oss", "chars"]
    second = ("m", "<|start|>assistant<|channel|>commentary to=functions.write_file"
                   "<|message|>")
    out, p = parse(tok, [H_CALL, ARGS, ("m", "<|call|>"), second, "{}", ("m", "<|call|>")])
    assert [o for o in out if isinstance(o, Call)] == [Call(0, "read_file", ARGS),
                                                       Call(1, "write_file", "{}")]


def test_harmony_unreadable_arguments_come_back_whole(toks):
    tok = toks["gpt-oss", "chars"]
    out, p = parse(tok, [H_CALL, '{"path": ', ("m", "<|call|>")])
    assert isinstance(out[-1], UnreadCall) and out[-1].index == 0
    assert out[-1].raw == ('<|channel|>commentary to=functions.read_file <|constrain|>json'
                           '<|message|>{"path": <|call|>')
    assert not p.made_calls


def test_harmony_a_builtin_tool_not_offered_is_unread(toks):
    tok = toks["gpt-oss", "chars"]
    out, p = parse(tok, [("m", "<|channel|>analysis"), " to=browser.search",
                         ("m", "<|message|>"), '{"query": "x"}', ("m", "<|call|>")])
    assert out == [UnreadCall('<|channel|>analysis to=browser.search<|message|>'
                              '{"query": "x"}<|call|>', out[0].problem)]
    assert "browser.search" in out[0].problem and not p.made_calls


def test_harmony_a_call_cut_by_the_token_limit(toks):
    tok = toks["gpt-oss", "bpe"]
    out, _ = parse(tok, [H_CALL, '{"path": "no'], finish="length")
    assert out[:2] == [CallBegin(0, "read_file"), CallArguments(0, '{"path": "no')]
    assert out[-1] == CallCut(0, "read_file", '{"path": "no')


def test_harmony_plain_text_without_markup_is_text(toks):
    out, _ = parse(toks["gpt-oss", "chars"], ["Just words.", ("m", "<|return|>")])
    assert out == [Text("Just words.")]


def test_harmony_starts_in_the_analysis_channel_when_the_prompt_opened_it(toks):
    out, _ = parse(toks["gpt-oss", "chars"], ["hmm", ("m", "<|end|><|start|>assistant"
                                                         "<|channel|>final<|message|>"),
                                              "ok", ("m", "<|return|>")], state="reasoning")
    assert out == [Reasoning("hmm"), Text("ok")]


def test_harmony_markup_written_as_characters_is_content(toks):
    tok = toks["gpt-oss", "chars"]
    out, _ = parse(tok, [("m", "<|channel|>final<|message|>"), ("c", "say <|call|> here"),
                         ("m", "<|return|>")])
    assert out == [Text("say <|call|> here")]


def test_harmony_stop_words_never_come_out(toks):
    tok = toks["gpt-oss", "chars"]
    # The answer stops on the stop word's last token: its text so far is held, then dropped.
    out, _ = parse(tok, [("m", "<|channel|>final<|message|>"), "Hello ENDX"], stops=("END",))
    assert out == [Text("Hello ")]
    out, _ = parse(tok, [("m", "<|channel|>final<|message|>"), "Hello EN"], finish="length",
                   stops=("END",))
    assert out == [Text("Hello EN")]


# -- Llama 3.x ---------------------------------------------------------------------------------------
CALL_JSON = '{"name": "read_file", "parameters": ' + ARGS + '}'


@pytest.mark.parametrize("fam,kind", [("llama3.1", "chars"), ("llama3.2", "bpe")])
def test_llama_json_call_streams_its_arguments(toks, fam, kind):
    out, p = parse(toks[fam, kind], [CALL_JSON, ("m", "<|eot_id|>")])
    assert out == [CallBegin(0, "read_file"), CallArguments(0, ARGS),
                   Call(0, "read_file", ARGS)] and p.made_calls


def test_llama_json_calls_in_other_shapes(toks):
    tok = toks["llama3.1", "chars"]
    out, _ = parse(tok, ['{"name": "read_file", "arguments": {"path": "x"}}',
                         ("m", "<|eot_id|>")])
    assert out[-1] == Call(0, "read_file", '{"path": "x"}')
    out, _ = parse(tok, ['{"parameters": {"path": "x"}, "name": "read_file"}',
                         ("m", "<|eot_id|>")])
    assert out == [Call(0, "read_file", '{"path": "x"}')]  # read whole once closed
    out, _ = parse(tok, ['{"type": "function", "name": "write_file", "parameters": {}}',
                         ("m", "<|eot_id|>")])
    assert out == [Call(0, "write_file", "{}")]


def test_llama_several_calls_separated_by_semicolons(toks):
    out, p = parse(toks["llama3.2", "bpe"],
                   [CALL_JSON + "; " + '{"name": "write_file", "parameters": {"path": "y"}}',
                    ("m", "<|eot_id|>")])
    assert [o for o in out if isinstance(o, Call)] == [
        Call(0, "read_file", ARGS), Call(1, "write_file", '{"path": "y"}')]
    assert not [o for o in out if isinstance(o, Text)]


@pytest.mark.parametrize("answer", [
    '{"result": 42, "ok": true}',                                   # JSON the user asked for
    '{"name": "unknown_tool", "parameters": {"a": 1}}',             # no such tool offered
    '{ not json at all } and more',
    "Plain prose, then {braces}.",
])
def test_llama_json_that_is_no_call_of_an_offered_tool_stays_text(toks, answer):
    out, p = parse(toks["llama3.1", "chars"], [answer, ("m", "<|eot_id|>")])
    assert out == [Text(answer)] and not p.made_calls


def test_llama_without_tools_json_is_text(toks):
    out, p = parse(toks["llama3.1", "chars"], [CALL_JSON, ("m", "<|eot_id|>")], tools=None)
    assert out == [Text(CALL_JSON)] and not p.made_calls


def test_llama_python_tag_calls(toks):
    tok = toks["llama3.1", "chars"]
    out, _ = parse(tok, [("m", "<|python_tag|>"), CALL_JSON, ("m", "<|eom_id|>")])
    assert out[-1] == Call(0, "read_file", ARGS)
    out, _ = parse(tok, [("m", "<|python_tag|>"), 'brave_search.call(query="mlx")',
                         ("m", "<|eom_id|>")])
    assert out == [Call(0, "brave_search", '{"query": "mlx"}')]
    out, p = parse(tok, [("m", "<|python_tag|>"), 'wolfram_alpha.call(query="x")',
                         ("m", "<|eom_id|>")])
    assert out == [UnreadCall('<|python_tag|>wolfram_alpha.call(query="x")<|eom_id|>',
                              out[0].problem)] and not p.made_calls
    out, _ = parse(tok, ["Let me run it.", ("m", "<|python_tag|>"), "print(1 + 1)",
                         ("m", "<|eom_id|>")])
    assert out[0] == Text("Let me run it.") and out[1].raw == "<|python_tag|>print(1 + 1)<|eom_id|>"


def test_llama_a_call_cut_or_stopped_inside(toks):
    tok = toks["llama3.1", "chars"]
    out, _ = parse(tok, ['{"name": "read_file", "parameters": {"path": "no'], finish="length")
    assert out[-1] == CallCut(0, "read_file", '{"path": "no')
    out, p = parse(tok, ['{"name": "read_file", "parameters": {"path": "no', ("m", "<|eot_id|>")])
    assert out[-1] == UnreadCall('{"name": "read_file", "parameters": {"path": "no<|eot_id|>',
                                 out[-1].problem, 0) and not p.made_calls


# -- DeepSeek ------------------------------------------------------------------------------------------
V31_CALL = [("m", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"), "read_file",
            ("m", "<｜tool▁sep｜>"), ARGS, ("m", "<｜tool▁call▁end｜>")]
END = ("m", "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")


@pytest.mark.parametrize("kind", ["chars", "bpe"])
def test_deepseek_v31_calls(toks, kind):
    tok = toks["deepseek-v3.1", kind]
    second = [("m", "<｜tool▁call▁begin｜>"), "write_file", ("m", "<｜tool▁sep｜>"), "{}",
              ("m", "<｜tool▁call▁end｜>")]
    out, p = parse(tok, ["Reading.", *V31_CALL, *second, END])
    assert out == [Text("Reading."), CallBegin(0, "read_file"), CallArguments(0, ARGS),
                   Call(0, "read_file", ARGS), CallBegin(1, "write_file"),
                   CallArguments(1, "{}"), Call(1, "write_file", "{}")] and p.made_calls


@pytest.mark.parametrize("kind", ["chars", "bpe"])
def test_deepseek_r1_reasoning_and_a_fenced_v3_call(toks, kind):
    tok = toks["deepseek-r1", kind]
    out, _ = parse(tok, ["\nI should read it.", ("m", "</think>"), "\n\n",
                         ("m", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"), "function",
                         ("m", "<｜tool▁sep｜>"), "read_file\n```json\n" + ARGS + "\n```",
                         ("m", "<｜tool▁call▁end｜>"), END], state="reasoning")
    assert out == [Reasoning("\nI should read it."), Text("\n\n"), CallBegin(0, "read_file"),
                   CallArguments(0, ARGS), Call(0, "read_file", ARGS)]


def test_deepseek_v31_thinking(toks):
    out, _ = parse(toks["deepseek-v3.1", "chars"],
                   [("m", "<think>"), "plan", ("m", "</think>"), *V31_CALL, END])
    assert out[0] == Reasoning("plan") and out[-1] == Call(0, "read_file", ARGS)


def test_deepseek_unreadable_calls(toks):
    tok = toks["deepseek-v3.1", "chars"]
    out, p = parse(tok, [("m", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"), "read_file",
                         ("m", "<｜tool▁sep｜>"), '{"path": ', ("m", "<｜tool▁call▁end｜>"), END])
    assert out[-1] == UnreadCall('<｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": '
                                 '<｜tool▁call▁end｜>', out[-1].problem, 0)
    out, _ = parse(tok, [("m", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"), "read_file",
                         ("m", "<｜tool▁call▁end｜>"), END])
    assert out == [UnreadCall("<｜tool▁call▁begin｜>read_file<｜tool▁call▁end｜>",
                              out[0].problem)] and not p.made_calls


def test_deepseek_cut_calls(toks):
    tok = toks["deepseek-v3.1", "chars"]
    out, _ = parse(tok, V31_CALL[:3] + ['{"path": "no'], finish="length")
    assert out[-1] == CallCut(0, "read_file", '{"path": "no')
    out, _ = parse(tok, V31_CALL[:2], finish="length")
    assert out == [UnreadCall("<｜tool▁call▁begin｜>read_file", out[0].problem)]


# -- any cut of the content into tokens gives the same outputs (BPE tokenizers) ------------------
_CONTENT = st.text(alphabet=st.sampled_from(list("ab xyz.,:\n{}'é東🚀-_")), min_size=1,
                   max_size=24).filter(lambda s: not s.startswith(" "))
_ARGS = st.dictionaries(st.sampled_from(["path", "q", "n"]),
                        st.one_of(st.text(alphabet=st.sampled_from(list('ab "\\é東🚀\n')),
                                          max_size=12), st.integers(-5, 500)),
                        max_size=3).map(lambda d: json.dumps(d, ensure_ascii=False))
_CUTS = st.lists(st.integers(0, 200), max_size=8)
_SETTINGS = settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(thought=_CONTENT, answer=_CONTENT, args=_ARGS, cuts=_CUTS)
def test_any_tokenization_gives_the_same_outputs(toks, thought, answer, args, cuts):
    h = toks["gpt-oss", "bpe"]
    out, _ = parse(h, [("m", "<|channel|>analysis<|message|>"), thought,
                       ("m", "<|end|><|start|>assistant"), H_CALL, args, ("m", "<|call|>")],
                   cuts=cuts)
    assert out == [Reasoning(thought), CallBegin(0, "read_file"), CallArguments(0, args),
                   Call(0, "read_file", args)]
    out, _ = parse(h, [("m", "<|channel|>final<|message|>"), answer, ("m", "<|return|>")],
                   cuts=cuts)
    assert out == [Text(answer)]
    ll = toks["llama3.2", "bpe"]
    call = '{"name": "read_file", "parameters": ' + args + '}'
    out, _ = parse(ll, [call, ("m", "<|eot_id|>")], cuts=cuts)
    assert out == [CallBegin(0, "read_file"), CallArguments(0, args), Call(0, "read_file", args)]
    out, _ = parse(ll, [answer, ("m", "<|eot_id|>")], cuts=cuts)
    assert out == [Text(answer)]
    ds = toks["deepseek-r1", "bpe"]
    out, _ = parse(ds, [thought, ("m", "</think>"), answer,
                        ("m", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"), "function",
                        ("m", "<｜tool▁sep｜>"), "read_file\n```json\n" + args + "\n```",
                        ("m", "<｜tool▁call▁end｜>"), END], state="reasoning", cuts=cuts)
    assert out == [Reasoning(thought), Text(answer), CallBegin(0, "read_file"),
                   CallArguments(0, args), Call(0, "read_file", args)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load
    return load(write_scripted_dir(tmp_path_factory.mktemp("qwen3"), "qwen3"))


_PIECE = st.one_of(
    st.text(alphabet=st.sampled_from(list("ab <>/\n{}é東")), min_size=1, max_size=12),
    st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "STOP", "ST"]),
    _ARGS.map(lambda a: '{"name": "read_file", "arguments": ' + a + "}"))


@_SETTINGS
@given(pieces=st.lists(_PIECE, max_size=10), cuts=_CUTS, finish=st.sampled_from(["stop",
                                                                                  "length"]))
def test_mlx_lms_entry_gives_the_same_outputs_for_any_cut_of_its_text(qwen, pieces, cuts,
                                                                      finish):
    """mlx-lm's entry reads text segments (its state machine matches markup in text):
    however the text arrives, the same outputs (the last segment: the stop token's, dropped)."""
    text = "".join(pieces)
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(points, points[1:])] or [""]

    def outputs(parts):
        p = parser_for(qwen)(TOOLS, "normal", ("STOP",))
        out = []
        for i, part in enumerate([*parts, ""] if finish == "stop" else parts):
            last = i == len(parts) - (0 if finish == "stop" else 1)
            out += p.feed(0, part, finish if last else None)
        return merged(out), p.made_calls

    assert outputs(chunks) == outputs([text])
