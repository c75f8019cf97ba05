"""A hybrid model on our engine: TTFT with a cached prefix, and batching vs mlx-lm.

Issue 15's bars, on a random-weight qwen3_5 (Gated DeltaNet layers with two
full-attention layers between them; fp32 on CPU, loaded as a checkpoint
would be: zoo.finish):

- TTFT with a 2,500-token shared prefix, cached / cold. A recurrent state
  cannot be trimmed back to a shared prefix, so the engine restores a state
  snapshot (engine/hybrid_state.py). Requests: P + a, P + b (the second leaves the
  cached prefix at its branch point, where a snapshot is taken), then the
  measured P + c (restores it and prefills its own ~20 tokens); cold: a
  prompt of the same length never seen. The bar is <= 0.05.
- Aggregate output tokens/s at 1 and 8 concurrent requests vs mlx-lm's
  ``BatchGenerator`` on the same model object (its ArraysCache / KVCache
  batching), greedy, EOS ignored, fresh prompts each run. The bar is >= 1.0x at 8.

Run::

    .venv/bin/python bench/bench_hybrid.py --reps 3

Prints Markdown tables for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zoo_batch import ours, random_model, theirs
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models.loaded import LoadedModel
from mlx_cairn.testing.engine_checks import greedy_base
from mlx_cairn.testing.tiny_configs import VOCAB
from mlx_cairn.types import Done

PREFIX = 2500
SUFFIX = 20

TEXT = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_value_heads=8,
    linear_num_key_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def hybrid_model() -> LoadedModel:
    return random_model(
        "qwen3_5",
        text_config={**TEXT, "model_type": "qwen3_5_text"},
        max_position_embeddings=TEXT["max_position_embeddings"],
    )


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(3, VOCAB - 1, size=n)]


def ttft_ms(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    base = greedy_base(engine, 1)
    s = engine.submit(dataclasses.replace(base, prompt_ids=prompt))
    done = list(s.iter_sync(timeout=600))[-1]
    assert isinstance(done, Done), done
    return done.timings.ttft_ms, done.usage.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="generated per request (batching)")
    args = ap.parse_args()
    lm = hybrid_model()
    engine = Engine(lm, EngineConfig(num_blocks=2048, block_size=16))
    rng = np.random.default_rng(0)
    cold: list[float] = []
    warm: list[float] = []
    cached: list[int] = []
    ttft_ms(engine, ids(rng, 64))  # warm-up (graph shapes, BLAS threads)
    for rep in range(args.reps):
        p = ids(rng, PREFIX)
        c, _ = ttft_ms(engine, ids(rng, PREFIX + SUFFIX))
        ttft_ms(engine, p + ids(rng, SUFFIX))
        ttft_ms(engine, p + ids(rng, SUFFIX))  # leaves the cached prefix: branch snapshot
        w, hit = ttft_ms(engine, p + ids(rng, SUFFIX))
        cold.append(c)
        warm.append(w)
        cached.append(hit)
        print(f"rep {rep}: cold {c:.0f} ms, cached {w:.1f} ms ({hit} tokens cached)", flush=True)
    st = engine.stats()
    res: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for conc in (1, 8):
            prompts = [ids(np.random.default_rng(500 + 37 * rep + i), 128) for i in range(conc)]
            a, ta = ours(engine, prompts, args.tokens)
            b, tb = theirs(lm.model.inner, prompts, args.tokens)
            res.setdefault(("cairn", conc), []).append(a)
            res.setdefault(("mlx-lm", conc), []).append(b)
            print(
                f"rep {rep} x{conc}: cairn {a:.1f} tok/s, BatchGenerator {b:.1f} tok/s,"
                f" same first-row tokens: {ta == tb}",
                flush=True,
            )
    engine.close()
    print()
    print(f"load average after: {os.getloadavg()}")
    print()
    mc, mw = statistics.median(cold), statistics.median(warm)
    print("| prompt | cold TTFT ms | cached TTFT ms | cached tokens | cached / cold |")
    print("|---|---|---|---|---|")
    print(
        f"| {PREFIX} shared + {SUFFIX} | {mc:.0f} | {mw:.1f} | {statistics.median(cached):.0f}"
        f" | {mw / mc:.3f} |"
    )
    print(
        f"\nsnapshots stored: {st.state_snapshots} ({st.state_snapshot_bytes / 2**20:.1f} MiB),"
        f" restored {st.state_snapshot_hits} times"
    )
    print()
    print("| concurrency | cairn tok/s | BatchGenerator tok/s | ratio |")
    print("|---|---|---|---|")
    for conc in (1, 8):
        a = statistics.median(res[("cairn", conc)])
        b = statistics.median(res[("mlx-lm", conc)])
        print(f"| {conc} | {a:.1f} | {b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
