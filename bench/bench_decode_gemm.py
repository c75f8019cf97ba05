"""The products of one decode step: our decode kernel vs OpenBLAS, in one process.

SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up and down, as
``x @ Wt`` with the weights stored transposed, plus the 49152-wide head),
random fp32 weights, 540 MB in all so that every product streams its weight
from memory as in a real step. For each row count the two sides take turns
repetition by repetition (``_blas.set_decode_gemm`` switches MLX's
``cblas_sgemm`` between ``cairn_blas`` and OpenBLAS at run time); medians in
ms, and the ratio OpenBLAS / kernel.

Run (about 2 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_decode_gemm.py
    .venv/bin/python bench/bench_decode_gemm.py --rows 1,4,8,12,14,16 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads our cblas_sgemm and OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx

from mlx_cairn.backends.cpu import blas as _blas

#: (in, out) of one SmolLM2-135M layer's products: gate, up, down, q, o, k, v.
LAYER = [(576, 1536), (576, 1536), (1536, 576), (576, 576), (576, 576), (576, 192), (576, 192)]
LAYERS = 30
HEAD = (576, 49152)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,12,16")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if _blas.decode_gemm is None:
        raise SystemExit("no decode kernel here (it is for x86-64 Linux with OpenBLAS)")
    weights = [mx.random.normal(s) for _ in range(LAYERS) for s in LAYER]
    head = mx.random.normal(HEAD)
    mx.eval(weights, head)
    print("| rows | layers, kernel | layers, OpenBLAS | head, kernel | head, OpenBLAS "
          "| step's products, OpenBLAS / kernel |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {d: mx.random.normal((rows, d)) for d in (576, 1536)}
        mx.eval(list(xs.values()))
        got: dict[tuple[bool, str], list[float]] = {}
        for rep in range(args.reps + 1):
            for kernel in (True, False) if rep % 2 else (False, True):
                _blas.set_decode_gemm(kernel)
                t = time.perf_counter()
                mx.eval([xs[w.shape[0]] @ w for w in weights])
                t_layers = time.perf_counter() - t
                t = time.perf_counter()
                mx.eval(xs[576] @ head)
                t_head = time.perf_counter() - t
                if rep:  # the first is a warm-up
                    got.setdefault((kernel, "layers"), []).append(t_layers * 1e3)
                    got.setdefault((kernel, "head"), []).append(t_head * 1e3)
        _blas.set_decode_gemm(True)
        med = {key: statistics.median(v) for key, v in got.items()}
        ours = med[(True, "layers")] + med[(True, "head")]
        theirs = med[(False, "layers")] + med[(False, "head")]
        print(f"| {rows} | {med[(True, 'layers')]:.1f} | {med[(False, 'layers')]:.1f} "
              f"| {med[(True, 'head')]:.1f} | {med[(False, 'head')]:.1f} | {theirs / ours:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
