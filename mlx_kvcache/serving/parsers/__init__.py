"""Output parsing, one seam: what a model's generated tokens are — text, reasoning, tool
calls — as typed events (`base`), by a parser chosen per model from one registry
(`registry`): mlx-lm's own parsing (`mlxlm`), and, read token by token with the model's own
tokenizer (`markup`), gpt-oss's harmony (`harmony`), Llama 3.x (`llama3`) and DeepSeek
V3 / V3.1 / R1 (`deepseek`). The lowest part of ``serving/``: imports no other part.
"""
