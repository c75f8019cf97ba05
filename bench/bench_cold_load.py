"""Cold start by name: first request for an unloaded model vs preload then request.

Each trial runs in a fresh process (so nothing is cached in memory):

- cold:      registry (lazy) -> first request: time from the request to its first token
             (load + prepare + prefill);
- preloaded: registry.preload() timed, then the same request's TTFT; the figure is
             load + TTFT.

Usage::

    .venv/bin/python bench/bench_cold_load.py [--trials 3] [--model PATH_OR_NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import asyncio, json, sys, time
from mlx_cairn.api.registry import ModelRegistry
from mlx_cairn.types import ChatRequest, Message, SamplingParams, TextDelta

mode, source = sys.argv[1], (sys.argv[2] or None)
reg = ModelRegistry([source])
name = reg.models[0].name
req = ChatRequest(messages=[Message("user", "Write one sentence about cairns.")],
                  max_tokens=8, sampling=SamplingParams(temperature=0))

async def first_token():
    t0 = time.perf_counter()
    lease = await reg.get(name)
    prepared = await asyncio.to_thread(lease.engine.prepare, req)
    async for ev in lease.engine.submit(prepared):
        if isinstance(ev, TextDelta):
            t = time.perf_counter() - t0
            break
    lease.release()
    return t

load = 0.0
if mode == "preloaded":
    t0 = time.perf_counter()
    reg.preload()
    load = time.perf_counter() - t0
ttft = asyncio.run(first_token())
reg.close()
print(json.dumps({"load": load, "ttft": ttft, "total": load + ttft}))
"""


def trial(mode: str, model: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, model], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--model", default="")
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"cold": [], "preloaded": []}
    for _ in range(args.trials):  # interleaved, so drift hits both alike
        for mode in rows:
            rows[mode].append(trial(mode, args.model))
    med = {m: statistics.median(r["total"] for r in rs) for m, rs in rows.items()}
    for mode, rs in rows.items():
        print(
            f"{mode:10s} load {statistics.median(r['load'] for r in rs):6.2f}s  "
            f"ttft {statistics.median(r['ttft'] for r in rs):6.2f}s  "
            f"total {med[mode]:6.2f}s  (median of {len(rs)})"
        )
    print(f"cold / preloaded: {med['cold'] / med['preloaded']:.3f}")


if __name__ == "__main__":
    main()
