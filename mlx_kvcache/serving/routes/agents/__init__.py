"""The agent routes: Anthropic Messages (`anthropic`: ``/v1/messages``,
``/v1/messages/count_tokens``) and OpenAI Responses (`responses`: ``/v1/responses``),
adapters at the server's HTTP handler onto the engine's typed front door (`generation`:
the call rendered with the model's chat template, then `engine.answer`: the same admission,
batching and prompt cache as mlx-lm's routes, the model's output parser) over a
conversation rendered so its prefix never breaks (`conversation`). The data they share is `call`; the HTTP and server-sent-events side,
`wire`. `post_routes` is the table the app hands the handler.
"""

from typing import Dict

from ..handler import PostRoute
from . import anthropic, responses


def post_routes() -> Dict[str, PostRoute]:
    """The agent routes by path, for `CacheAPIHandler`'s ``routes``."""
    return {
        "/v1/messages": PostRoute(anthropic.serve_messages, anthropic.refusal),
        "/v1/messages/count_tokens": PostRoute(anthropic.serve_count_tokens, anthropic.refusal),
        "/v1/responses": PostRoute(responses.serve_responses, responses.refusal),
    }
