"""Which model a request's ``"model"`` names, and what ``GET /v1/models`` lists.

mlx-lm's server loads whatever a request names: ``"default_model"`` is the served model,
anything else is handed to ``mlx_lm.load`` — so a client that sends its own name
(``"gpt-4o"``, Claude Code's ``"claude-sonnet-5"``) gets a 404 carrying a Hugging Face
network error, and on a machine without a Hugging Face cache ``/v1/models`` answers an
empty body (mlx-lm scans that cache and the scan raises). Here:

* the served model's own names are the served model; an existing local path, or a
  Hugging Face repo id (``owner/name``; offline, one in the local Hugging Face cache) is
  loaded as mlx-lm loads it;
* any other name is answered by the served model (the response still echoes the name the
  client sent);
* ``/v1/models`` lists the served model under `served_id`, the id clients should send,
  with its context length (the caller's: `context.context_length`) as ``context_length``
  and, as vLLM names it, ``max_model_len`` (absent when unknown);
* every name answered by the served model is one model to mlx-lm's batching
  (`batch_key`): mlx-lm compares the requested names and drains its batch when they differ.

The rule reads only the name, the local file system and ``HF_HUB_OFFLINE``, so every rank
of a sharded model (each resolves the request it is given, and mlx-lm already needs the
same paths on every host) picks the same model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["DEFAULT", "served_id", "resolve", "install", "batch_key", "models_listing",
           "model_entry"]

#: mlx-lm's name for the model given on the command line.
DEFAULT = "default_model"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def served_id(cli_args) -> Optional[str]:
    """The id ``/v1/models`` lists for the served model: ``--served-model-name`` when
    given (the embedded model and ``.gguf`` files get their model's name), else the
    ``--model`` repo id, or its directory's absolute path; None without a model."""
    name = getattr(cli_args, "served_model_name", None)
    if name:
        return str(name)
    model = getattr(cli_args, "model", None)
    if model is None:
        return None
    p = Path(os.path.expanduser(str(model)))
    return str(p.resolve()) if p.exists() else str(model)


def _served_names(cli_args) -> List[str]:
    names = [DEFAULT]
    for n in (served_id(cli_args), getattr(cli_args, "model", None)):
        if n:
            names.append(str(n))
    model = getattr(cli_args, "model", None)
    if model is not None and os.path.exists(os.path.expanduser(str(model))):
        names.append(str(Path(os.path.expanduser(str(model))).resolve()))
    return names


def resolve(cli_args, name: Any) -> Any:
    """The name mlx-lm's model provider should load for a request's ``"model"``:
    `DEFAULT` for the served model's own names and for any name that is neither an
    existing path nor a Hugging Face repo id mlx-lm could load (`_hub_may_load`); other
    names as they are (mlx-lm loads them).
    A value that is not a string is left for mlx-lm's own checks (400)."""
    if not isinstance(name, str):
        return name
    if getattr(cli_args, "model", None) is None:
        return name  # no served model to answer with: mlx-lm's own behaviour
    if name in _served_names(cli_args):
        return DEFAULT
    if os.path.exists(os.path.expanduser(name)) or (_REPO_ID.match(name) and _hub_may_load(name)):
        return name
    return DEFAULT


def _hub_may_load(repo_id: str) -> bool:
    """Whether mlx-lm could load the Hugging Face repo ``repo_id``: always with the Hub
    reachable (it downloads); offline (``HF_HUB_OFFLINE``), only one already cached."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - mlx-lm depends on it
        return True
    if not constants.HF_HUB_OFFLINE:
        return True
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a cache that cannot be read holds nothing
        return False


def install(provider) -> None:
    """Make ``provider`` (mlx-lm's ``ModelProvider``) load `resolve`'s choice for every
    route: its ``load`` is what every request goes through in the generation thread."""
    load = provider.load

    def load_resolved(model_path, adapter_path=None, draft_model_path=None):
        return load(resolve(provider.cli_args, model_path), adapter_path, draft_model_path)
    provider.load = load_resolved


def batch_key(cli_args, args) -> Any:
    """mlx-lm's generation arguments ``args`` with the requested model named as `resolve`
    names it, so two requests the served model answers under different names (Claude
    Code's main and side requests, ``/v1/messages`` beside the chat route) compare equal
    where mlx-lm's batching compares them (``args.model``)."""
    desc = getattr(args, "model", None)
    name = getattr(desc, "model", None)
    if desc is None or not isinstance(name, str):
        return args
    resolved = resolve(cli_args, name)
    if resolved != name:
        args.model = dataclasses.replace(desc, model=resolved)
    return args


def models_listing(cli_args, created: int, context: Optional[int] = None) -> Dict[str, Any]:
    """The body of ``GET /v1/models``: the served model under `served_id`, with its
    ``context`` length where known."""
    sid = served_id(cli_args)
    return {"object": "list",
            "data": [] if sid is None else [_entry(sid, created, context)]}


def model_entry(cli_args, created: int, name: str,
                context: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The body of ``GET /v1/models/<name>`` (OpenAI's model object): ``name`` when a
    request naming it is answered by the served model, else None (404)."""
    if served_id(cli_args) is None or resolve(cli_args, name) != DEFAULT:
        return None
    return _entry(name, created, context)


def _entry(name: str, created: int, context: Optional[int]) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"id": name, "object": "model", "created": created,
                             "owned_by": "mlx-kvcache"}
    if context is not None:
        entry["context_length"] = entry["max_model_len"] = context
    return entry
