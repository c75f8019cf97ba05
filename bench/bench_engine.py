"""Engine benchmark: continuous batching, paging overhead, prefix-cache TTFT (issue 8).

SmolLM2-135M-Instruct (the embedded GGUF, dequantized to fp32) with the
optimized BLAS loaded for every side, in one process, measured side by side:

1. aggregate generated tokens/s at 1, 2, 4, 8, 16 concurrent requests
   (distinct prompts, fixed output length, EOS ignored; wall time from the
   first submit to the last token, prefill included);
2. ``mlx_lm.batch_generate`` at 8 on the same weights (exported as an HF
   folder), same prompts and lengths, same wall-time measure;
3. single-stream decode tokens/s: the engine vs the one-sequence reference
   loop (``mlx_cairn.engine.reference``), interleaved runs;
4. time to first token for a ~2,500-token prompt whose system part is cached
   (a request with the same system prompt ran first) vs cold (new cache
   salt), and the same two cases through ``mlx_lm``'s prompt cache (the
   system part prefilled into a ``make_prompt_cache`` that is copied for
   the request, which is what ``mlx_lm.server`` does on a prefix hit).

Run (about 4 minutes on 2 idle cores; 10-15 minutes when they are shared)::

    .venv/bin/python bench/bench_engine.py            # --plot bench/engine.png --json out.json

Prints a Markdown report for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
from http_stream import TOPICS  # bench/ is on sys.path
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.reference import GenerationStats, generate_tokens
from mlx_cairn.models import load
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def story(i: int, max_tokens: int, salt: str | None = None) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", f"Write a long story about {TOPICS[i % len(TOPICS)]}.")],
        max_tokens=max_tokens,
        sampling=GREEDY,
        cache_salt=salt,
    )


def long_system(lm: Any, target_tokens: int) -> str:
    """A deterministic system prompt of about ``target_tokens`` tokens."""
    para = (
        "You are the assistant of a mountain hut. Guests ask about trails, cairns, weather, "
        "food and the history of the valley. Section {i}: the trail number {i} climbs past "
        "{j} cairns and a stream; it takes about {k} hours and is closed in deep snow. "
    )
    text, i = "", 0
    while len(lm.tokenizer.encode(text)) < target_tokens:
        text += para.format(i=i, j=3 + i % 7, k=1 + i % 5)
        i += 1
    return text


# ----------------------------------------------------------------- measures


def run_concurrent(engine: Engine, n: int, max_tokens: int, salt: str) -> dict[str, float]:
    """Submit ``n`` requests at once; aggregate generated tokens / wall time."""
    t0 = time.perf_counter()
    streams = [engine.submit(story(i, max_tokens, salt)) for i in range(n)]
    dones = [list(s.iter_sync(timeout=600))[-1] for s in streams]
    wall = time.perf_counter() - t0
    assert all(isinstance(d, Done) for d in dones), dones
    total = sum(d.usage.output_tokens for d in dones)
    return {"concurrency": n, "tokens": total, "wall_s": wall, "tok_s": total / wall}


def engine_single_decode(engine: Engine, max_tokens: int, salt: str) -> float:
    done = list(engine.generate_sync(story(0, max_tokens, salt), timeout=600))[-1]
    assert isinstance(done, Done)
    return done.timings.decode_tokens_per_s


def reference_single_decode(lm: Any, prompt_ids: list[int], max_tokens: int) -> float:
    stats = GenerationStats()
    for _ in generate_tokens(
        lm.model, prompt_ids, max_tokens=max_tokens, sampling=GREEDY, stats=stats
    ):
        pass
    return stats.decode_tokens_per_s


def engine_ttft(engine: Engine, system: str, user: str, salt: str) -> tuple[float, int]:
    req = ChatRequest(
        messages=[Message("system", system), Message("user", user)],
        max_tokens=1,
        sampling=GREEDY,
        cache_salt=salt,
    )
    done = list(engine.generate_sync(req, timeout=600))[-1]
    assert isinstance(done, Done), done
    return done.timings.ttft_ms, done.usage.cached_tokens


# ----------------------------------------------------------------- mlx_lm side


def mlx_lm_setup(lm: Any, folder: Path) -> tuple[Any, Any]:
    from mlx_lm import load as lm_load

    from mlx_cairn.models.export import save_folder

    if not (folder / "config.json").exists():
        save_folder(lm, folder)
    model, tok = lm_load(str(folder))
    tok._eos_token_ids = set()  # fixed-length generation, like the engine side
    return model, tok


def mlx_lm_batch(model: Any, tok: Any, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm import batch_generate

    t0 = time.perf_counter()
    res = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
    wall = time.perf_counter() - t0
    total = sum(len(t) for t in res.token_ids)
    return {"concurrency": len(prompts), "tokens": total, "wall_s": wall, "tok_s": total / wall}


def mlx_lm_ttft(model: Any, system_ids: list[int], full_ids: list[int], warm: bool) -> float:
    """First-token latency through mlx_lm with (warm) or without a cached system prefix."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    if warm:
        base = make_prompt_cache(model)
        for i in range(0, len(system_ids), 512):
            model(mx.array(system_ids[i : i + 512])[None], cache=base)
            mx.eval([c.state for c in base])
    t0 = time.perf_counter()
    if warm:
        cache = copy.deepcopy(base)
        rest = full_ids[len(system_ids) :]
    else:
        cache = make_prompt_cache(model)
        rest = full_ids
    tok, _ = next(generate_step(mx.array(rest), model, max_tokens=1, prompt_cache=cache))
    int(tok)
    return (time.perf_counter() - t0) * 1000


# ----------------------------------------------------------------- report


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["concurrency"] for r in results["sweep"]]
    a.plot(xs, [r["tok_s"] for r in results["sweep"]], "o-", label="mlx-cairn engine")
    m = results["mlx_lm_batch"]
    a.plot([m["concurrency"]], [m["tok_s"]], "s", color="tab:red", label="mlx_lm batch_generate")
    single = results["sweep"][0]["tok_s"]
    a.plot(xs, [single * x for x in xs], ":", color="gray", label="linear in concurrency")
    a.set_xscale("log", base=2)
    a.set_xticks(xs, [str(x) for x in xs])
    a.set_xlabel("concurrent requests")
    a.set_ylabel("aggregate generated tokens/s")
    a.set_title("SmolLM2-135M fp32, CPU (2 cores)")
    a.legend()
    t = results["ttft"]
    labels = ["engine cold", "engine cached", "mlx_lm cold", "mlx_lm cached"]
    vals = [t["engine_cold_ms"], t["engine_warm_ms"], t["mlx_lm_cold_ms"], t["mlx_lm_warm_ms"]]
    b.bar(labels, vals, color=["tab:blue", "tab:cyan", "tab:red", "tab:pink"])
    b.set_yscale("log")
    b.set_ylabel("time to first token (ms, log)")
    b.set_title(f"TTFT, {t['prompt_tokens']}-token prompt")
    b.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=2500)
    ap.add_argument("--repeats", type=int, default=2, help="single-stream / TTFT repeats")
    ap.add_argument("--plot", type=Path, default=Path(__file__).parent / "engine.png")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--export-dir", type=Path, default=Path(tempfile.gettempdir()) / "cairn-smollm2-hf"
    )
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]

    lm = load()
    lm = dataclasses.replace(lm, eos_token_ids=set())  # fixed-length outputs
    engine = Engine(lm, EngineConfig(kv_cache_gb=1.0, max_batch=max(levels)))
    results: dict[str, Any] = {"model": lm.name, "tokens": args.tokens}
    print(f"model {lm.name}; {args.tokens} tokens per request", flush=True)

    # Warm-up (first-call allocations, caches).
    run_concurrent(engine, 2, 4, "warmup")

    sweep = []
    for n in levels:
        r = run_concurrent(engine, n, args.tokens, f"sweep-{n}")
        sweep.append(r)
        print(
            f"engine  c={n:2d}: {r['tok_s']:6.1f} tok/s ({r['tokens']} in {r['wall_s']:.1f}s)",
            flush=True,
        )
    results["sweep"] = sweep

    model, tok = mlx_lm_setup(lm, args.export_dir)
    prompts = [lm.prompt(story(i, args.tokens)).ids for i in range(8)]
    mlx_lm_batch(model, tok, prompts[:2], 4)  # warm-up
    mb = mlx_lm_batch(model, tok, prompts, args.tokens)
    results["mlx_lm_batch"] = mb
    print(
        f"mlx_lm  c= 8: {mb['tok_s']:6.1f} tok/s ({mb['tokens']} in {mb['wall_s']:.1f}s)",
        flush=True,
    )
    e8 = next((r for r in sweep if r["concurrency"] == 8), None)
    if e8 is not None:
        print(f"engine / mlx_lm at 8: {e8['tok_s'] / mb['tok_s']:.2f}x", flush=True)

    # Single stream: engine vs reference loop, interleaved.
    ids0 = lm.prompt(story(0, 64)).ids
    eng, ref = [], []
    for k in range(args.repeats):
        ref.append(reference_single_decode(lm, ids0, 64))
        eng.append(engine_single_decode(engine, 64, f"single-{k}"))
    results["single"] = {"engine": eng, "reference": ref}
    print(
        f"single stream decode: engine {statistics.median(eng):.1f} tok/s, reference "
        f"{statistics.median(ref):.1f} tok/s -> {statistics.median(eng) / statistics.median(ref):.2f}x "
        f"(best {max(eng) / max(ref):.2f}x)",
        flush=True,
    )

    # TTFT with a cached system prompt vs cold.
    system = long_system(lm, args.prompt_tokens - 40)
    user = "Which trail should I take tomorrow if it snows?"
    full = ChatRequest(messages=[Message("system", system), Message("user", user)])
    full_ids = lm.prompt(full).ids
    sys_req = ChatRequest(messages=[Message("system", system), Message("user", "Hello!")])
    sys_ids = lm.prompt(sys_req).ids
    n_common = 0
    while full_ids[n_common] == sys_ids[n_common]:
        n_common += 1
    cold, warm, cached = [], [], 0
    for k in range(args.repeats):
        cold.append(engine_ttft(engine, system, user, f"cold-{k}")[0])
        engine_ttft(engine, system, "Hello!", f"warm-{k}")  # caches the system part
        ms, cached = engine_ttft(engine, system, user, f"warm-{k}")
        warm.append(ms)
    m_cold, m_warm = [], []
    for _ in range(args.repeats):
        m_cold.append(mlx_lm_ttft(model, full_ids[:n_common], full_ids, warm=False))
        m_warm.append(mlx_lm_ttft(model, full_ids[:n_common], full_ids, warm=True))
    t = {
        "prompt_tokens": len(full_ids),
        "system_tokens": n_common,
        "cached_tokens": cached,
        "engine_cold_ms": statistics.median(cold),
        "engine_warm_ms": statistics.median(warm),
        "mlx_lm_cold_ms": statistics.median(m_cold),
        "mlx_lm_warm_ms": statistics.median(m_warm),
    }
    results["ttft"] = t
    print(
        f"TTFT {len(full_ids)}-token prompt ({n_common} shared, {cached} from cache): engine cold "
        f"{t['engine_cold_ms']:.0f} ms, cached {t['engine_warm_ms']:.0f} ms "
        f"({t['engine_warm_ms'] / t['engine_cold_ms']:.3f}x); mlx_lm cold {t['mlx_lm_cold_ms']:.0f} ms, "
        f"cached {t['mlx_lm_warm_ms']:.0f} ms ({t['mlx_lm_warm_ms'] / t['mlx_lm_cold_ms']:.3f}x)",
        flush=True,
    )
    engine.close()

    # Markdown summary.
    single = sweep[0]["tok_s"]
    print("\n| concurrent | engine tok/s | x single |\n|---:|---:|---:|")
    for r in sweep:
        print(f"| {r['concurrency']} | {r['tok_s']:.1f} | {r['tok_s'] / single:.2f} |")
    print(f"| 8 (mlx_lm batch_generate) | {mb['tok_s']:.1f} | {mb['tok_s'] / single:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        try:
            plot(results, args.plot)
            print(f"\nplot: {args.plot}")
        except ImportError:
            print("\nno plot: matplotlib is in the bench extra (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
