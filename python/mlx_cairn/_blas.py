"""Load an optimized BLAS before MLX on Linux CPU (DESIGN.md §5).

The `mlx[cpu]` wheel calls a bundled reference BLAS (about 4 GFLOP/s here).
Opening OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported makes
MLX resolve its BLAS symbols to it (about 150 GFLOP/s). This module must be
imported before anything imports ``mlx.core``; ``mlx_cairn/__init__.py`` does
that first thing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "libopenblas.so",
)

#: Path of the BLAS that was loaded, or None.
loaded: str | None = None


def ensure() -> str | None:
    """Load OpenBLAS globally if this is Linux and it is not loaded yet.

    Returns the library name that was loaded, or None (not Linux, disabled
    with ``CAIRN_NO_BLAS=1``, or not installed: then one warning says how to
    fix it).
    """
    global loaded
    if loaded is not None or sys.platform != "linux" or os.environ.get("CAIRN_NO_BLAS"):
        return loaded
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx.core was imported before mlx_cairn; import mlx_cairn first so that the "
            "optimized BLAS is used on CPU (matmuls are ~40x slower otherwise)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    for name in _CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        return loaded
    warnings.warn(
        "OpenBLAS not found: MLX will use its slow reference BLAS on CPU. "
        "Install it with `apt-get install libopenblas0-pthread` (or run `make setup`).",
        RuntimeWarning,
        stacklevel=3,
    )
    return None
