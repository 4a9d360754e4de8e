"""mlx-lm's generation thread, overridden: `generator` (``ResponseGenerator`` with our
checkpoints, admission, commands and stop), `stream` (the sequential path's
``stream_generate``), `draft_use`, `reasoning_budget`, and the chat template's questions
(`templates`). Imports ``guards`` and ``cache``.
"""
