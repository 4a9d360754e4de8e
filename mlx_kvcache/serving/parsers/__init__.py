"""Output parsing, one seam: what a model's generated tokens are — text, reasoning, tool
calls — as typed events (`base`), by a parser chosen per model from one registry
(`registry`). The lowest part of ``serving/``: imports no other part.
"""
