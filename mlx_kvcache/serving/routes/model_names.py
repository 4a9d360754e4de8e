"""Which model a request's ``"model"`` names, which models may run code, and what
``GET /v1/models`` lists.

mlx-lm's server loads whatever a request names (``"model"``, ``"draft_model"``) with the operator's ``--trust-remote-code``: a request naming a directory
whose ``config.json`` has a ``model_file`` runs that file, and a name that is a path tells
the client whether that directory exists. Here a name is read by its spelling alone —
never looked up on the file system or the Hugging Face cache — as one of:

* the served model (`served_names`: ``default_model``, `served_id`, the ``--model`` as
  given and as an absolute path): `DEFAULT`;
* a model the operator lists (``--switch-model``, repeatable): loaded as listed;
* a *model reference* (`is_reference`: it holds a ``/`` — a path or a Hugging Face repo
  id ``owner/name`` — or starts with ``~`` or ``.``): loaded as mlx-lm loads it only
  with ``--allow-model-switch``; else refused (`refusal`, a 404 that says how to allow it);
* any other name (``"gpt-4o"``, Claude Code's ``"claude-sonnet-5"``): an alias of the
  served model (the response still echoes the name the client sent).

Only the operator's models run their own code (`trusted`: ``--model``, ``--draft-model``
and the ``--switch-model`` list, under ``--trust-remote-code``): a model a request names
through ``--allow-model-switch`` loads with remote code off, whatever the flag.

``/v1/models`` lists the served model under `served_id` (the id clients should send),
with its context length (the caller's: `context.served_context`) as ``context_length``
and, as vLLM names it, ``max_model_len`` (absent when unknown), then the listed models.
Every name answered by the served model is one model to mlx-lm's batching (`batch_key`).

The rule reads only the name and the command line, so every rank of a sharded model picks
the same model.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["DEFAULT", "served_id", "served_names", "is_reference", "resolve", "refusal",
           "ModelRefusal", "trusted", "install", "batch_key", "models_listing", "model_entry",
           "switch_note"]

#: mlx-lm's name for the model given on the command line.
DEFAULT = "default_model"
#: The longest name quoted back in a refusal.
_QUOTED = 120


@functools.lru_cache(maxsize=8)
def _absolute(model: str) -> Optional[str]:
    """The operator's ``--model`` as an absolute path, when it is a local one (read once:
    the operator's own path, never a client's)."""
    p = Path(os.path.expanduser(model))
    return str(p.resolve()) if p.exists() else None


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
    return _absolute(str(model)) or str(model)


def served_names(cli_args) -> Tuple[str, ...]:
    """Every name of the served model: `DEFAULT`, `served_id`, ``--model`` as given and as
    an absolute path."""
    names = [DEFAULT]
    model = getattr(cli_args, "model", None)
    for n in (served_id(cli_args), model, _absolute(str(model)) if model else None):
        if n and n not in names:
            names.append(str(n))
    return tuple(names)


def _listed(cli_args) -> Tuple[str, ...]:
    return tuple(str(m) for m in getattr(cli_args, "switch_model", None) or ())


def is_reference(name: str) -> bool:
    """Whether ``name`` is spelled as a model to load rather than an alias: it holds a
    ``/`` (a path, or a Hugging Face repo id ``owner/name``) or a ``\\``, or starts with
    ``~`` or ``.``. Read from the spelling only."""
    return "/" in name or "\\" in name or name.startswith(("~", "."))


@dataclasses.dataclass(frozen=True)
class ModelRefusal:
    """A request naming a model this server will not load: its ``field`` (``model``,
    ``draft_model``) and the ``message`` (it says how to allow it)."""

    field: str
    message: str

    def error(self) -> Dict[str, Any]:
        """OpenAI's error object for it (``model_not_found``)."""
        return {"message": self.message, "type": "invalid_request_error", "param": self.field,
                "code": "model_not_found"}


def _choose(cli_args, name: str) -> Tuple[str, bool]:
    """(what to load for ``name``, whether it may load): see the module doc."""
    if name in served_names(cli_args):
        return DEFAULT, True
    if name in _listed(cli_args):
        return name, True
    if is_reference(name):
        return name, bool(getattr(cli_args, "allow_model_switch", False))
    return DEFAULT, True


def resolve(cli_args, name: Any) -> Any:
    """The name mlx-lm's model provider should load for a request's ``"model"``:
    `DEFAULT` for the served model's names and for aliases, a listed or (with
    ``--allow-model-switch``) referenced model as named. A name `refusal` refuses comes
    back as it is (the provider's load refuses it too: `install`). A value that is not a
    string is left for mlx-lm's own checks (400)."""
    if not isinstance(name, str) or getattr(cli_args, "model", None) is None:
        return name  # (no served model to answer with: mlx-lm's own behaviour)
    return _choose(cli_args, name)[0]


def _quoted(name: str) -> str:
    return repr(name if len(name) <= _QUOTED else name[:_QUOTED] + "…")


def refusal(cli_args, model: Any, draft: Any = DEFAULT) -> Optional[ModelRefusal]:
    """Why a request naming ``model`` (and ``draft``, as mlx-lm's field ``draft_model``
    names it) is not served, or None. A model reference other than the served and listed
    models is refused without ``--allow-model-switch``; so is a draft model other than the
    operator's. (A request's ``adapters`` apply only to a model it loads: mlx-lm gives the
    served model the operator's ``--adapter-path`` whatever the request says.)"""
    if getattr(cli_args, "model", None) is None or getattr(cli_args, "allow_model_switch",
                                                            False):
        return None
    how = ("a request may load another model only when the server runs with "
           "--allow-model-switch (or lists it with --switch-model)")
    if isinstance(model, str) and not _choose(cli_args, model)[1]:
        return ModelRefusal("model", f"the model {_quoted(model)} is not served here: this server "
                       f"serves {served_id(cli_args)!r} (GET /v1/models lists it; any name "
                       f"without a '/' is answered by it); {how}")
    operator_draft = getattr(cli_args, "draft_model", None)
    if isinstance(draft, str) and draft not in (DEFAULT, operator_draft):
        return ModelRefusal("draft_model", f"the draft model {_quoted(draft)} is not this "
                       f"server's (--draft-model); {how}")
    return None


def trusted(cli_args, path: Any) -> bool:
    """Whether the model at ``path`` (as mlx-lm's provider loads it) may run its own code:
    only with ``--trust-remote-code``, and only for the operator's models — ``--model``,
    ``--draft-model`` and the ``--switch-model`` list — never one a request names."""
    if not getattr(cli_args, "trust_remote_code", False) or not isinstance(path, str):
        return False
    own = {getattr(cli_args, "model", None), getattr(cli_args, "draft_model", None),
           *_listed(cli_args)}
    return path in own - {None}


def install(provider) -> None:
    """Make ``provider`` (mlx-lm's ``ModelProvider``) load `resolve`'s choice for every
    route (its ``load`` is what every request goes through in the generation thread), and
    refuse what `refusal` refuses there too (`ValueError`: mlx-lm answers it as the
    request's error), whatever route it came by."""
    load = provider.load

    def load_resolved(model_path, adapter_path=None, draft_model_path=None):
        refused = refusal(provider.cli_args, model_path,
                          DEFAULT if draft_model_path is None else draft_model_path)
        if refused is not None:
            raise ValueError(refused.message)
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
    ``context`` length where known, then the ``--switch-model`` list."""
    sid = served_id(cli_args)
    data: List[Dict[str, Any]] = [] if sid is None else [_entry(sid, created, context)]
    data.extend(_entry(m, created, None) for m in _listed(cli_args) if m != sid)
    return {"object": "list", "data": data}


def model_entry(cli_args, created: int, name: str,
                context: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The body of ``GET /v1/models/<name>`` (OpenAI's model object): ``name`` when a
    request naming it is answered by the served model (``context``: its length), a listed
    model's, else None (404)."""
    if served_id(cli_args) is None:
        return None
    if name in _listed(cli_args) and name not in served_names(cli_args):
        return _entry(name, created, None)
    if resolve(cli_args, name) != DEFAULT:
        return None
    return _entry(name, created, context)


def _entry(name: str, created: int, context: Optional[int]) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"id": name, "object": "model", "created": created,
                             "owned_by": "mlx-kvcache"}
    if context is not None:
        entry["context_length"] = entry["max_model_len"] = context
    return entry


def switch_note(cli_args) -> str:
    """What the start log says of the model names requests may send."""
    listed = _listed(cli_args)
    also = f"; listed models it may switch to: {', '.join(listed)}" if listed else ""
    if getattr(cli_args, "allow_model_switch", False):
        return ("a request naming another model (a path or an owner/name repo id) has it "
                "loaded in place of the served one, never with remote code (--allow-model-"
                f"switch: such names also tell clients which directories hold models){also}")
    return ("any name without a '/' is answered by the served model; a request naming "
            f"another model gets a 404 (--allow-model-switch allows it){also}")
