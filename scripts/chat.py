#!/usr/bin/env python
"""Chat with prefix reuse; same as ``mlx-kvcache chat`` (see ``mlx_kvcache/cli.py``).

    python scripts/chat.py [--model PATH_OR_REPO] [--system TEXT] [--max-tokens N] ...
"""

import sys

import mlx_kvcache  # noqa: F401  (first: preloads a fast BLAS before mlx loads)
from mlx_kvcache.cli import main

if __name__ == "__main__":
    sys.exit(main(["chat", *sys.argv[1:]]))
