"""Decode steps over a decode mirror vs gathering every row's blocks (engine/paged.py).

One process, the embedded SmolLM2-135M (fp32 on CPU), a KV pool filled with
random keys and values. For each ``--cases`` entry ``BxT`` (B rows, each with
T positions of context) it times whole decode forward calls (the model over a
``PagedKVCache``, logits of every row, the pools evaluated), rounds
alternating which side goes first:

- gather: every call copies each row's blocks, in every layer, into a fresh
  ``[kv_heads, B, T, dim]`` array (what every decode call did before);
- mirror: consecutive calls over the same rows keep that array between steps
  and write their new K/V into it (``KVPools.mirror_for``); its first call,
  which fills it, is not timed.

Reports the median step time per side and the ratio, and which side the
engine's default threshold (``MIRROR_MIN_POSITIONS`` of B x T) picks.

Run (about 3 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_mirror.py
    .venv/bin/python bench/bench_mirror.py --cases 1x100,1x12000 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import mlx.core as mx

from mlx_cairn.engine.paged import MIRROR_MIN_POSITIONS, KVPools, PagedKVCache
from mlx_cairn.engine.parts import layer_specs
from mlx_cairn.models import load

BLOCK = 16


def run_case(model, rows: int, context: int, rounds: int, steps: int) -> dict[str, float]:
    specs = layer_specs(model)
    per_row = (context + steps + 2 * BLOCK) // BLOCK
    # Room for the mirror too: it may take half the pools' bytes.
    pools = KVPools(num_blocks=3 * rows * per_row + 1, block_size=BLOCK, layers=specs)
    pools.mirror_min_positions = 0
    for i, (k, v) in enumerate(zip(pools.k, pools.v, strict=True)):
        if k is not None and v is not None:
            pools.k[i] = mx.random.normal(k.shape) * 0.5
            pools.v[i] = mx.random.normal(v.shape) * 0.5
    mx.eval(pools.arrays())
    tables = [list(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(rows)]
    tokens = mx.array([[17]] * rows, dtype=mx.int32)

    def step(ids: tuple[object, ...], pos: int, mirror: bool) -> None:
        m = pools.mirror_for(ids, [pos] * rows) if mirror else None
        cache = PagedKVCache(pools, tables, [pos] * rows, 1, None, m)
        logits = model.logits(model(tokens, cache)[:, -1, :])
        mx.eval(logits, *pools.arrays())

    times: dict[str, list[float]] = {"gather": [], "mirror": []}
    for rnd in range(rounds):
        order = ("gather", "mirror") if rnd % 2 == 0 else ("mirror", "gather")
        for side in order:
            ids = tuple(object() for _ in range(rows))  # new rows: a new mirror
            pools.mirror = None
            step(ids, context, side == "mirror")  # fills the mirror (untimed)
            for j in range(1, steps + 1):
                t = time.perf_counter()
                step(ids, context + j, side == "mirror")
                times[side].append(time.perf_counter() - t)
            pools.mirror = None
    return {side: statistics.median(v) * 1e3 for side, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x100,16x100,8x500,1x2000,1x6000,1x12000")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per side per round")
    args = ap.parse_args()
    model = load().model
    print("| rows x context | gather ms/step | mirror ms/step | gather / mirror | default picks |")
    print("|---|---:|---:|---:|---|")
    for case in args.cases.split(","):
        b, t = (int(x) for x in case.lower().split("x"))
        got = run_case(model, b, t, args.rounds, args.steps)
        pick = "mirror" if b * t >= MIRROR_MIN_POSITIONS else "gather"
        print(
            f"| {b} x {t} | {got['gather']:.1f} | {got['mirror']:.1f} | "
            f"{got['gather'] / got['mirror']:.2f}x | {pick} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
