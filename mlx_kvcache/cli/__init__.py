"""``mlx-kvcache``: the command-line front ends, one module per command.

``chat`` (a terminal chat that reuses the conversation prefix, its conversation logic in
``session``), ``serve`` (mlx-lm's server with the prefix cache); ``common`` holds what the
commands share.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import chat, serve
from .common import human_bytes, parse_bytes
from .session import ChatSession

__all__ = ["main", "ChatSession", "parse_bytes", "human_bytes"]

_COMMANDS = {"chat": chat, "serve": serve}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-kvcache", description="MLX KV caches with prefix reuse.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``mlx-kvcache`` script; returns the exit code."""
    import warnings

    from .common import format_warning

    warnings.formatwarning = format_warning  # one clean line, no source excerpt
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # every mlx_lm.server option passes through untouched
        return serve.run_argv(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _COMMANDS[args.command].run(args, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:  # pragma: no cover
            pass
        return 0
