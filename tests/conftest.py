# Importing mlx_kvcache first lets it preload a fast system BLAS before MLX loads.
import os
import tempfile
from pathlib import Path

import mlx_kvcache  # noqa: F401

# Under pytest-xdist (`-n 2`) each worker gets a temporary directory of its own, kept
# between runs. MLX's CPU build compiles kernels into $TMPDIR/mlx and checks only whether
# the library file exists — nothing guards against another process writing the same one:
# two workers (and the servers they start, which inherit TMPDIR) compiling the same kernel
# at once on a fresh machine could load a half-written library.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    _own = Path(tempfile.gettempdir()) / f"mlx-kvcache-tests-{_worker}"
    _own.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_own)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
