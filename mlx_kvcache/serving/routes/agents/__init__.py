"""The agent routes: Anthropic Messages (`anthropic`: ``/v1/messages``,
``/v1/messages/count_tokens``), OpenAI Responses (`responses`: ``/v1/responses``) and, for
the models whose tool calls only our parsers read, OpenAI chat completions (`chat`),
adapters at the server's HTTP handler onto the engine's typed front door (`generation`:
the call rendered with the model's chat template, then `engine.answer`: the same admission,
batching and prompt cache as mlx-lm's routes, the model's output parser) over a
conversation rendered so its prefix never breaks (`conversation`). The data they share is
`call`; the HTTP and server-sent-events side, `wire`. `post_routes` is the table the app
hands the handler.
"""

import json
from typing import Dict

from ..handler import PostRoute
from . import anthropic, chat, responses


def _chat_takes(handler, raw: bytes) -> bool:
    """Chat completions go through the front door for models whose tool calls only our
    parsers read (else mlx-lm's route serves them), when they ask for nothing only mlx-lm's
    route does (`chat.served_here`)."""
    generator = handler.response_generator
    try:
        if generator.served_model().parser.mlx_lm:
            return False
        return chat.served_here(json.loads(raw))
    except (ValueError, RuntimeError):  # mlx-lm's route says what is wrong
        return False


def post_routes() -> Dict[str, PostRoute]:
    """The agent routes by path, for `CacheAPIHandler`'s ``routes``."""
    chat_route = PostRoute(chat.serve_chat, chat.refusal, takes=_chat_takes,
                           followed=chat.follow_answer)
    return {
        "/v1/messages": PostRoute(anthropic.serve_messages, anthropic.refusal),
        "/v1/messages/count_tokens": PostRoute(anthropic.serve_count_tokens, anthropic.refusal),
        "/v1/responses": PostRoute(responses.serve_responses, responses.refusal),
        "/v1/chat/completions": chat_route,
        "/chat/completions": chat_route,
    }
