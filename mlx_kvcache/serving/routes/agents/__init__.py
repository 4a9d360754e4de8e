"""The agent routes: Anthropic Messages (`anthropic`: ``/v1/messages``,
``/v1/messages/count_tokens``) and OpenAI Responses (`responses`: ``/v1/responses``),
adapters at the server's HTTP handler onto one generation path (`bridge`: mlx-lm's chat
machinery and our prompt cache) over a conversation rendered so its prefix never breaks
(`conversation`)."""
