"""Quantized KV blocks (``--kv-bits``): tokens per GiB, and decode speed at 8 x 4k (issue 39).

One process, the embedded SmolLM2-135M (fp32 on CPU). It reports:

- tokens the pool holds per GiB for fp32 pools (the CPU default), fp16, 8 and 4
  bits (``KVPools.block_bytes`` / ``paged_quant.block_bytes``: packed words,
  scales and biases counted), and so the longest context a fixed ``--budget-gb``
  holds at each width, as a ratio to 16 bits (the issue's bars: >= 1.9x at 8
  bits, >= 3.3x at 4);
- decode steps (the model over a ``PagedKVCache``, logits of every row, the
  pools evaluated) for ``--rows`` rows of ``--context`` positions each, over
  pools filled with random K/V: full precision gathering every block, full
  precision through the decode mirror (what the engine picks there), and 8 / 4
  bits (quantized pools gather their packed blocks; mlx-lm's quantized attention
  runs over them; no mirror). Rounds alternate the order of the sides.

Run (about 2 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_kv_quant.py
    .venv/bin/python bench/bench_kv_quant.py --rows 8 --context 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import mlx.core as mx

from mlx_cairn.engine.engine import _layer_specs
from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.paged_quant import block_bytes as quant_block_bytes
from mlx_cairn.models import load

BLOCK = 16
GIB = 1 << 30


def fill(pools: KVPools) -> None:
    """Random K/V in every block (quantized pools: the quantized random values)."""
    for lst in (pools.k, pools.v):
        for i, p in enumerate(lst):
            if p is None:
                continue
            if isinstance(p, tuple):
                h, n, bs, w = p[0].shape
                d = w * 32 // pools.kv_bits  # type: ignore[operator]
                x = mx.random.normal((h, n, bs, d)) * 0.5
                q = mx.quantize(x, group_size=pools.kv_group_size, bits=pools.kv_bits)
                lst[i] = (q[0], q[1].astype(pools.dtype), q[2].astype(pools.dtype))
            else:
                lst[i] = mx.random.normal(p.shape) * 0.5
    mx.eval(pools.arrays())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per side per round")
    ap.add_argument("--budget-gb", type=float, default=1.0)
    args = ap.parse_args()
    model = load().model
    specs = _layer_specs(model)

    per_token = {
        "fp32": KVPools.block_bytes(specs, BLOCK, 4) / BLOCK,
        "fp16": KVPools.block_bytes(specs, BLOCK, 2) / BLOCK,
        "8-bit": quant_block_bytes(specs, BLOCK, 8, 64, 4) / BLOCK,
        "4-bit": quant_block_bytes(specs, BLOCK, 4, 64, 4) / BLOCK,
    }
    print(
        f"| KV width | bytes/token | tokens/GiB | longest context in {args.budget_gb:g} GiB | vs fp16 |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, b in per_token.items():
        ctx = int(args.budget_gb * GIB // (b * BLOCK)) * BLOCK
        print(
            f"| {name} | {b:.0f} | {GIB / b:,.0f} | {ctx:,} | {per_token['fp16'] / b:.2f}x |",
            flush=True,
        )

    rows, context = args.rows, args.context
    per_row = (context + args.steps + 2 * BLOCK) // BLOCK
    tables = [list(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(rows)]
    tokens = mx.array([[17]] * rows, dtype=mx.int32)
    sides = {
        "fp32 gather": (None, False),
        "fp32 mirror": (None, True),
        "8-bit": (8, False),
        "4-bit": (4, False),
    }
    pools = {}
    for name, (bits, _) in sides.items():
        if bits is None and "fp32 gather" in pools:
            pools[name] = pools["fp32 gather"]
            continue
        n = (3 if bits is None else 1) * rows * per_row + 1  # room for a mirror
        p = KVPools(num_blocks=n, block_size=BLOCK, layers=specs, kv_bits=bits)
        p.mirror_min_positions = 0
        fill(p)
        pools[name] = p

    def step(p: KVPools, ids: tuple[object, ...], pos: int, mirror: bool) -> None:
        m = p.mirror_for(ids, [pos] * rows) if mirror else None
        cache = PagedKVCache(p, tables, [pos] * rows, 1, None, m)
        logits = model.logits(model(tokens, cache)[:, -1, :])
        mx.eval(logits, *p.arrays())

    times: dict[str, list[float]] = {s: [] for s in sides}
    names = list(sides)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            p, mirror = pools[name], sides[name][1]
            ids = tuple(object() for _ in range(rows))
            p.mirror = None
            step(p, ids, context, mirror)  # warm-up; fills a mirror (untimed)
            for j in range(1, args.steps + 1):
                t = time.perf_counter()
                step(p, ids, context + j, mirror)
                times[name].append(time.perf_counter() - t)
            p.mirror = None
    ms = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    best_full = min(ms["fp32 gather"], ms["fp32 mirror"])
    print()
    print(f"| {rows} rows x {context} context | ms/step | decode tok/s | vs best fp32 |")
    print("|---|---:|---:|---:|")
    for s, v in ms.items():
        print(f"| {s} | {v:.1f} | {rows / v * 1e3:.1f} | {best_full / v:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
