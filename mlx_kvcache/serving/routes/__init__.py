"""HTTP: `handler` (mlx-lm's handler plus ``/v1/cache`` and the ``POST`` routes the app
hands it), `model_names`, `body` (how every route reads a body), `namespace` (a request's
cache namespace), and `agents` (Anthropic Messages, OpenAI Responses). Imports the parts
below it.
"""
