"""Decode steps with the weights in three CPU layouts (backends/cpu/layout.py), and the decode kernel.

The embedded SmolLM2-135M (fp32) is loaded once with ``CAIRN_CPU_LAYOUT=0``;
each of its dense linears and its head is then also built as a
``BlockedLinear`` of 768-column blocks (the layout of earlier commits: wide
linears and the head only) and as one transposed block (this commit: every
dense linear and the head). A fourth side runs the transposed block with our
decode kernel (``cairn_blas``, through our ``cblas_sgemm``) serving the
products of 1-12 rows; the other three leave every product to OpenBLAS
(``_blas.set_decode_gemm``). Each side times whole decode forward calls
(``--rows`` rows at 100-131 positions of context over the paged cache,
logits of every row), the sides taking turns step by step in a rotating
order; the medians are reported with the ratios plain / one block (mlx-lm
runs the plain ``x @ W.T`` layout) and one block / with the kernel.

Run (about 3 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_layout.py
    .venv/bin/python bench/bench_layout.py --rows 1,8,12,16 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["CAIRN_CPU_LAYOUT"] = "0"  # load plain; the layouts are built below

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import mlx.core as mx
import mlx.nn as nn

from mlx_cairn.backends.cpu import blas as _blas
from mlx_cairn.backends.cpu.layout import BlockedLinear
from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.parts import layer_specs
from mlx_cairn.models import load

LAYOUTS = ("plain", "768-column blocks", "one transposed block")
#: Each side: its weight layout and whether the decode kernel serves its products.
SIDES = {x: (x, False) for x in LAYOUTS} | {"transposed + decode kernel": (LAYOUTS[2], True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="steps per side, rows and round")
    args = ap.parse_args()
    model = load().model
    linears: list[tuple[nn.Module, str, dict[str, nn.Module]]] = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in parent.children().items():
                if type(child) is nn.Linear:
                    wide = child.weight.shape[0] > child.weight.shape[1]
                    mods = {
                        LAYOUTS[0]: child,
                        LAYOUTS[1]: BlockedLinear(child.weight, None, 768) if wide else child,
                        LAYOUTS[2]: BlockedLinear(child.weight, None, None),
                    }
                    linears.append((parent, name, mods))
    table = model.model.embed_tokens.weight  # tied head
    heads = {LAYOUTS[0]: None, LAYOUTS[1]: BlockedLinear(table, None, 768)}
    heads[LAYOUTS[2]] = BlockedLinear(table, None, None)
    mx.eval([m.parameters() for _, _, v in linears for m in v.values()])
    mx.eval([h.parameters() for h in heads.values() if h is not None])

    def use(side: str) -> None:
        layout, kernel = SIDES[side]
        _blas.set_decode_gemm(kernel)
        for parent, name, mods in linears:
            setattr(parent, name, mods[layout])
        if heads[layout] is None:
            if "head" in model:
                del model["head"]
        else:
            model.head = heads[layout]

    pools = KVPools(num_blocks=1024, block_size=16, layers=layer_specs(model))

    def step_ms(rows: int, j: int) -> float:
        tables = [list(range(1 + b * 10, 1 + (b + 1) * 10)) for b in range(rows)]
        tokens = mx.array([[17]] * rows, dtype=mx.int32)
        cache = PagedKVCache(pools, tables, [100 + j % 32] * rows, 1)
        logits = model.logits(model(tokens, cache)[:, -1, :])
        t = time.perf_counter()
        mx.eval(logits, *pools.arrays())
        return (time.perf_counter() - t) * 1e3

    rows_list = [int(x) for x in args.rows.split(",")]
    got: dict[tuple[int, str], list[float]] = {}
    sides = list(SIDES)
    # Sides take turns step by step (the order rotating), so that the box's
    # drifts in speed land on all of them alike.
    for rnd in range(args.rounds):
        for rows in rows_list:
            for j in range(args.steps):
                turn = (rnd * args.steps + j) % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    use(side)
                    got.setdefault((rows, side), []).append(step_ms(rows, j))
    _blas.set_decode_gemm(True)
    print("| rows | " + " | ".join(f"{x} ms/step" for x in sides)
          + " | plain / one block | one block / + decode kernel |")  # fmt: skip
    print("|---:|" + "---:|" * (len(sides) + 2))
    for rows in rows_list:
        med = [statistics.median(got[(rows, x)]) for x in sides]
        cells = " | ".join(f"{m:.1f}" for m in med)
        print(f"| {rows} | {cells} | {med[0] / med[2]:.2f}x | {med[2] / med[3]:.2f}x |")


if __name__ == "__main__":
    main()
