"""Model directories of the families mlx-lm has no tool parser for — gpt-oss (harmony),
Llama 3.x, DeepSeek V3.1 and R1 — each with its published chat template
(`harmony_template`, `family_templates`), a tokenizer that has the family's markup as
whole tokens (special where the family's tokenizer marks them special), and the scripted
agent model (`scripted_model`, its `plan_answers` script) answering in the family's own
markup: per user turn ``steps`` tool calls, each after reasoning where the family reasons,
then a text answer.

* ``gpt-oss``: ``<|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant<|channel|>
  commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``, and at the end
  ``…<|channel|>final<|message|>ANSWER<|return|>``; ``<|call|>``, ``<|return|>`` and
  ``<|endoftext|>`` end a sequence (its generation config). The template renders an earlier
  call as ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`` and
  drops a call's analysis once a final answer follows (a new user turn);
* ``llama3.1`` (Llama 3.1 / 3.3's template) and ``llama3.2``: ``{"name": NAME,
  "parameters": ARGS}<|eot_id|>`` (``python_tag=True``: ``<|python_tag|>`` before it and
  ``<|eom_id|>`` after), then ``ANSWER<|eot_id|>``; no reasoning;
* ``deepseek-v3.1``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>``; after a user message the
  template opens the turn with ``</think>`` (thinking off, its default) or ``<think>``
  (``thinking=True``: the model reasons first);
* ``deepseek-r1``: ``<think>\\nTHOUGHT</think>\\n\\n`` then ``…<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>…``; its generation prompt
  opens the reasoning (``<think>\\n``).

Step k calls ``tool`` with ``{arg: paths[k]}`` (and ``fixed``'s arguments). Every user
message must contain `CUE`; serve with ``--trust-remote-code``. DeepSeek's templates
concatenate a call's arguments as a string: a conversation that sends earlier calls back
must keep them strings where these templates render them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from . import scripted_model
from .agent_templates import CUE, STEP_PATHS
from .dirs import CHARS, SPECIALS
from .family_templates import (DEEPSEEK_R1_TEMPLATE, DEEPSEEK_V31_TEMPLATE, LLAMA31_TEMPLATE,
                               LLAMA32_TEMPLATE)
from .harmony_template import GPT_OSS_TEMPLATE

__all__ = ["Dialect", "DIALECTS", "PARSER", "write_family_dir", "write_family_tokenizer",
           "THOUGHT", "FINAL_THOUGHT", "FINAL"]

#: What step k thinks (where the family reasons), the last step's thought, and its answer.
THOUGHT = "Step {k}: I read {path} next."
FINAL_THOUGHT = "Every part is read: I answer."
FINAL = "All parts are read."

#: (thought or None, tool name, arguments) -> the answers the model may give, one string
#: each (markup spelled out): the first that the turn so far begins is given.
Answers = Callable[[Optional[str], Optional[str], Optional[Dict[str, Any]]], List[str]]


@dataclass(frozen=True)
class Dialect:
    """One family as the scripted model speaks it (see the module doc)."""

    name: str
    template: str
    specials: Sequence[str]      # special tokens (the family's tokenizer marks them so)
    markup: Sequence[str]        # other whole tokens
    bos: Optional[str]
    eos: str                     # the tokenizer's end-of-sequence token
    stops: Sequence[str]         # the generation config's end-of-sequence tokens
    opens: Sequence[str]         # where the template hands the turn to the model
    results: Sequence[str]       # what opens a tool result
    answers: Answers


# -- gpt-oss ---------------------------------------------------------------------------------------
def _harmony(thought, name, args, tagged=False) -> List[str]:
    analysis = f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant"
    if name is None:
        return [f"{analysis}<|channel|>final<|message|>{FINAL}<|return|>"]
    return [f"{analysis}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(args)}<|call|>"]


# -- Llama 3.x ---------------------------------------------------------------------------------------
def _llama(thought, name, args, tagged=False) -> List[str]:
    if name is None:
        return [f"{FINAL}<|eot_id|>"]
    call = json.dumps({"name": name, "parameters": args})
    return [f"<|python_tag|>{call}<|eom_id|>" if tagged else f"{call}<|eot_id|>"]


# -- DeepSeek ------------------------------------------------------------------------------------------
_DS_END = "<｜end▁of▁sentence｜>"


def _v31(thought, name, args, tagged=False) -> List[str]:
    body = (f"{FINAL}{_DS_END}" if name is None else
            f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}"
            f"<｜tool▁call▁end｜><｜tool▁calls▁end｜>{_DS_END}")
    return [body, f"</think>{body}", f"<think>{thought}</think>{body}"]


def _r1(thought, name, args, tagged=False) -> List[str]:
    body = (f"{FINAL}{_DS_END}" if name is None else
            f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
            f"{json.dumps(args)}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>{_DS_END}")
    return [f"<think>\n{thought}</think>\n\n{body}"]


_HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                     "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
                     "<|endofprompt|>"]
_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                   "<|finetune_right_pad_id|>"]
_DS_SPECIALS = ["<｜begin▁of▁sentence｜>", _DS_END]
_DS_MARKUP = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
              "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
              "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
_LLAMA_OPEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"
_LLAMA_RESULT = "<|start_header_id|>ipython<|end_header_id|>"

DIALECTS: Dict[str, Dialect] = {
    "gpt-oss": Dialect("gpt-oss", GPT_OSS_TEMPLATE, _HARMONY_SPECIALS, [], "<|startoftext|>",
                       "<|return|>", ["<|return|>", "<|endoftext|>", "<|call|>"],
                       ["<|start|>assistant"], ["<|start|>functions."], _harmony),
    "llama3.1": Dialect("llama3.1", LLAMA31_TEMPLATE, _LLAMA_SPECIALS, [], "<|begin_of_text|>",
                        "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                        [_LLAMA_OPEN], [_LLAMA_RESULT], _llama),
    "llama3.2": Dialect("llama3.2", LLAMA32_TEMPLATE, _LLAMA_SPECIALS, [], "<|begin_of_text|>",
                        "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                        [_LLAMA_OPEN], [_LLAMA_RESULT], _llama),
    "deepseek-v3.1": Dialect("deepseek-v3.1", DEEPSEEK_V31_TEMPLATE, _DS_SPECIALS, _DS_MARKUP,
                             _DS_SPECIALS[0], _DS_END, [_DS_END],
                             ["<｜Assistant｜>", "<｜tool▁output▁end｜>"],
                             ["<｜tool▁output▁begin｜>"], _v31),
    "deepseek-r1": Dialect("deepseek-r1", DEEPSEEK_R1_TEMPLATE, _DS_SPECIALS, _DS_MARKUP,
                           _DS_SPECIALS[0], _DS_END, [_DS_END],
                           ["<｜Assistant｜>", "<｜tool▁outputs▁end｜>"],
                           ["<｜tool▁output▁begin｜>"], _r1),
}

#: The output parser the registry chooses for each family's directory.
PARSER = {"gpt-oss": "harmony", "llama3.1": "llama3", "llama3.2": "llama3",
          "deepseek-v3.1": "deepseek", "deepseek-r1": "deepseek"}


def write_family_tokenizer(path, family: str, corpus: Optional[Sequence[str]] = None):
    """``family``'s tokenizer (HF fast) saved in ``path``: one token per character, or —
    given a ``corpus`` — a byte-level BPE learned from it (as the families' real
    tokenizers are: multi-character tokens, a character's bytes split across tokens), with
    the family's markup and `CUE` as whole added tokens and its chat template."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers,
                            trainers)
    from transformers import PreTrainedTokenizerFast

    d = DIALECTS[family]
    whole = set(d.specials) | set(d.markup)
    base = [s for s in SPECIALS if s not in whole]
    if corpus is None:
        tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(base + CHARS)},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
            vocab_size=600, special_tokens=base,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(base + list(d.specials))
    tok.add_tokens([AddedToken(a, normalized=False, special=False)
                    for a in [*d.markup, CUE]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=d.bos,
                                   eos_token=d.eos)
    fast.chat_template = d.template
    fast.save_pretrained(str(path))
    return fast


def write_family_dir(path, family: str, steps: int = 3, tool: str = "read_file",
                     arg: str = "path", paths: Sequence[str] = STEP_PATHS,
                     fixed: Optional[Dict[str, Any]] = None, python_tag: bool = False,
                     broken: bool = False) -> Path:
    """A model directory of ``family`` (a key of `DIALECTS`; see the module doc) whose
    scripted model makes ``steps`` calls of ``tool`` per user turn, then answers `FINAL`.
    ``python_tag`` (Llama): its calls follow ``<|python_tag|>`` and end with ``<|eom_id|>``.
    ``broken``: each call's arguments are cut off half-way (no JSON object: a call no
    parser reads)."""
    d = DIALECTS[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = write_family_tokenizer(path, family)

    def ids(text: str) -> List[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def answers(thought: str, name: Optional[str], args: Optional[Dict[str, Any]]):
        out = d.answers(thought, name, args, python_tag)
        if broken and args is not None:
            whole = json.dumps(args)
            out = [a.replace(whole, whole[:len(whole) // 2]) for a in out]
        return [ids(a) for a in out]

    script = {
        "cue": tok.convert_tokens_to_ids(CUE), "eos": tok.convert_tokens_to_ids(d.eos),
        "opens": [ids(o) for o in d.opens], "results": [ids(r) for r in d.results],
        "answers": [answers(THOUGHT.format(k=k + 1, path=paths[k]), tool,
                            {arg: paths[k], **(fixed or {})}) for k in range(steps)]
        + [answers(FINAL_THOUGHT, None, None)],
    }
    stops = [tok.convert_tokens_to_ids(s) for s in d.stops]
    shutil.copyfile(scripted_model.__file__, path / "scripted_model.py")
    config = {"model_type": "scripted_agent", "model_file": "scripted_model.py",
              "vocab_size": len(tok), "script": script, "eos_token_id": stops}
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    mx.save_safetensors(str(path / "model.safetensors"), {"w": mx.zeros((1,))},
                        metadata={"format": "mlx"})
    return path
