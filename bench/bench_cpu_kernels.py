"""The fused fp32 CPU kernels (backends/cpu/kernels.py, backends/cpu/attention.py): on vs off.

One process, the same engine and weights; rounds alternate between the
fused kernels and MLX's own ops (``cpu_attention.disabled()`` turns every
one of them off: activations, attention, the sampler's softmax), so machine
noise hits both alike. Reports medians of:

- the kernels alone: ``swiglu`` over [M, 1536] x 30 layers, the sampler's
  softmax over [8, 49152], decode attention (8 rows, 1,024 keys, 30 layers);
- the embedded default model through the engine: time to first token of a
  ``--prompt``-token prompt (prefill), aggregate tokens/s of 1 and of 8
  concurrent greedy requests (128-token prompts), and of 8 sampled
  (temperature 1) requests.

Run::

    .venv/bin/python bench/bench_cpu_kernels.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterator

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
import numpy as np

from bench_zoo_batch import submit_ids  # bench/ is on sys.path
from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.backends.cpu import kernels as cpu_kernels
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.models.loaded import LoadedModel
from mlx_cairn.types import SamplingParams


@contextlib.contextmanager
def fused(on: bool) -> Iterator[None]:
    if on:
        yield
    else:
        with cpu_attention.disabled():
            yield


def best_median(fn: Callable[[], None], reps: int = 9) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def kernels(on: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    with fused(on):
        for m in (8, 128, 1024):
            g = mx.array(rng.normal(size=(m, 1536)).astype(np.float32))
            u = mx.array(rng.normal(size=(m, 1536)).astype(np.float32))
            out[f"swiglu [{m}, 1536] x 30"] = best_median(
                lambda g=g, u=u: mx.eval([cpu_kernels.swiglu(g + i, u) for i in range(30)])
            )
        x = mx.array(rng.normal(size=(8, 49152)).astype(np.float32))
        out["softmax [8, 49152]"] = best_median(lambda: mx.eval(cpu_kernels.softmax(x)))
        q = mx.array(rng.normal(size=(8, 9, 1, 64)).astype(np.float32))
        k = mx.array(rng.normal(size=(8, 3, 1024, 64)).astype(np.float32))
        v = mx.array(rng.normal(size=(8, 3, 1024, 64)).astype(np.float32))
        out["decode attention 8 x 1024 keys x 30"] = best_median(
            lambda: mx.eval([cpu_attention.attention(q, k, v, 0.125, None) for _ in range(30)])
        )
    return out


def prompt_ids(lm: LoadedModel, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, lm.tokenizer.vocab_size - 1, size=n)]


def run(
    engine: Engine, prompts: list[list[int]], n: int, temperature: float
) -> tuple[float, float]:
    """(aggregate output tokens/s, first row's time to first token in s)."""
    sampling = SamplingParams(temperature=temperature, seed=1)
    streams, dones, wall = submit_ids(engine, prompts, n, sampling)
    ttft = dones[0].timings.ttft_ms / 1000
    return sum(len(s.output_ids) for s in streams) / wall, ttft


def steal_ticks() -> int:
    """CPU time the hypervisor gave to other guests (/proc/stat), in ticks."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    lm = load(None)
    engine = Engine(
        dataclasses.replace(lm, eos_token_ids=set()), EngineConfig(num_blocks=2048, block_size=16)
    )
    res: dict[tuple[str, bool], list[float]] = {}
    seed = 0
    steal0 = steal_ticks()
    for rnd in range(args.rounds):
        for on in (rnd % 2 == 0, rnd % 2 == 1):  # alternate which side goes first
            for name, val in kernels(on).items():
                res.setdefault((name + " (ms)", on), []).append(val * 1000)
            with fused(on):
                seed += 1
                _, ttft = run(engine, [prompt_ids(lm, args.prompt, seed)], 1, 0.0)
                res.setdefault((f"prefill {args.prompt} tokens: TTFT (s)", on), []).append(ttft)
                for conc, temp in ((1, 0.0), (8, 0.0), (8, 1.0)):
                    seed += 1
                    prompts = [prompt_ids(lm, 128, 100 * seed + i) for i in range(conc)]
                    tps, _ = run(engine, prompts, args.tokens, temp)
                    kind = "greedy" if temp == 0 else "sampled"
                    res.setdefault((f"x{conc} {kind}: tok/s", on), []).append(tps)
            print(f"round {rnd} fused={on} done", flush=True)
    engine.close()
    print(f"\nload average after: {os.getloadavg()}; stolen CPU: {steal_ticks() - steal0} ticks\n")
    print("| measure | fused kernels | MLX ops | fused / MLX |")
    print("|---|---:|---:|---:|")
    for name in dict.fromkeys(k for k, _ in res):
        a, b = statistics.median(res[(name, True)]), statistics.median(res[(name, False)])
        faster = b / a if "tok/s" not in name else a / b
        print(f"| {name} | {a:.2f} | {b:.2f} | {faster:.2f}x faster |")


if __name__ == "__main__":
    main()
