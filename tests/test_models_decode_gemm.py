"""MLX's fp32 products through our ``cblas_sgemm`` (``backends/cpu/blas.py``, ``rust/bindings/src/blas.rs``).

Decode-sized ``x @ Wt`` products go to ``cairn_blas::sgemm``; every other call
(more rows, transposed operands, small weights) to OpenBLAS. Both must give
float64's answer up to fp32 rounding, through MLX's own ``@``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.backends.cpu import blas as _blas

pytestmark = pytest.mark.skipif(
    _blas.decode_gemm is None, reason="the kernel is for x86-64 Linux with AVX2 and FMA"
)


def _takes(m: int, n: int, k: int) -> bool:
    assert _blas.decode_gemm is not None
    return bool(_blas.decode_gemm.cairn_blas_takes(m, n, k))


def _check(x: mx.array, w: mx.array, y: mx.array) -> None:
    want = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64)
    k = x.shape[-1]
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=4e-5 * np.sqrt(k))


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 576, 1536), (8, 576, 1536), (12, 1536, 576), (5, 576, 1539), (13, 576, 1536),
     (64, 576, 576), (8, 16, 16), (3, 7, 4096)],
)  # fmt: skip
def test_products_match_float64_whichever_library_runs_them(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 1000 + n)
    x = mx.array(rng.standard_normal((m, k), dtype=np.float32))
    w = mx.array(rng.standard_normal((k, n), dtype=np.float32))
    _check(x, w, x @ w)  # NoTrans x NoTrans: ours where decode-sized
    _check(x, w, x @ mx.contiguous(w.T).T)  # transposed weight: always OpenBLAS
    assert _takes(m, n, k) == (m <= 12 and k * n >= 1 << 16)


def test_the_kernel_serves_decode_shapes_and_leaves_the_rest() -> None:
    assert _takes(8, 1536, 576) and _takes(1, 49152, 576)
    assert not _takes(13, 1536, 576) and not _takes(0, 1536, 576) and not _takes(8, 64, 64)


def test_a_rows_product_is_the_same_in_any_decode_batch() -> None:
    # One fused multiply-add per term, in order: a row's result is bit-identical
    # whether it runs alone or with up to 11 others.
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((576, 1536), dtype=np.float32))
    xs = mx.array(rng.standard_normal((12, 576), dtype=np.float32))
    alone = [np.asarray(xs[i : i + 1] @ w) for i in range(12)]
    for m in (2, 8, 12):
        batch = np.asarray(xs[:m] @ w)
        for i in range(m):
            assert np.array_equal(batch[i : i + 1], alone[i]), (m, i)


def test_switching_the_kernel_off_sends_everything_to_openblas() -> None:
    try:
        _blas.set_decode_gemm(False)
        assert not _takes(8, 1536, 576)
        rng = np.random.default_rng(3)
        x = mx.array(rng.standard_normal((8, 576), dtype=np.float32))
        w = mx.array(rng.standard_normal((576, 1536), dtype=np.float32))
        _check(x, w, x @ w)
    finally:
        _blas.set_decode_gemm(True)
    assert _takes(8, 1536, 576)


def test_cairn_decode_gemm_0_leaves_mlx_to_openblas_alone() -> None:
    code = (
        "import os, mlx_cairn, mlx_cairn.backends.cpu.blas as b, mlx.core as mx\n"
        "x = mx.ones((8, 576)); w = mx.ones((576, 1536))\n"
        "assert float((x @ w)[0, 0]) == 576.0\n"
        "print(b.decode_gemm is None, os.environ.get('OPENBLAS_THREAD_TIMEOUT'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "CAIRN_DECODE_GEMM": "0"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["True", "None"]
