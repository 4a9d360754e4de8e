"""A prefix that never breaks: Claude-Code-shaped sessions read at least the whole previous
prompt from the cache every turn — on a template that renders system messages in place and
on one that refuses them —, a ``cache_control`` breakpoint is where a hybrid model restores
exactly, and the miss explanation names the message a request diverged in."""

from __future__ import annotations

import time
import uuid

import pytest

anthropic = pytest.importorskip("anthropic")

from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: E402

from mlx_kvcache.serving.routes.agents import conversation as cv  # noqa: E402
from mlx_kvcache.serving.engine import templates  # noqa: E402
from mlx_kvcache.serving.engine.templates import answer_extends_prompt  # noqa: E402
from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.agent_dirs import (write_refusing_dir,  # noqa: E402
                                           write_thinking_dir, write_tool_template_dir)
from mlx_kvcache.testing.servers import Server  # noqa: E402
from mlx_kvcache.testing.waits import CAP  # noqa: E402

pytestmark = pytest.mark.timeout(CAP)


def _prompt(u) -> int:
    """The prompt's tokens by Anthropic's usage: its three input counts add up to it."""
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens

LONG_SYSTEM = ("You are an agent for software engineering. Be careful with files. " * 6).strip()
TOOLS = [{"name": "Read", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
         {"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
          "cache_control": {"type": "ephemeral"}}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {"in_place": write_model_dir(root / "llama", "llama"),
            "refusing": write_refusing_dir(root / "refusing"),
            "hybrid": write_model_dir(root / "qwen3_5", "qwen3_5"),
            "root": root}


def _system(turn: int):
    # Claude Code's billing line differs on every request.
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}; "
                                     f"cch={uuid.uuid4().hex[:5]};"},
            {"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]


def _session(client, turns: int = 6):
    """A Claude-Code-shaped session; returns each turn's usage."""
    history, usages = [], []
    for t in range(turns):
        # Claude Code moves its message breakpoint to the newest user message (the API
        # takes at most 4 cache_control blocks: here the system prompt, the last tool and it).
        for m in history:
            for b in m["content"] if isinstance(m["content"], list) else ():
                b.pop("cache_control", None)
        if t == 3:  # the periodic nudge, appended after the assistant's turn
            history.append({"role": "system", "content": "The task tools haven't been used "
                                                         "recently. Consider the todo list."})
        if t == 2:  # the answer to the tool call of turn 1
            user = [{"type": "tool_result", "tool_use_id": "toolu_01", "is_error": False,
                     "content": [{"type": "text", "text": "README.md\nsetup.py"}]},
                    {"type": "text", "text": "Now summarise.", "cache_control": {"type": "ephemeral"}}]
        else:
            user = [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": f"Question {t}: what next?",
                     "cache_control": {"type": "ephemeral"}}]
        history.append({"role": "user", "content": user})
        history.append({"role": "system",
                        "content": f"<total_tokens>{90000 - 800 * t} tokens left</total_tokens>"})
        r = client.messages.create(model="claude-sonnet-5", max_tokens=5, system=_system(t),
                                   tools=TOOLS, messages=history, extra_body=GREEDY)
        usages.append(r.usage)
        if t == 1:  # the model "calls a tool" (the client sends the call back as made)
            history.append({"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"cmd": "ls"}}]})
        else:
            history.append({"role": "assistant",
                            "content": [b.model_dump(exclude_none=True) for b in r.content]})
    return usages


@pytest.mark.parametrize("template", ["in_place", "refusing"])
def test_claude_code_session_reads_the_whole_previous_prompt(dirs, template):
    root = dirs["root"] / f"server_{template}"
    root.mkdir()
    with Server.ours(dirs[template], root / "log.txt", root / "home", "--no-persist") as s:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k",
                                     max_retries=0)
        usages = _session(client)
        log = s.tail(200_000)
    prompts = [_prompt(u) for u in usages]
    assert usages[0].cache_read_input_tokens == 0
    for prev, u in zip(prompts, usages[1:]):
        assert u.cache_read_input_tokens >= prev, (prompts, usages)
    want = ("rendered inside the adjacent user turn" if template == "refusing"
            else "rendered where they are")
    assert want in log


def test_miss_explanation_names_the_message(dirs):
    root = dirs["root"] / "explain"
    root.mkdir()
    with Server.ours(dirs["in_place"], root / "log.txt", root / "home", "--no-persist") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k", max_retries=0)
        msgs = [{"role": "user", "content": "Please read the file called notes.txt for me."},
                {"role": "assistant", "content": "It says: remember the milk tomorrow."},
                {"role": "user", "content": "And then?"}]
        c.messages.create(model="m", max_tokens=2, system=LONG_SYSTEM, messages=msgs)
        msgs[1] = {"role": "assistant", "content": "It says: remember the eggs tomorrow."}
        sent = time.time()
        r = c.messages.create(model="m", max_tokens=2, system=LONG_SYSTEM, messages=msgs,
                              metadata={"user_id": "session-7"})
        recent = s.entry_since(sent)
        reuse = recent["reuse"]
        log = s.tail(100_000)
    assert recent["session"] == "session-7" and "| session session-7" in log
    assert reuse["kind"] == "diverged" and reuse["where"] == "messages[1].content[0]"
    assert r.usage.cache_read_input_tokens == reuse["diverged_at"]
    assert "in messages[1].content[0]" in log


def test_cache_control_is_where_a_hybrid_model_restores(dirs):
    root = dirs["root"] / "hybrid_server"
    root.mkdir()
    # No spaces: one token per character with either tokenizer class (Qwen3.5's drops them).
    first = "Here-is-a-long-document-about-ships-and-the-sea.-" * 12
    other = "A-different-document,-about-mountains-and-their-snow.-" * 12

    def ask(c, doc, question, mark=True):
        block = {"type": "text", "text": doc}
        if mark:
            block["cache_control"] = {"type": "ephemeral"}
        return c.messages.create(model="m", max_tokens=3, extra_body=GREEDY, messages=[
            {"role": "user", "content": [block, {"type": "text", "text": question}]}])

    with Server.ours(dirs["hybrid"], root / "log.txt", root / "home", "--no-persist",
                     "--checkpoint-interval", "4096") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k", max_retries=0)
        ask(c, first, "Question one?")
        warm = ask(c, first, "Another question entirely?")
        # One token per character: "<|user|>" and the document.
        assert warm.usage.cache_read_input_tokens == 1 + len(first)
        s.request("DELETE", "/v1/cache")
        cold = ask(c, first, "Another question entirely?")
        assert cold.usage.cache_read_input_tokens == 0
        assert [b.model_dump() for b in cold.content] == [b.model_dump() for b in warm.content]
        # Without the breakpoint the hybrid model has no state there to restore.
        ask(c, other, "Question one?", mark=False)
        unmarked = ask(c, other, "Another question entirely?", mark=False)
        assert unmarked.usage.cache_read_input_tokens < 1 + len(other)


# -- the conversation rules, without a server -------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(dirs):
    return {k: load_tokenizer(dirs[k]) for k in ("in_place", "refusing")}


def test_template_policy_is_probed(tokenizers):
    assert templates.system_policy(tokenizers["in_place"]) == "in_place"
    assert templates.system_policy(tokenizers["refusing"]) == "fold"


class _Jinja:
    """A tokenizer's template side only: ``template`` rendered with jinja2."""

    has_chat_template, has_thinking = True, False

    def __init__(self, template: str) -> None:
        import jinja2
        self.chat_template, self._template = template, jinja2.Template(template)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, **kw):
        assert not tokenize
        return self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **kw)


def test_whether_the_next_request_goes_on_past_the_answer_is_probed(tokenizers, tmp_path):
    # "<|assistant|>" opens the answer's turn in the history as the generation prompt does
    assert answer_extends_prompt(tokenizers["in_place"])
    assert answer_extends_prompt(tokenizers["refusing"])
    # a reasoning model's answer comes back without its reasoning: keep the stop
    thinking = load_tokenizer(write_thinking_dir(tmp_path / "think", switch=True))
    assert not answer_extends_prompt(thinking)
    assert not answer_extends_prompt(thinking, {"enable_thinking": False})
    turns = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    assert answer_extends_prompt(_Jinja(turns + "{% if add_generation_prompt %}<assistant>{% endif %}"))
    # a generation prompt the history does not repeat (a newline after the role)
    assert not answer_extends_prompt(
        _Jinja(turns + "{% if add_generation_prompt %}<assistant>\n{% endif %}"))
    # the template's arguments are part of the decision
    switch = turns + ("{% if add_generation_prompt %}<assistant>{% if x %}<x>{% endif %}"
                      "{% endif %}")
    assert answer_extends_prompt(_Jinja(switch)) and not answer_extends_prompt(_Jinja(switch), {"x": 1})
    raising = "{{ raise_exception('no') }}"
    assert not answer_extends_prompt(_Jinja(raising))


def test_where_the_next_request_leaves_the_prompt_is_probed(tokenizers, tmp_path):
    """`templates.answer_turn_differs`: Qwen3 without thinking renders its empty reasoning
    block (6 tokens here) only for the turn being answered; with thinking, and where the
    generation prompt opens the answer's turn as the history does, nothing differs."""
    from mlx_kvcache.testing.agent_templates import write_scripted_dir
    from mlx_kvcache.serving.engine.templates import answer_turn_differs
    qwen3 = load_tokenizer(write_scripted_dir(tmp_path / "qwen3", "qwen3", steps=1))
    assert answer_turn_differs(qwen3, {"enable_thinking": False}) == len(
        qwen3.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert answer_turn_differs(qwen3, {"enable_thinking": False}) > 0
    assert answer_turn_differs(qwen3) == 0
    assert answer_turn_differs(tokenizers["in_place"]) == 0


def _render(tok, msgs, breakpoints=()):
    conv = cv.Conversation.from_call(msgs, [f"messages[{i}]" for i in range(len(msgs))],
                                     breakpoints=breakpoints)
    conv.drop_lines(cv.line_filter())
    conv.fit_template(templates.system_policy(tok))
    return tok.apply_chat_template(conv.messages(), add_generation_prompt=False, tokenize=False), conv


def test_folding_keeps_every_turn_a_prefix_of_the_next(tokenizers):
    tok = tokenizers["refusing"]
    turns = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
         {"role": "system", "content": "r1"}],
        [{"role": "assistant", "content": "a1"}, {"role": "system", "content": "nudge"},
         {"role": "user", "content": "u2"}, {"role": "system", "content": "r2"}],
        [{"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}],
    ]
    history, last = [], ""
    for more in turns:
        history += more
        text, _ = _render(tok, history)
        assert text.startswith(last.rsplit("</s>", 1)[0])
        assert "<system-reminder>\nnudge" in text or len(history) < 5
        last = text
    assert "u1\n\n<system-reminder>\nr1\n</system-reminder>" in last
    assert "<system-reminder>\nnudge\n</system-reminder>\n\nu2" in last


def test_billing_line_and_volatile_lines_are_dropped():
    keep = cv.line_filter(extra=r"Session id: ")
    conv = cv.Conversation.from_call([
        {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nSession id: 9\nRules"},
        {"role": "user", "content": "quote: x-anthropic-billing-header: stays"}])
    conv.drop_lines(keep)
    msgs = conv.messages()
    assert msgs[0]["content"] == "Rules"
    assert msgs[1]["content"] == "quote: x-anthropic-billing-header: stays"  # user text kept
    conv = cv.Conversation.from_call([{"role": "system", "content": "x-anthropic-billing-header: a"}])
    conv.drop_lines(cv.line_filter(keep_billing=True))
    assert conv.messages()[0]["content"] == "x-anthropic-billing-header: a"


def test_layout_marks_parts_and_cuts_breakpoints(tokenizers):
    tok = tokenizers["in_place"]
    msgs = [{"role": "system", "content": [{"type": "text", "text": "abc"},
                                           {"type": "text", "text": "defg"}]},
            {"role": "user", "content": "hello"}]
    conv = cv.Conversation.from_call(msgs, ["system", "messages[0]"], breakpoints=[(0, 0), (1, 0)])
    lay = cv.layout(tok, conv, None)
    ids = tok.apply_chat_template(conv.messages(), add_generation_prompt=True)
    assert lay.prompt_tokens == len(ids)
    # "<|system|>abc" ends at token 4; "...defg</s><|user|>hello" at 4 + 4 + 2 + 5.
    assert lay.cuts == [4, 15]
    assert lay.marks == [(0, "the template's text before system"), (1, "system.content[0]"),
                         (4, "system.content[1]"),
                         (8, "the template's text between system and messages[0]"),
                         (10, "messages[0]")]


def test_under_mlx_launch_the_ranks_checkpoint_at_the_breakpoint(dirs):
    from mlx_kvcache.testing.launch import LaunchedServer

    root = dirs["root"] / "launch"
    root.mkdir()
    doc = "Ranks-share-one-request-and-its-layout.-" * 10

    def ask(c, question):
        return c.messages.create(model="m", max_tokens=3, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "text", "text": doc,
                                          "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": question}]}])

    with Server.ours(dirs["hybrid"], root / "one.log", root, "--no-persist",
                     "--checkpoint-interval", "4096") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k", max_retries=0)
        ref = [ask(c, "First?"), ask(c, "Second one?")]
    with LaunchedServer(dirs["hybrid"], "--pipeline", "--no-persist", "--checkpoint-interval",
                        "4096", home=root) as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k", max_retries=0)
        got = [ask(c, "First?"), ask(c, "Second one?")]
        lines = s.wait_for_lines(2)
    assert [[b.model_dump() for b in r.content] for r in got] == \
        [[b.model_dump() for b in r.content] for r in ref]
    assert got[1].usage.cache_read_input_tokens == ref[1].usage.cache_read_input_tokens \
        == 1 + len(doc)
    assert lines[0] == lines[1], lines  # both ranks restored at the breakpoint


def test_a_template_without_system_messages_gets_them_in_the_user_turn():
    class NoSystem:  # a chat template that raises on any system message
        def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=False, **kw):
            if any(m["role"] == "system" for m in msgs):
                raise ValueError("system messages are not supported")
            return "".join(m["content"] for m in msgs)

    tok = NoSystem()
    assert templates.system_policy(tok) == "fold_all"
    conv = cv.Conversation.from_call([{"role": "system", "content": "S"},
                                      {"role": "user", "content": "U"},
                                      {"role": "system", "content": "R"}])
    conv.fit_template(templates.system_policy(tok))
    assert conv.messages() == [{"role": "user", "content": "<system-reminder>\nS\n"
                                "</system-reminder>\n\nU\n\n<system-reminder>\nR\n</system-reminder>"}]


# -- cache_control on tools and tool calls ----------------------------------------------------
def _nth_end(text: str, needle: str, n: int) -> int:
    at = -1
    for _ in range(n + 1):
        at = text.index(needle, at + 1)
    return at + len(needle)


def test_layout_cuts_at_marked_tools_and_tool_calls(dirs, tokenizers):
    import copy
    import json

    from mlx_lm.server import process_message_content

    tok = load_tokenizer(write_tool_template_dir(dirs["root"] / "tool_template"))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("Read", "Bash", "Grep")]
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "Bash", "arguments": json.dumps({"cmd": c})}}
             for i, c in enumerate(("ls", "pwd"))]
    msgs = [{"role": "user", "content": "Go."},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c0", "content": "out"}]
    shown = copy.deepcopy(msgs)
    process_message_content(shown)  # as mlx-lm hands them to the template
    text = tok.apply_chat_template(shown, tools=tools, add_generation_prompt=True, tokenize=False)
    for marked_tools, marked_calls, end in [
            ([1], [], text.index("Read Bash") + len("Read Bash")),
            ([2], [], text.index("Bash Grep") + len("Bash Grep")),
            ([], [(1, 0)], _nth_end(text, "</tool_call>", 0)),
            ([], [(1, 1)], _nth_end(text, "</tool_call>", 1))]:
        conv = cv.Conversation.from_call(msgs, call_breakpoints=marked_calls)
        lay = cv.layout(tok, conv, tools, marked_tools=marked_tools)
        assert lay.cuts == [len(tok.encode(text[:end], add_special_tokens=False))], \
            (marked_tools, marked_calls)
    # Nothing marked, nothing cut; a template that renders no tools gives no cut for them.
    assert cv.layout(tok, cv.Conversation.from_call(msgs), tools).cuts == []
    plain = tokenizers["in_place"]
    assert cv.layout(plain, cv.Conversation.from_call(msgs[:1]), tools, marked_tools=[0]).cuts == []


def test_cache_control_on_tools_and_tool_calls_is_where_a_hybrid_model_restores(dirs):
    import json

    root = dirs["root"] / "hybrid_tools"
    model = write_tool_template_dir(root / "model", "qwen3_5")
    eph = {"type": "ephemeral"}
    names = [f"tool-number-{k}-that-does-things" for k in range(12)]
    tools = [{"name": n, "input_schema": {"type": "object", "properties": {}}} for n in names]
    tools[-1]["cache_control"] = eph
    call = {"type": "tool_use", "id": "toolu_01", "name": names[0],
            "input": {"cmd": "ls-" + "-la" * 60}, "cache_control": eph}

    def ask(c, user, tools=None):
        return c.messages.create(model="m", max_tokens=3, extra_body=GREEDY, messages=user,
                                 **({"tools": tools} if tools else {}))

    def exchange(result):
        return [{"role": "user", "content": "Go."}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": result}]}]

    tok = load_tokenizer(model)
    with Server.ours(model, root / "log.txt", root / "home", "--no-persist",
                     "--checkpoint-interval", "4096") as s:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key="k", max_retries=0)
        # The tools end where the template's tool list does: "<|system|>Tools: a b … z"
        # (Qwen3.5's tokenizer class drops the spaces: counted by the served tokenizer).
        ask(c, [{"role": "user", "content": "Question one?"}], tools)
        r = ask(c, [{"role": "user", "content": "Another question entirely?"}], tools)
        tools_end = tok.encode("<|system|>Tools: " + " ".join(names), add_special_tokens=False)
        assert r.usage.cache_read_input_tokens == len(tools_end)
        # A tool call marked: the next request, whose tool result differs, restores at
        # the call's end.
        ask(c, exchange("first result"))
        r = ask(c, exchange("a different result"))
        text = ('<|user|>Go.</s><|assistant|><tool_call>{"name": "' + names[0] +
                '", "arguments": ' + json.dumps(call["input"]) + '}</tool_call>')
        assert r.usage.cache_read_input_tokens == len(tok.encode(text, add_special_tokens=False))


def test_mlx_lm_takes_the_prompt_the_layout_encoded(tokenizers):
    """The prompt is rendered and encoded once (for the layout): mlx-lm's tokenizing of an
    agent request takes those ids — the same prompt and segments it computes itself."""
    import types

    from mlx_lm.server import ResponseGenerator

    from mlx_kvcache.serving.engine.requests import MarkedRequest

    tok = tokenizers["in_place"]
    conv = cv.Conversation.from_call([{"role": "system", "content": LONG_SYSTEM},
                                      {"role": "user", "content": "Question?"}])
    lay = cv.layout(tok, conv, None)
    gen = types.SimpleNamespace(model_provider=types.SimpleNamespace(
        cli_args=types.SimpleNamespace(chat_template_args={}), processor=None))

    def tokenize(tokens, kwargs=None):
        req = MarkedRequest("chat", "", conv.messages(), None, None, tokens=tokens,
                            template_kwargs={})
        args = types.SimpleNamespace(chat_template_kwargs=kwargs)
        return ResponseGenerator._tokenize(gen, req.tokenizer_for(tok), req, args)

    assert tokenize(lay.ids)[:3] == tokenize(None)[:3]
    assert tokenize([7, 8, 9])[0] == [7, 8, 9]  # answered from the ids, not rendered again
    # Rendered with other template arguments than the layout's: rendered again, as asked.
    assert tokenize([7, 8, 9], {"unused_flag": True})[0] == lay.ids
