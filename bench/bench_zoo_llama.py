"""Hand-written Llama (models/llama.py) vs mlx-lm's llama class, both over the paged engine.

The embedded SmolLM2-135M GGUF, dequantized to fp32. "llama.py" is what
``load(None)`` gives (read_gguf's weights in GGUF's interleaved Q/K order in
models/llama.LlamaModel with its CPU layout); "mlx-lm llama" is the same file
as load_gguf builds every other architecture (Q/K in HF order,
models/zoo.from_weights: mlx-lm's class with the same CPU layout and prefill
attention). One process, interleaved runs, EOS ignored:

- single-stream decode tokens/s (one request, ``--tokens`` generated);
- aggregate tokens/s of 8 concurrent requests (wall time, prefill included);
- time to first token of a ~2,000-token prompt (cold cache).

Run::

    .venv/bin/python bench/bench_zoo_llama.py --reps 3

Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.models.gguf import read_gguf
from mlx_cairn.models.loader import default_model_path
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TOPICS = ["a lighthouse", "bread", "Mars", "a jazz trio", "volcanoes", "bees", "chess", "the sea"]


def story(i: int, n: int, salt: str) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", f"Write a long story about {TOPICS[i % len(TOPICS)]}.")],
        max_tokens=n,
        sampling=GREEDY,
        cache_salt=salt,
    )


def single(engine: Engine, n: int, salt: str) -> float:
    done = list(engine.generate_sync(story(0, n, salt), timeout=900))[-1]
    assert isinstance(done, Done), done
    return done.timings.decode_tokens_per_s


def aggregate(engine: Engine, conc: int, n: int, salt: str) -> float:
    t0 = time.perf_counter()
    streams = [engine.submit(story(i, n, salt)) for i in range(conc)]
    dones = [list(s.iter_sync(timeout=900))[-1] for s in streams]
    wall = time.perf_counter() - t0
    assert all(isinstance(d, Done) for d in dones), dones
    return sum(d.usage.output_tokens for d in dones) / wall


def ttft(engine: Engine, system: str, salt: str) -> float:
    req = ChatRequest(
        messages=[Message("system", system), Message("user", "Summarise.")],
        max_tokens=1,
        sampling=GREEDY,
        cache_salt=salt,
    )
    done = list(engine.generate_sync(req, timeout=900))[-1]
    assert isinstance(done, Done), done
    return done.timings.ttft_ms


def micro(models: dict[str, object], reps: int, prefill: int) -> None:
    """Forward passes over PagedKVCache alone, sides alternating, best of ``reps``:
    robust to other processes on the machine (min, not median)."""
    from mlx_cairn.engine.paged import KVPools, LayerSpec, PagedKVCache

    bs, ctx = 16, 256
    best: dict[tuple[str, str], float] = {}
    pools = {}
    for k, m in models.items():
        specs = (
            getattr(m, "layer_specs", None)
            or [
                LayerSpec(m.num_kv_heads, m.head_dim, m.head_dim)  # type: ignore[attr-defined]
            ]
            * m.num_layers
        )  # type: ignore[attr-defined]
        pools[k] = KVPools(
            layers=specs, num_blocks=1 + 8 * (ctx // bs) + prefill // bs + 2, block_size=bs
        )

    def tables(b: int, n: int) -> list[list[int]]:
        per = -(-n // bs)
        return [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(b)]

    for _ in range(reps):
        for k, m in models.items():
            p = pools[k]
            for b in (1, 8):
                toks = mx.zeros((b, 1), dtype=mx.int32)
                c = PagedKVCache(p, tables(b, ctx + 1), [ctx] * b, 1)
                t = time.perf_counter()
                for _ in range(8):
                    h = m(toks, c)  # type: ignore[operator]
                    mx.eval(m.logits(h[:, -1, :]), p.arrays())  # type: ignore[attr-defined]
                dt = (time.perf_counter() - t) / 8
                best[(k, f"decode B={b}")] = min(best.get((k, f"decode B={b}"), 1e9), dt)
            ids = mx.zeros((1, prefill), dtype=mx.int32)
            c = PagedKVCache(p, tables(1, prefill), [0], prefill)
            t = time.perf_counter()
            h = m(ids, c)  # type: ignore[operator]
            mx.eval(m.logits(h[:, -1, :]), p.arrays())  # type: ignore[attr-defined]
            dt = time.perf_counter() - t
            best[(k, f"prefill {prefill}")] = min(best.get((k, f"prefill {prefill}"), 1e9), dt)
        print({f"{a} {b}": round(v * 1000, 1) for (a, b), v in best.items()}, flush=True)
    print()
    print(f"| model code | decode step B=1 (ms) | decode step B=8 (ms) | prefill {prefill} (ms) |")
    print("|---|---|---|---|")
    for k in models:
        print(
            f"| {k} | {best[(k, 'decode B=1')] * 1000:.1f} | {best[(k, 'decode B=8')] * 1000:.1f}"
            f" | {best[(k, f'prefill {prefill}')] * 1000:.0f} |"
        )


def zoo_model() -> object:
    """The default model in mlx-lm's llama, as load_gguf builds every other GGUF architecture."""
    from mlx_cairn.models import zoo

    contents = read_gguf(default_model_path(), qk_order="hf")
    return zoo.from_weights(contents.config, contents.weights, compute=mx.float32, dequant=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", action="store_true", help="forward passes only, best of --reps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2000)
    args = ap.parse_args()

    ours = load(None)  # GGUF llama: models/llama.py (models/gguf.LLAMA_PY_ARCHS)
    other = zoo_model()
    if args.micro:
        micro({"llama.py": ours.model, "mlx-lm llama": other}, args.reps, args.prefill)
        return
    sides = {
        "llama.py": dataclasses.replace(ours, eos_token_ids=set()),
        "mlx-lm llama": dataclasses.replace(ours, model=other, eos_token_ids=set()),  # type: ignore[arg-type]
    }
    para = "The trail climbs past cairns and a stream; it is closed in deep snow. "
    system = para * (args.prefill // len(ours.tokenizer.encode(para)))
    engines = {k: Engine(v, EngineConfig(num_blocks=1024, block_size=16)) for k, v in sides.items()}
    # Same greedy tokens on both sides (a check that they run the same model).
    outs = {}
    for k, e in engines.items():
        s = e.submit(story(1, 24, "check"))
        list(s.iter_sync(timeout=900))
        outs[k] = s.output_ids
    print("same greedy tokens:", len(set(map(tuple, outs.values()))) == 1)
    res: dict[str, dict[str, list[float]]] = {k: {"1": [], "8": [], "ttft": []} for k in sides}
    for rep in range(args.reps):
        for k, e in engines.items():
            res[k]["1"].append(single(e, args.tokens, f"s{rep}"))
            res[k]["8"].append(aggregate(e, 8, args.tokens, f"a{rep}"))
            res[k]["ttft"].append(ttft(e, system, f"t{rep}"))
            print(k, rep, {m: round(v[-1], 1) for m, v in res[k].items()}, flush=True)
    print()
    print("| model code | decode tok/s, 1 stream | aggregate tok/s, 8 streams | TTFT ms, "
          f"{args.prefill}-token prompt |")  # fmt: skip
    print("|---|---|---|---|")
    for k, r in res.items():
        med = {m: statistics.median(v) for m, v in r.items()}
        print(f"| {k} | {med['1']:.1f} | {med['8']:.1f} | {med['ttft']:.0f} |")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
