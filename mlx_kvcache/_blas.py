"""Give MLX's Linux CPU build a fast BLAS without the user having to ask.

The ``mlx-cpu`` wheel bundles a reference BLAS (~3 GFLOP/s for float32 matmul).
A system OpenBLAS is ~40x faster. Its symbols win over the bundled ones only if the
library is in the global symbol scope *before* ``mlx.core`` is loaded, so this module
must run before anything imports MLX. It does nothing on macOS (Accelerate is used
there), when MLX is already loaded, or when ``MLX_KVCACHE_BLAS=0``.
Set ``MLX_KVCACHE_BLAS=/path/to/libblas.so`` to choose the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("mlx_kvcache")

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

#: Path of the BLAS library that was preloaded, or None.
loaded: str | None = None


def find_blas() -> str | None:
    """Return the path of a system OpenBLAS, or None when none is installed."""
    choice = os.environ.get("MLX_KVCACHE_BLAS")
    if choice and choice != "1":
        return choice
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def preload() -> str | None:
    """Load a system OpenBLAS into the global symbol scope (Linux only).

    Returns the library's path, or None when nothing was (or could be) loaded.
    """
    global loaded
    if loaded or not sys.platform.startswith("linux"):
        return loaded
    if os.environ.get("MLX_KVCACHE_BLAS") == "0":
        return None
    if "mlx.core" in sys.modules:
        # Symbols are already bound to the bundled reference BLAS.
        log.debug("mlx.core was imported before mlx_kvcache; fast BLAS not preloaded")
        return None
    path = find_blas()
    if not path:
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # a broken library must never stop the import
        log.debug("could not preload %s: %s", path, e)
        return None
    loaded = path
    return path
