"""Layer 5: the prefix cache behind mlx-lm's OpenAI-compatible server, in five parts that
import one way (docs/design.md; ``tests/test_architecture.py`` keeps it):

``parsers`` (what generated tokens are: text, reasoning, tool calls) < ``guards`` (every
reason to say no) < ``cache`` (`TriePromptCache`, what the server is
handed in place of its ``LRUPromptCache``) < ``engine`` (mlx-lm's generation thread,
overridden) < ``routes`` (HTTP, the agent APIs) < ``app`` (options, wiring through
constructors, running it, the stop) and ``seam`` (every mlx-lm internal we touch, probed).
"""

from .cache.prompt_cache import TriePromptCache

__all__ = ["TriePromptCache"]
