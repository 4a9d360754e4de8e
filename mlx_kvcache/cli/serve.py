"""``mlx-kvcache serve``: mlx-lm's OpenAI-compatible server with our prefix cache.

    mlx-kvcache serve                                   # the embedded SmolLM2, port 8080
    mlx-kvcache serve --model mlx-community/Qwen3-4B-4bit --port 8000
    mlx-kvcache serve --model path/to/dir --prompt-cache-bytes 4G --checkpoint-interval 1024

Every ``mlx_lm.server`` option is accepted unchanged (``mlx-kvcache serve --help`` lists
them with ours); the work is in `mlx_kvcache.serving`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional, TextIO

__all__ = ["add_parser", "run", "run_argv"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve``; its arguments are mlx-lm's server's, parsed there."""
    s = sub.add_parser("serve", add_help=False,
                       help="mlx-lm's OpenAI-compatible server with the prefix cache",
                       description=__doc__)
    s.add_argument("args", nargs=argparse.REMAINDER)
    return s


def run_argv(argv: List[str]) -> int:
    from ..serving import seam
    from ..serving.app import main

    try:
        seam.check()  # before exporting a model: one line if mlx-lm's seam changed
    except seam.SeamError:
        return main(argv)  # says so
    problem = _address_problem(list(argv))
    if problem is not None:
        sys.stderr.write(f"error: mlx-kvcache serve: {problem}\n")
        return 1
    argv = _resolve_model(list(argv))
    if argv is None:
        return 2
    return main(argv)


def _address_problem(argv) -> Optional[str]:
    """Why the server could not listen where ``argv`` asks (mlx-lm's defaults: 127.0.0.1,
    8080), or None: checked before a ``.gguf`` file (or the embedded model) is exported,
    which can take minutes; the server binds for good before its model loads. Only rank 0
    of an ``mlx.launch`` job listens; the other ranks do not check."""
    import os

    from ..serving.guards.listen import ListenError, check

    if os.environ.get("MLX_RANK", "0") != "0":
        return None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8080")
    p.add_argument("-h", "--help", action="store_true")
    known, _ = p.parse_known_args(argv)
    try:
        port = int(known.port)
    except ValueError:
        return None  # mlx-lm's parser says what is wrong with it
    if known.help:
        return None
    try:
        check(known.host, port)
    except ListenError as e:
        return str(e)
    return None


def _resolve_model(argv) -> Optional[list]:
    """Give mlx-lm a model directory: the embedded model (no ``--model``) and ``.gguf``
    files are exported once under the cache directory's ``models/``."""
    from ..models import ModelLoadError
    from ..models.default import DEFAULT_NAME, INSTALL_HINT, default_model_path
    from ..models.export import export_gguf
    from ..store import default_root, exports_dir

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--cache-dir")
    p.add_argument("--dequantize", action="store_true", default=None)
    p.add_argument("-h", "--help", action="store_true")
    known, _ = p.parse_known_args(argv)
    if known.help:
        return argv
    source = known.model
    name = Path(str(source)).stem if source is not None else DEFAULT_NAME
    if source is None:
        source = default_model_path()
        if source is None:
            sys.stderr.write(f"error: no --model given and the embedded default model is not "
                             f"installed ({INSTALL_HINT})\n")
            return None
    elif not str(source).lower().endswith(".gguf"):
        return argv
    root = exports_dir(known.cache_dir or default_root())
    try:
        d = export_gguf(source, root, dequantize=known.dequantize)
    except (ModelLoadError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return None
    logging.getLogger("mlx_kvcache").info("serving %s from the mlx-lm directory %s", source, d)
    out, skip = [], False
    for a in argv:  # drop the original --model
        if skip:
            skip = False
            continue
        if a == "--model":
            skip = True
            continue
        if a.startswith("--model="):
            continue
        out.append(a)
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out):
        out = ["--served-model-name", name, *out]
    return ["--model", str(d), *out]



def run(args, out: TextIO, err: TextIO) -> int:
    return run_argv(list(args.args))
