"""Thinking models' chat templates, from their published text, and model directories that
use them with the scripted agent model (`scripted_model`), for foresight's tests and the
agents benchmark.

Each family is a `Family`: its template, the whole-string tokens its markup needs (the
character tokenizer of `dirs` has one token per character; markup tokens are added as
the real tokenizers have them), the end-of-turn token, how its generation prompt reads,
how a tool result opens, and how the model writes reasoning and a tool call — what the
scripted model emits. Families: ``qwen3`` (Qwen3's template: reasoning is kept only for
the assistant turns after the last real user message, its ``last_query_index``; with
thinking off the generation prompt carries an empty ``<think>`` block) and ``glm45``
(GLM-4.5's: reasoning in ``<think>`` of the turns after the last user message only,
``clear_thinking``-free, calls as ``<tool_call>name<arg_key>…</arg_key><arg_value>…``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import scripted_model
from .dirs import CHARS, SPECIALS

__all__ = ["Family", "FAMILIES", "QWEN3_TEMPLATE", "GLM45_TEMPLATE", "CUE", "SUBCUE",
           "WRONG", "write_scripted_dir", "STEP_PATHS"]

#: What every user message of a scripted session carries (the model's cue: a new user turn).
CUE = "<|q|>"
#: What a task handed to a subagent carries (the cue of the script's ``sub`` part).
SUBCUE = "<|t|>"
#: What the hybrid scripted model answers (then it ends) where its recurrent state does not
#: agree with its KV layer's history: a wrong restore (one character token).
WRONG = "#"
#: The file each tool step reads (the scripted model's calls, in order).
STEP_PATHS = ("notes/a.txt", "notes/b.txt", "notes/c.txt", "notes/d.txt", "notes/e.txt")

#: Qwen3's chat template (Qwen/Qwen3-8B, tokenizer_config.json), as published.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

#: GLM-4.5's chat template (zai-org/GLM-4.5, chat_template.jinja), as published, less its
#: image / video branches (the scripted sessions send text only).
GLM45_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""


@dataclass(frozen=True)
class Family:
    """One template family as the scripted model speaks it (see the module doc)."""

    name: str
    template: str
    added: Sequence[str]
    eos: str
    open: str          # the generation prompt, as the model sees its turn start
    result: str        # the token a tool result opens with
    think: str         # how the model opens its reasoning
    newlines: str      # between ``</think>`` and the answer
    call: Callable[[str, Dict[str, Any]], str]  # a tool call as the model writes it
    final: str


def _qwen3_call(name: str, args: Dict[str, Any]) -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'


def _glm_call(name: str, args: Dict[str, Any]) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                    f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in args.items())
    return f'<tool_call>{name}\n{pairs}</tool_call>'


FAMILIES: Dict[str, Family] = {
    "qwen3": Family("qwen3", QWEN3_TEMPLATE,
                    ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                     "</tool_call>", "<tool_response>", "</tool_response>", CUE, SUBCUE],
                    "<|im_end|>", "<|im_start|>assistant\n", "<tool_response>", "<think>\n",
                    "\n\n", _qwen3_call, "All parts are read."),
    "glm45": Family("glm45", GLM45_TEMPLATE,
                    ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>",
                     "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                     "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
                     "</tool_response>", "<|endoftext|>", CUE, SUBCUE],
                    "<|user|>", "<|assistant|>", "<|observation|>", "\n<think>", "\n",
                    _glm_call, "All parts are read."),
}


def _tokenizer(path: Path, family: Family):
    """The character tokenizer with ``family``'s markup tokens; returns it (HF fast)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = [s for s in SPECIALS if s not in family.added]
    vocab = {t: i for i, t in enumerate(base + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(base)
    tok.add_tokens([AddedToken(a, normalized=False, special=False) for a in family.added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=None,
                                   eos_token=family.eos)
    fast.chat_template = family.template
    fast.save_pretrained(str(path))
    return fast


#: Per step, the calls made at once: ``(tool name, arguments)`` each.
Calls = Sequence[Sequence[Tuple[str, Dict[str, Any]]]]


def write_scripted_dir(path, family: str = "qwen3", steps: int = 3, tool: str = "read_file",
                       arg: str = "path", paths: Sequence[str] = STEP_PATHS,
                       fixed: Optional[Dict[str, Any]] = None,
                       step_calls: Optional[Calls] = None,
                       sub_calls: Optional[Calls] = None, hybrid: bool = False) -> Path:
    """A model directory: the scripted agent model (`scripted_model`: ``steps`` tool calls
    per user turn, each after reasoning, then a text answer) with ``family``'s template.
    Step k calls ``tool`` with ``{arg: paths[k]}`` (and ``fixed``'s arguments: a real
    client's tool, e.g. Claude Code's ``Read`` / ``file_path``). Serve it with
    ``--trust-remote-code`` (its architecture is the directory's ``model_file``). Every
    user message must contain `CUE`.

    ``step_calls`` instead gives each step's calls (several at once: parallel subagents;
    a step of n calls gets n results, so the next step taken is k + n). ``sub_calls``: the
    steps of a task that carries `SUBCUE` (a subagent's prompt; a fork's instruction after
    its parent's conversation), then the same final answer.

    ``hybrid``: the model has a recurrent layer too (mlx-lm's ``ArraysCache``, restored
    only at checkpoints), whose state must agree with the KV layer's history: where a
    restore gets them out of step the model answers `WRONG` (see `scripted_model`)."""
    fam = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, fam)

    def ids(text: str) -> List[int]:
        return list(tok.encode(text, add_special_tokens=False))

    vocab = len(tok)
    def part(calls: Calls, cue: str) -> Dict[str, Any]:
        return {"cue": tok.convert_tokens_to_ids(cue),
                "thoughts": [ids(f"Step {k + 1}: I call {', '.join(n for n, _ in step)} next.\n")
                             for k, step in enumerate(calls)],
                "calls": [ids("\n".join(fam.call(n, a) for n, a in step)) for step in calls],
                "final_thought": ids("Every part is read: I answer.\n"), "final": ids(fam.final)}

    script = {
        "open": ids(fam.open), "cue": tok.convert_tokens_to_ids(CUE),
        "result": tok.convert_tokens_to_ids(fam.result), "think": ids(fam.think),
        "think_end": tok.convert_tokens_to_ids("</think>"), "newlines": ids(fam.newlines),
        "eos": tok.convert_tokens_to_ids(fam.eos),
        "thoughts": [ids(f"Step {k + 1}: I read {paths[k]} next.\n") for k in range(steps)],
        "calls": [ids(fam.call(tool, {arg: paths[k], **(fixed or {})})) for k in range(steps)],
        "final_thought": ids("Every part is read: I answer.\n"), "final": ids(fam.final),
    }
    if step_calls is not None:
        script.update({k: v for k, v in part(step_calls, CUE).items() if k != "cue"})
    if sub_calls is not None:
        script["sub"] = part(sub_calls, SUBCUE)
    shutil.copyfile(scripted_model.__file__, path / "scripted_model.py")
    config = {"model_type": "scripted_agent", "model_file": "scripted_model.py",
              "vocab_size": vocab, "script": script, "eos_token_id": script["eos"]}
    if hybrid:
        config.update(hybrid=True, wrong=tok.convert_tokens_to_ids(WRONG))
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), {"w": mx.zeros((1,))},
                        metadata={"format": "mlx"})
    return path
