"""Load an optimized BLAS before MLX on Linux CPU (docs/design.md §5).

The `mlx[cpu]` wheel calls a bundled reference BLAS (about 4 GFLOP/s here).
Opening OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported makes
MLX resolve its BLAS symbols to it (about 150 GFLOP/s). This module must be
imported before anything imports ``mlx.core``; ``mlx_cairn/__init__.py`` does
that first thing.

Where the decode kernel can run, our own ``_core`` library joins the global
scope just before OpenBLAS: it exports a ``cblas_sgemm`` of its own
(``rust/bindings/src/blas.rs``), which MLX then binds. It computes the products of a decode step (at most 12 rows times a
weight matrix) with ``cairn_blas::sgemm``, which streams the weight once
instead of packing it first (OpenBLAS's way, which took a quarter of an
8-row step), and hands every other call to OpenBLAS's ``cblas_sgemm``.
``CAIRN_DECODE_GEMM=0`` leaves every product to OpenBLAS.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import warnings
from pathlib import Path

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "libopenblas.so",
)

#: Path of the BLAS that was loaded, or None.
loaded: str | None = None
#: Our ``_core`` library when its ``cblas_sgemm`` sits in front of the BLAS, else None.
decode_gemm: ctypes.CDLL | None = None


def _decode_kernel() -> ctypes.CDLL | None:
    """``_core``, opened locally for now, where the decode kernel can run (else None:
    turned off, not built yet, or a CPU without AVX2 and FMA)."""
    if os.environ.get("CAIRN_DECODE_GEMM", "1").lower() in ("0", "off"):
        return None
    spec = importlib.util.find_spec("mlx_cairn._core")
    if spec is None or not spec.origin:
        return None
    try:
        core = ctypes.CDLL(spec.origin)
        core.cairn_blas_set_fallback.argtypes = [ctypes.c_size_t]
        core.cairn_blas_set_enabled.argtypes = [ctypes.c_int]
        core.cairn_blas_takes.argtypes = [ctypes.c_int] * 3
    except (OSError, AttributeError):
        return None
    return core if core.cairn_blas_takes(8, 4096, 4096) else None


def _first_blas(names: list[str]) -> tuple[str, ctypes.CDLL] | None:
    """The first of ``names`` that opens (locally) and has ``cblas_sgemm``."""
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cblas_sgemm  # noqa: B018  (AttributeError where it lacks one)
        except (OSError, AttributeError):
            continue
        return name, lib
    return None


def _bundled_blas() -> list[Path]:
    """The reference BLAS inside the ``mlx`` wheel (what MLX calls without OpenBLAS)."""
    spec = importlib.util.find_spec("mlx")
    roots = [Path(p).parent for p in (spec.submodule_search_locations or [])] if spec else []
    return [f for root in roots for f in sorted(root.glob("mlx*.libs/libblas*.so*"))]


def set_decode_gemm(on: bool) -> None:
    """Route decode-sized products to our kernel (True) or all of them to the BLAS."""
    if decode_gemm is not None:
        decode_gemm.cairn_blas_set_enabled(int(on))


def ensure() -> str | None:
    """Load OpenBLAS globally if this is Linux and it is not loaded yet.

    Returns the library name that was loaded, or None (not Linux, disabled
    with ``CAIRN_NO_BLAS=1``, or not installed: then one warning says how to
    fix it).
    """
    global loaded, decode_gemm
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
    core = _decode_kernel()
    if core is not None:
        # OpenBLAS's idle threads spin for ~2**28 cycles after each call, and
        # on few cores that steals the decode kernel's; 2**4 lets them sleep.
        # (OpenBLAS reads it when it loads, just below.)
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    blas = _first_blas(list(_CANDIDATES))
    # Without OpenBLAS the other products go to MLX's own BLAS.
    fallback = blas or _first_blas([str(f) for f in _bundled_blas()])
    if core is not None and fallback is not None:
        core.cairn_blas_set_fallback(ctypes.cast(fallback[1].cblas_sgemm, ctypes.c_void_p).value)
        # Global symbols bind in the order libraries join the global scope: ours first.
        ctypes.CDLL(core._name, mode=ctypes.RTLD_GLOBAL)
        decode_gemm = core
    if blas is not None:
        ctypes.CDLL(blas[0], mode=ctypes.RTLD_GLOBAL)
        loaded = blas[0]
        return loaded
    warnings.warn(
        "OpenBLAS not found: MLX will use its slow reference BLAS on CPU. "
        "Install it with `apt-get install libopenblas0-pthread` (or run `make setup`).",
        RuntimeWarning,
        stacklevel=3,
    )
    return None
