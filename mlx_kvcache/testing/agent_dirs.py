"""Offline model directories for the agent routes' tests (see `dirs` for the base ones):

* `write_refusing_dir`: the character tokenizer with a Qwen-style chat template that
  refuses a system message anywhere but first (``raise_exception``), renders tool calls
  and tool results;
* `write_tool_template_dir`: any base model with the character tokenizer and a template
  that renders tools and tool calls (`TOOL_TEMPLATE`);
* `write_tool_dir`: a model that answers every prompt with one tool call, through a
  template and a tokenizer that mlx-lm's ``json_tools`` parser recognises: a "bigram"
  llama whose layers add nothing (zero output projections), so its next token depends on
  the current one only — ``<|assistant|>`` → ``<tool_call>`` → the call's JSON (one added
  token) → ``</tool_call>`` → ``</s>``;
* `write_thinking_dir`: the same kind of model reasoning first (``<think>`` … ``</think>``);
* `write_script_dir`: the same kind of model with a tool call its parser cannot read
  (`BAD_CALL`) after ``<|assistant|>``, and text to continue (`SCRIPT_TEXT`: after any of
  its characters, the rest of it), for prefills;
* `write_tool_dir` with ``call=PATCH_CALL``: Codex's ``apply_patch`` called with a patch;
* `write_patch_dir`: the same, then `PATCHED` once the tool's result came back (a whole
  agent turn for a real CLI: the call, then a final answer);
* `write_long_dir`: the same kind of model whose answer never ends, with a small context
  length in its config (for answer limits and context refusals).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .dirs import CHARS, SPECIALS, write_model_dir

__all__ = ["REFUSING_TEMPLATE", "TOOL_TEMPLATE", "TOOL_CALL", "THINKING_TEMPLATE",
           "THINKING_SWITCH_TEMPLATE", "THOUGHT", "LONG_THOUGHT", "LONG_ANSWER",
           "write_long_dir",
           "ANSWER", "write_refusing_dir", "write_tool_dir", "write_thinking_dir",
           "write_tool_template_dir", "write_char_tokenizer", "BAD_CALL", "SCRIPT_TEXT",
           "PATCH", "PATCH_CALL", "PATCHED", "write_script_dir", "write_patch_dir"]

#: Renders system messages first only (like Qwen3's), tool calls and tool results.
REFUSING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}<|system|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response></s>"
    "{%- else %}<|assistant|>{{ m['content'] }}"
    "{%- for tc in m.get('tool_calls') or [] %}<tool>{{ tc['function'] | tojson }}</tool>"
    "{%- endfor %}</s>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: The one call the tool model makes.
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
_ADDED = ["<tool_call>", "</tool_call>", json.dumps(TOOL_CALL)]
#: A call cut off inside its arguments: not JSON, which mlx-lm's ``json_tools`` drops.
BAD_CALL = '{"name": "get_weather", "arguments": {"city": "Par'
#: What the script model says when continuing a text (each character once: a bigram).
SCRIPT_TEXT = "abcdefghij"
#: A patch in Codex's ``apply_patch`` format, and the call that sends it (the custom tool
#: offered as a function of one string, ``input``).
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
PATCH_CALL = {"name": "apply_patch", "arguments": {"input": PATCH}}

#: System messages in place, tools listed in a system turn, calls in json_tools' format.
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{%- endfor %}</s>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}<|system|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response></s>"
    "{%- else %}<|assistant|>{{ m['content'] }}"
    "{%- for tc in m.get('tool_calls') or [] %}{%- set tool_call = tc['function'] %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}</tool_call>{%- endfor %}</s>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


#: What the thinking model thinks, then answers.
THOUGHT, ANSWER = "Let me think about it.", "It is done."
#: What the long-thinking model thinks: one token per character, each character once.
LONG_THOUGHT = "abcdefghij"
#: What the endless model says, again and again: one token per character.
LONG_ANSWER = "klmnopqrst"

#: Renders an assistant turn's reasoning inside <think> ... </think> before its text.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}<|system|>{{ m['content'] }}</s>"
    "{%- elif m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
    "{%- else %}<|assistant|>{%- if m.get('reasoning_content') %}<think>"
    "{{ m['reasoning_content'] }}</think>{%- endif %}{{ m['content'] }}</s>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


#: `THINKING_TEMPLATE` that honours ``enable_thinking`` as Qwen3's does: off, the
#: generation prompt carries an empty ``<think></think>`` (the model answers at once).
THINKING_SWITCH_TEMPLATE = THINKING_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}",
    "{%- if add_generation_prompt %}<|assistant|>{%- if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{%- endif %}{% endif %}")


def write_char_tokenizer(path: Path, template: str, added=()) -> int:
    """The character tokenizer (`dirs`) with ``template`` and ``added`` whole-string
    tokens; returns the vocabulary size."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(a, normalized=False) for a in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def write_refusing_dir(path, kind: str = "llama", seed: int = 0) -> Path:
    """A `dirs.write_model_dir` model whose template refuses later system messages."""
    path = write_model_dir(path, kind, seed)
    write_char_tokenizer(path, REFUSING_TEMPLATE)
    return path


def write_tool_template_dir(path, kind: str = "llama", seed: int = 0) -> Path:
    """A `dirs.write_model_dir` model (random weights) whose character tokenizer has
    `TOOL_TEMPLATE`: tools and tool calls are rendered (for checkpoints at them)."""
    path = write_model_dir(path, kind, seed)
    write_char_tokenizer(path, TOOL_TEMPLATE)
    return path


def _write_chain_dir(path, template: str, added, chain, more=(), loop: bool = False,
                     **config) -> Path:
    """A "bigram" llama (see the module doc) that, from ``<|assistant|>``, produces the
    tokens ``chain`` (names of specials, characters or ``added`` strings), then ``</s>``
    (``loop``: the chain again, for ever); ``more``: other chains, each from its first
    token (no token in two chains); ``config``: model config overrides
    (``max_position_embeddings``)."""
    path = Path(path)
    added = list(added)
    vocab = len(SPECIALS) + len(CHARS) + len(added)
    hidden = 128
    write_model_dir(path, "llama", 0, hidden_size=hidden, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, num_hidden_layers=1, vocab_size=vocab,
                    **config)
    assert write_char_tokenizer(path, template, added) == vocab
    ids = {t: i for i, t in enumerate(SPECIALS + CHARS + added)}
    steps = [ids["<|assistant|>"], *(ids[t] for t in chain)]
    succ = dict(zip(steps, steps[1:]))
    for other in more:
        other = [ids[t] for t in other]
        succ.update(zip(other, other[1:]))
    if loop:
        succ[steps[-1]] = steps[1]
    eos = ids["</s>"]
    weights = dict(mx.load(str(path / "model.safetensors")))
    for k, v in weights.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = mx.zeros_like(v)  # the layers add nothing to the residual
        elif k.endswith("norm.weight"):
            weights[k] = mx.ones_like(v)
    embed = mx.zeros((vocab, hidden))
    embed[mx.arange(vocab), mx.arange(vocab)] = 1.0  # token t: the t-th axis
    head = mx.zeros((vocab, hidden))
    for t in range(vocab):
        head[succ.get(t, eos), t] = 10.0  # next(t), by a wide margin
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def write_tool_dir(path, call=TOOL_CALL) -> Path:
    """The model that always calls ``call`` (`TOOL_CALL`; see the module doc)."""
    added = [*_ADDED[:2], json.dumps(call)]
    return _write_chain_dir(path, TOOL_TEMPLATE, added, ["<tool_call>", added[2], "</tool_call>"])


#: What the patch model answers once the patch was applied (its tool result came back).
PATCHED = "Done"
#: `TOOL_TEMPLATE` whose generation prompt after a tool result carries ``<|result|>``.
_AFTER_RESULT_TEMPLATE = TOOL_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}",
    "{%- if add_generation_prompt %}<|assistant|>{%- if messages[-1]['role'] == 'tool' %}"
    "<|result|>{%- endif %}{% endif %}")


def write_patch_dir(path) -> Path:
    """A model (see the module doc) that calls `PATCH_CALL` on a new turn and answers
    `PATCHED` after a tool result; a long context (a CLI's instructions are long)."""
    added = [*_ADDED[:2], json.dumps(PATCH_CALL), "<|result|>"]
    return _write_chain_dir(path, _AFTER_RESULT_TEMPLATE, added,
                            ["<tool_call>", added[2], "</tool_call>"],
                            more=[["<|result|>", *PATCHED]], max_position_embeddings=262144)


def write_script_dir(path) -> Path:
    """A model (see the module doc) that answers a new turn with `BAD_CALL` inside
    ``<tool_call>`` … ``</tool_call>``, and continues any prefix of `SCRIPT_TEXT` with
    the rest of it (then ``</s>``)."""
    added = [*_ADDED[:2], BAD_CALL]
    return _write_chain_dir(path, TOOL_TEMPLATE, added, ["<tool_call>", BAD_CALL, "</tool_call>"],
                            more=[list(SCRIPT_TEXT) + ["</s>"]])


def write_long_dir(path, context: int) -> Path:
    """A model whose answer never ends (`LONG_ANSWER` over and over: no end of sequence)
    and whose config gives a ``context``-token context (``max_position_embeddings``),
    through `TOOL_TEMPLATE`."""
    return _write_chain_dir(path, TOOL_TEMPLATE, [], list(LONG_ANSWER), loop=True,
                            max_position_embeddings=context)


def write_thinking_dir(path, switch: bool = False, long: bool = False) -> Path:
    """A model that reasons: every answer is ``<think>`` `THOUGHT` ``</think>`` `ANSWER`,
    through a template that renders an earlier turn's reasoning the same way (mlx-lm
    splits reasoning from ``<think>`` / ``</think>`` tokens). ``switch``: the template
    honours ``enable_thinking`` (`THINKING_SWITCH_TEMPLATE`; off, the answer is `ANSWER`).
    ``long``: the reasoning is `LONG_THOUGHT`, one token per character (for budgets)."""
    template = THINKING_SWITCH_TEMPLATE if switch else THINKING_TEMPLATE
    thought = list(LONG_THOUGHT) if long else [THOUGHT]
    return _write_chain_dir(path, template, ["<think>", "</think>", THOUGHT, ANSWER],
                            ["<think>", *thought, "</think>", ANSWER])
