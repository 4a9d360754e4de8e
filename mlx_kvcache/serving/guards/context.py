"""The model's context length, and the answer limits it sets.

One place answers "how many tokens may this model see at once" (`context_length`): the
``--context-length`` option when given, else the model's ``config.json``
(``max_position_embeddings``, ``max_seq_len``, ``max_sequence_length``, ``n_ctx``,
``seq_length``, ``n_positions``; a vision model's ``text_config`` too), else the loaded
model's own arguments; None when none says (then nothing is refused or clamped here).
``sliding_window`` is not a context length (a sliding-window model attends that far back
per layer, and its full-attention layers see the whole prompt).

The server's context (`served_context`) is the served model's, or less where the memory
guard's limit cannot hold it (`memory_tokens`: the most tokens one request alone may
hold): a request longer than that would never be admitted, and an answer without a client
limit would be sized, and refused, for a context the machine does not have. It stays the
served model's while a request has mlx-lm load another model (``--allow-model-switch``);
that request is fitted to its own model's (`loaded_context`).

What follows from it (`answer_tokens`): a prompt that leaves no room for one answer token
is refused before any work (`ContextTooLong`, the number of tokens and the most a prompt
may have); a client's ``max_tokens`` is clamped to what the context leaves; and with no
client limit an agent route's answer may run to the end of the context — unless the user
gave ``--max-tokens`` on the command line (`explicit_max_tokens`: mlx-lm's default of 512
is told apart from a value given, `mark_default_max_tokens`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["ContextTooLong", "DefaultMaxTokens", "mark_default_max_tokens",
           "explicit_max_tokens", "config_context_length", "context_length",
           "memory_tokens", "served_context", "loaded_context", "answer_tokens",
           "client_settings"]

#: Keys a model config names its context length with, most specific first.
_KEYS = ("max_position_embeddings", "max_seq_len", "max_sequence_length", "n_ctx",
         "seq_length", "n_positions")


class ContextTooLong(ValueError):
    """A prompt that leaves the answer no room: ``prompt_tokens`` and ``maximum`` (the most
    a prompt may have, the context length less the one answer token). Its message is
    Anthropic's (``prompt is too long: N tokens > M maximum``)."""

    def __init__(self, prompt_tokens: int, maximum: int) -> None:
        self.prompt_tokens, self.maximum = int(prompt_tokens), int(maximum)
        super().__init__(f"prompt is too long: {self.prompt_tokens} tokens > "
                         f"{self.maximum} maximum")


class DefaultMaxTokens(int):
    """``--max-tokens`` when the user did not give it (mlx-lm's default): an int that says
    it was not chosen."""


def mark_default_max_tokens(parser) -> None:
    """Make ``parser``'s ``--max-tokens`` default a `DefaultMaxTokens` (argparse keeps a
    default that is not a string as it is, so a value given on the command line is a
    plain int)."""
    # argparse has no public lookup of an option's action (as `app.add_options`).
    action = parser._option_string_actions.get("--max-tokens")
    if action is not None and isinstance(action.default, int):
        action.default = DefaultMaxTokens(action.default)


def explicit_max_tokens(cli_args) -> Optional[int]:
    """``--max-tokens`` when the user gave it on the command line, else None."""
    v = getattr(cli_args, "max_tokens", None)
    if v is None or isinstance(v, DefaultMaxTokens):
        return None
    return int(v)


def _from_config(config: Dict[str, Any]) -> Optional[int]:
    for c in (config, config.get("text_config"), config.get("llm_config")):
        if not isinstance(c, dict):
            continue
        for k in _KEYS:
            v = c.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


#: Each model's config read once (by path or repo id): every request asks.
_CONFIGS: Dict[str, Optional[int]] = {}


def config_context_length(model: Optional[str]) -> Optional[int]:
    """The context length ``model``'s ``config.json`` gives (a local directory, or a Hugging
    Face repo id already in the local cache: the model loaded from it), or None."""
    if not model:
        return None
    if model in _CONFIGS:
        return _CONFIGS[model]
    path: Optional[Path] = None
    local = Path(os.path.expanduser(str(model)))
    if (local / "config.json").is_file():
        path = local / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(str(model), "config.json")
            path = Path(found) if isinstance(found, str) else None
        except Exception:  # noqa: BLE001 - not a repo id, or no cache: no config here
            path = None
    try:
        found_length = _from_config(json.loads(path.read_text())) if path else None
    except (OSError, ValueError):
        found_length = None
    _CONFIGS[model] = found_length
    return found_length


def _from_model(model: Any) -> Optional[int]:
    args = getattr(model, "args", None)
    if args is None:
        return None
    fields = dict(vars(args)) if hasattr(args, "__dict__") else {}
    text = fields.get("text_config")
    if text is not None and not isinstance(text, dict):
        fields["text_config"] = dict(vars(text)) if hasattr(text, "__dict__") else None
    return _from_config(fields)


def context_length(cli_args, model_path: Optional[str] = None, model: Any = None
                   ) -> Optional[int]:
    """The context length of the model at ``model_path`` (default: the served ``--model``):
    ``--context-length`` when given, else its config's, else the loaded ``model``'s
    arguments'; None when nothing says."""
    override = getattr(cli_args, "context_length", None)
    if override:
        return int(override)
    path = model_path if model_path is not None else getattr(cli_args, "model", None)
    found = config_context_length(str(path) if path is not None else None)
    if found is None and model is not None:
        found = _from_model(model)
    return found


def memory_tokens(memory) -> Optional[int]:
    """The most tokens (prompt and answer) one request alone may hold under ``memory``'s
    limit (a `memory.MemoryGuard`: its measured footprint's need beside the weights), or
    None without a limit or where caches do not grow with tokens."""
    fp, limit = getattr(memory, "footprint", None), getattr(memory, "limit", None)
    if fp is None or limit is None or not fp.kv_per_token:
        return None
    room = int(limit) - int(fp.weights)
    if fp.need(1, 0) > room:
        return 0
    lo, hi = 1, 2
    while fp.need(hi, 0) <= room and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fp.need(lo, 0) fits, fp.need(hi, 0) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fp.need(mid, 0) <= room else (lo, mid)
    return lo


#: What each model the provider loaded says of its context in its own arguments (by model
#: key), remembered for when another model is loaded (`served_context`).
_LOADED: Dict[Any, Optional[int]] = {}


def _model_context(provider, key) -> Optional[int]:
    """`context_length` of the model loaded under ``key`` (mlx-lm's model key), whether
    mlx-lm's ``provider`` holds it now or not."""
    model = provider.model if key is not None and provider.model_key == key else None
    if model is not None and key not in _LOADED:
        _LOADED[key] = _from_model(model)
    n = context_length(provider.cli_args, key[0] if key else None)
    return n if n is not None else _LOADED.get(key)


def served_context(generator) -> Optional[int]:
    """The context the server gives the served model (``generator``: the server's
    response generator; its ``served()`` names the served model once loaded), whichever
    model mlx-lm's provider holds now (a chat request may have it load another):
    `context_length`, less where the memory guard cannot hold it (`memory_tokens`); None
    when the model's is unknown. The agent routes check and clamp against this."""
    provider = generator.model_provider
    served = generator.served()
    n = _model_context(provider, served.key if served is not None else provider.model_key)
    held = memory_tokens(getattr(generator, "memory", None))
    return n if n is None or held is None else min(n, held)


def loaded_context(generator) -> Optional[int]:
    """The context of the model mlx-lm's provider holds now: `served_context` when it is
    the served one, else that model's `context_length` (the memory guard measured the
    served model only). A request the generation thread runs is fitted to this."""
    provider = generator.model_provider
    served = generator.served()
    if served is None or provider.model_key == served.key:
        return served_context(generator)
    return _model_context(provider, provider.model_key)


def answer_tokens(context: Optional[int], prompt_tokens: int, requested: Optional[int],
                  default: Optional[int]) -> Optional[int]:
    """The most tokens an answer to a ``prompt_tokens`` prompt may have: ``requested`` (the
    client's limit; else ``default``, the user's ``--max-tokens``; else what the context
    leaves), never more than the ``context`` leaves. `ContextTooLong` when the prompt
    leaves no room; with no known context, ``requested`` or ``default`` (None: the server's
    own default)."""
    want = requested if requested is not None else default
    if context is None:
        return want
    room = context - prompt_tokens
    if room < 1:
        raise ContextTooLong(prompt_tokens, context - 1)
    return room if want is None else min(want, room)


def client_settings(context: Optional[int], cli_args, model_context: Optional[int] = None
                    ) -> List[Tuple[str, str]]:
    """What the coding clients should be told of the served model, as ``(what, settings)``
    lines for the start log: the ``context`` (`served_context`; ``model_context``: the
    model's own, when the memory limit makes it less) and the answer limit, Codex's
    ``~/.codex/config.toml`` keys and Claude Code's environment variables."""
    out = explicit_max_tokens(cli_args)
    if context is None:
        return [("context", "unknown (the model's config names none; --context-length N "
                            "sets it): answers without a client limit stop at --max-tokens "
                            f"({int(getattr(cli_args, 'max_tokens', 0) or 0)})")]
    source = "--context-length" if getattr(cli_args, "context_length", None) else "model config"
    if model_context is not None and model_context > context:
        source = (f"the memory limit's for one request; the model's is {model_context} by its "
                  f"{source}")
    runs_to = f"--max-tokens {out}" if out is not None else "the end of the context"
    # Claude Code keeps its max output free below its window: a quarter leaves the
    # conversation most of it (and it asks 32000 at most by default).
    claude_out = min(out if out is not None else context, context // 4, 32000)
    # Codex sends no output limit: it needs model_max_output_tokens only where the
    # server's --max-tokens bounds the answers.
    codex_out = f"model_max_output_tokens = {out}, " if out is not None else ""
    return [
        ("context", f"{context} tokens ({source}); answers without a client limit run to "
                    f"{runs_to}; longer prompts get a 400"),
        ("Codex ~/.codex/config.toml", f"model_context_window = {context}, {codex_out}"
                                       f"model_auto_compact_token_limit = {int(context * 0.9)}"),
        ("Claude Code environment", f"CLAUDE_CODE_AUTO_COMPACT_WINDOW={context} "
                                    f"CLAUDE_CODE_MAX_OUTPUT_TOKENS={claude_out}"),
    ]
