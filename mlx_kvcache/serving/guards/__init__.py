"""Every reason the server says no, before or while it works: who may use ``/v1/cache``
(`admin`), a stop that admits nothing new (`lifecycle`), memory (`memory`), request fields
that would end mlx-lm's generation thread (`validation`), the model and its settings at
start (`startup`, `sharding`), the address it listens on (`listen`), slow and idle
connections (`connections`), the memory of request bodies (`body_budget`), images
(`images`), the model's context (`context`) and client text in the log (`log_text`). The
first part of ``serving/``: imports no other.
"""
