"""What mlx-lm's server holds in place of its ``LRUPromptCache``: `TriePromptCache`
(`prompt_cache`) over the loaded model's trie (`model_state`), the sequential path's fetch
(`sequential`), the conversions to and from mlx-lm's cache classes (`native`, `padding`,
`restored_merge`, `extract`), the request log (`request_log`), idle-time work (`idle_writes`,
`foresight`), clients kept apart (`namespace`), and the ranks of a sharded model
(`rank_turn`, `agreement`, `profile`). Imports ``guards`` only.
"""
