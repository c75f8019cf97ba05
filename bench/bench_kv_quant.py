"""Quantized KV blocks (``--kv-bits``): tokens per GiB, and decode speed at 8 x 4k (issue 39).

One process, the embedded SmolLM2-135M (fp32 on CPU). It reports:

- capacity: the tokens an engine's pool holds in a fixed ``--budget-gb``
  (``Engine(lm, EngineConfig(kv_cache_gb=...))``, its ``kv_pool_tokens`` stat: what ``/health``
  and ``/metrics`` say), so the longest context that fits, at each KV width.
  The ratio that matters is against the full-precision pool the server uses by
  default on this machine (``kv_dtype``: fp32 on a CPU, the model's dtype on a
  GPU). Scales and biases are stored in the pool dtype, as ``mx.quantize``
  returns them for input of that dtype: fp32 here, 16 bits on a Mac serving a
  bf16/fp16 model. So the Mac picture (16-bit pools against 8/4 bits with
  16-bit scales) is printed too, measured the same way with ``kv_dtype=fp16``.
  The issue's bars: >= 1.9x at 8 bits, >= 3.3x at 4 bits;
- decode steps (the model over a ``PagedKVCache``, logits of every row, the
  pools evaluated) for ``--rows`` rows of ``--context`` positions each, over
  pools filled with random K/V: full precision gathering every block, full
  precision through the decode mirror (what the engine picks there), and 8 / 4
  bits (quantized pools gather their packed blocks; mlx-lm's quantized attention
  runs over them; no mirror). Rounds alternate the order of the sides.

Run (capacity: seconds; decode: about 2 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_kv_quant.py --capacity-only
    .venv/bin/python bench/bench_kv_quant.py --rows 8 --context 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import mlx.core as mx

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.parts import layer_specs
from mlx_cairn.models import load

BLOCK = 16


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


def pool_tokens(
    loaded: Any, budget_gb: float, dtype: mx.Dtype, bits: int | None
) -> tuple[int, float]:
    """(tokens, bytes per token) of the pool an engine sizes from ``budget_gb``."""
    e = Engine(
        loaded, EngineConfig(kv_cache_gb=budget_gb, block_size=BLOCK, kv_dtype=dtype, kv_bits=bits)
    )
    try:
        st = e.stats()
        return st.kv_pool_tokens, e._pools.nbytes / (e._pools.num_blocks * BLOCK)
    finally:
        e.close()


def capacity(loaded: Any, budget_gb: float) -> None:
    """Tokens the pool holds in ``budget_gb`` at each KV width, against the full-precision
    pool the server uses by default here, and the 16-bit (Mac) picture."""
    # The engine's own choice of pool dtype (Engine's ``kv_dtype`` default).
    default = mx.float32 if mx.default_device() == mx.cpu else loaded.model.dtype
    dname = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}[default]
    here = "CPU" if mx.default_device() == mx.cpu else "GPU"
    sides = [
        (f"full precision, {dname} (server default on this {here})", default, None, "default"),
        (f"8-bit, {dname} scales/biases", default, 8, "default"),
        (f"4-bit, {dname} scales/biases", default, 4, "default"),
        ("full precision, fp16 (a Mac serving a 16-bit model)", mx.float16, None, "fp16"),
        ("8-bit, fp16 scales/biases", mx.float16, 8, "fp16"),
        ("4-bit, fp16 scales/biases", mx.float16, 4, "fp16"),
    ]
    got = {name: pool_tokens(loaded, budget_gb, dt, bits) for name, dt, bits, _ in sides}
    base = {"default": got[sides[0][0]][0], "fp16": got[sides[3][0]][0]}
    print(
        f"| KV width | bytes/token | tokens in {budget_gb:g} GiB (longest context) "
        f"| vs full precision, same scale dtype | vs {dname} (default here) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, _, _, against in sides:
        tokens, per = got[name]
        print(
            f"| {name} | {per:.0f} | {tokens:,} | {tokens / base[against]:.2f}x "
            f"| {tokens / base['default']:.2f}x |",
            flush=True,
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per side per round")
    ap.add_argument("--budget-gb", type=float, default=1.0)
    ap.add_argument("--capacity-only", action="store_true", help="skip the decode timing")
    args = ap.parse_args()
    loaded = load()
    model = loaded.model
    specs = layer_specs(model)

    capacity(loaded, args.budget_gb)
    if args.capacity_only:
        return

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
    pools: dict[str, KVPools] = {}
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
