"""Layer 5: the prefix cache behind mlx-lm's OpenAI-compatible server.

``prompt_cache`` (`TriePromptCache`, the object the server is handed in place of its
``LRUPromptCache``), ``native`` (to and from mlx-lm's own cache classes), ``generator``
(checkpoints inside long prompt segments), ``handler`` (``/v1/cache``), ``seam`` (the
probe of mlx-lm's server and the patch of its ``main``), ``app`` (running it all).
"""

from .cache.prompt_cache import TriePromptCache

__all__ = ["TriePromptCache"]
