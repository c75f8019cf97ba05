"""A burst whose requests straddle a step: TTFT and the longest step (issue 17).

``n`` chat requests on an in-process :class:`Engine` over the embedded model;
the first ``k`` are submitted, the rest 20 ms later, while the first step (the
first ``k`` prompts' prefill) runs. The step after it holds the first ``k``
rows' decode and the rest's prefill: two forward calls in one step. Before
issue 17's fix MLX ran the second call's in-place pool writes before the
first call's pool reads and copied every pool (2 GiB) there. Reports per
round the TTFTs and the longest engine step (wall time of ``Engine._step``).

Run (about a minute)::

    .venv/bin/python bench/bench_burst.py
    # the parent commit, for comparison: a checkout of it with this build's _core
    PYTHONPATH=/path/to/parent/python .venv/bin/python bench/bench_burst.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
from bench_http import prompt  # bench/ is on sys.path
from mlx_cairn.engine import Engine
from mlx_cairn.engine import engine as engine_mod
from mlx_cairn.models import load
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

STEPS: list[float] = []


def timed_step(step):  # type: ignore[no-untyped-def]
    def wrapped(self: Engine) -> None:
        t = time.perf_counter()
        step(self)
        STEPS.append(time.perf_counter() - t)

    return wrapped


def burst(engine: Engine, n: int, k: int, rnd: int, tokens: int) -> tuple[list[float], float]:
    reqs = [
        ChatRequest(
            messages=[Message("user", prompt(i, rnd, 7))],
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
        )
        for i in range(n)
    ]
    STEPS.clear()
    streams = [engine.submit(r) for r in reqs[:k]]
    time.sleep(0.02)
    streams += [engine.submit(r) for r in reqs[k:]]
    dones = [list(s.iter_sync(timeout=600))[-1] for s in streams]
    assert all(isinstance(d, Done) for d in dones), dones
    return [d.timings.ttft_ms / 1000 for d in dones], max(STEPS)  # type: ignore[union-attr]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args(argv)
    engine_mod.Engine._step = timed_step(engine_mod.Engine._step)  # type: ignore[method-assign]
    engine = Engine(load())
    try:
        burst(engine, 1, 1, -1, 4)  # warm-up
        longest, ttfts = [], []
        for rnd in range(args.rounds):
            k = 1 + rnd % (args.n - 1)
            ttft, step = burst(engine, args.n, k, rnd, args.tokens)
            longest.append(step)
            ttfts += ttft
            print(
                f"round {rnd}: first {k} then {args.n - k}: TTFT "
                f"{min(ttft):.2f}-{max(ttft):.2f} s, longest step {step:.2f} s",
                flush=True,
            )
        print(
            f"TTFT p50 {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s; "
            f"longest step median {statistics.median(longest):.2f} s"
        )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
