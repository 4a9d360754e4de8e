"""Questions about a chat template, answered once.

The server asks a model's chat template a few questions by rendering probes: whether it
renders later system messages in place (`agents.conversation.system_policy`), whether it
honours ``enable_thinking`` (`agents.conversation.honours_thinking`), whether a
conversation's next request goes on past the answer (`answer_turn`). Each answer depends
only on the template and its arguments, so it is decided once and remembered here, keyed
by the tokenizer, its template's text and the arguments (a reloaded model with another
template is asked again). Deterministic probes, so every rank of a sharded model decides
the same.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

__all__ = ["decided"]

T = TypeVar("T")

_lock = threading.Lock()
_answers: Dict[Tuple[int, str, str, str], Any] = {}


def decided(tokenizer, question: str, template_args: Optional[Dict[str, Any]],
            probe: Callable[[], T]) -> T:
    """``probe()``'s answer to ``question`` for ``tokenizer``'s chat template with
    ``template_args``: computed the first time (outside the lock: a probe renders the
    template, and two threads asking at once both get the same answer), remembered after."""
    template = getattr(tokenizer, "chat_template", None)
    digest = hashlib.blake2b(str(template).encode(), digest_size=8).hexdigest()
    key = (id(tokenizer), digest, question, repr(sorted((template_args or {}).items())))
    with _lock:
        if key in _answers:
            return _answers[key]
    answer = probe()
    with _lock:
        return _answers.setdefault(key, answer)
