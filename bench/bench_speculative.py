"""Speculative decoding benchmark: prompt lookup (``--speculative ngram``) vs plain decoding.

The embedded SmolLM2-135M (fp32 on this CPU), greedy, in one process, runs
interleaved (plain, ngram with each K, plain, ...):

1. code edit, single stream: the prompt holds a ~500-token Python file and asks
   for it back with one change; decode tokens/s of the answer (first token to
   last, the prompt prefilled from the prefix cache);
2. free text, single stream: story prompts whose answers do not repeat the
   prompt; decode tokens/s;
3. code edit at 8: eight different files at once; aggregate tokens/s from the
   first submit to the last token (prompts cached, as in 1).

Greedy outputs with and without speculation are compared token for token.

``--draft-peer``: a draft model instead, against ``mlx_lm``'s speculative
``stream_generate`` on the same weights (exported as an HF folder), single
stream, code edit. The only model with this tokenizer here is the model
itself, so it is its own draft: every draft is accepted and drafting costs as
much as verifying, which measures each implementation's overhead, not a
speed-up a small draft would give.

Run (about 10 minutes on 2 idle cores)::

    .venv/bin/python bench/bench_speculative.py            # --reps 3 --ks 4,8,16

Prints a Markdown report for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

STORIES = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a day in the life of a bee in a busy city garden.",
    "Tell me about the history of bread, from ancient Egypt to today.",
]


def source_file(seed: int) -> str:
    """A ~500-token Python file, different for every seed."""
    rng = random.Random(seed)
    names = ["total", "count", "value", "limit", "scale", "offset", "result", "index"]
    out = [f'"""Helpers for report {seed}."""', "", "import math", ""]
    for i in range(11):
        a, b = rng.sample(names, 2)
        k = rng.randint(2, 97)
        out += [
            f"def step_{seed}_{i}({a}, {b}):",
            f'    """Combine {a} and {b} (case {i})."""',
            f"    if {a} > {k}:",
            f"        return math.sqrt({a}) + {b} * {k}",
            f"    return {a} * {k} - {b}",
            "",
        ]
    return "\n".join(out)


def edit_request(seed: int, max_tokens: int) -> ChatRequest:
    code = source_file(seed)
    ask = (
        f"Here is a file:\n```python\n{code}\n```\nReturn the whole file unchanged except "
        f"that the function step_{seed}_4 is renamed to step_{seed}_four. Output only the code."
    )
    return ChatRequest(
        [Message("user", ask)], max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
    )


def story_request(i: int, max_tokens: int) -> ChatRequest:
    return ChatRequest(
        [Message("user", STORIES[i % len(STORIES)])],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def run(engine: Engine, reqs: list[ChatRequest]) -> tuple[float, list[Done], list[list[int]]]:
    """Submit all at once; (wall seconds, Done events, output ids)."""
    t0 = time.perf_counter()
    streams = [engine.submit(r) for r in reqs]
    dones = []
    for s in streams:
        events = list(s.iter_sync(timeout=900))
        assert isinstance(events[-1], Done), events[-1]
        dones.append(events[-1])
    return time.perf_counter() - t0, dones, [s.output_ids for s in streams]


def draft_peer(lm, reps: int, max_tokens: int, k: int) -> None:
    """Ours with a draft model vs mlx_lm's speculative stream_generate (same weights)."""
    import tempfile
    from pathlib import Path

    from mlx_lm import load as lm_load
    from mlx_lm.generate import stream_generate

    from mlx_cairn.models.export import save_folder

    folder = Path(tempfile.gettempdir()) / "cairn-smollm2-hf"
    if not (folder / "config.json").exists():
        save_folder(lm, folder)
    model, tok = lm_load(str(folder))
    req = edit_request(0, max_tokens)
    plain = Engine(lm, EngineConfig(kv_cache_gb=0.5))
    drafted = Engine(lm, EngineConfig(kv_cache_gb=0.5, draft_model=lm, num_speculative_tokens=k))
    ids = plain.prepare(req).prompt_ids
    rows: dict[str, list[float]] = {n: [] for n in ("ours", "ours+draft", "mlx_lm", "mlx_lm+draft")}
    outs: dict[str, list[int]] = {}

    def peer(draft: bool) -> tuple[float, list[int]]:
        kw = {"draft_model": model, "num_draft_tokens": k} if draft else {}
        last, got = None, []
        for r in stream_generate(model, tok, ids, max_tokens=max_tokens, **kw):
            last = r
            got.append(r.token)
        assert last is not None
        return last.generation_tps, got

    for eng in (plain, drafted):
        run(eng, [req])
    for _ in range(reps):
        for name, eng in (("ours", plain), ("ours+draft", drafted)):
            _, d, got = run(eng, [req])
            rows[name].append(d[0].timings.decode_tokens_per_s)
            outs[name] = got[0]
        for name, draft in (("mlx_lm", False), ("mlx_lm+draft", True)):
            tps, got = peer(draft)
            rows[name].append(tps)
            outs[name] = got
    plain.close()
    drafted.close()
    assert outs["ours+draft"] == outs["ours"], "a draft model changed the greedy output"
    print(f"Draft model = the model itself, K={k}, code edit x1, {reps} interleaved reps")
    print()
    print("| engine | decode tok/s (median) | per run |")
    print("|---|---|---|")
    for name, v in rows.items():
        print(f"| {name} | {statistics.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} |")
    same = outs["mlx_lm"][: len(outs["ours"])] == outs["ours"][: len(outs["mlx_lm"])]
    print(f"\n(greedy tokens equal to mlx_lm's: {same})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ks", default="8", help="draft lengths to measure, comma-separated")
    ap.add_argument(
        "--step-drafts",
        default="",
        help="also measure K=8 with these per-step draft budgets (comma-separated)",
    )
    ap.add_argument("--edit-tokens", type=int, default=256)
    ap.add_argument("--story-tokens", type=int, default=128)
    ap.add_argument("--draft-peer", action="store_true", help="the draft-model comparison only")
    ap.add_argument("--draft-k", type=int, default=3)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    lm = load()
    if args.draft_peer:
        draft_peer(lm, args.reps, args.edit_tokens, args.draft_k)
        return
    engines = {"plain": Engine(lm, EngineConfig(max_batch=8, kv_cache_gb=0.5))}
    for k in ks:
        engines[f"ngram K={k}"] = Engine(
            lm,
            EngineConfig(
                max_batch=8, kv_cache_gb=0.5, speculative="ngram", num_speculative_tokens=k
            ),
        )
    for budget in [int(b) for b in args.step_drafts.split(",") if b]:
        eng = Engine(lm, EngineConfig(max_batch=8, kv_cache_gb=0.5, speculative="ngram"))
        eng._scheduler.step_draft_tokens = budget
        engines[f"ngram K=8, {budget} per step"] = eng
    edit1 = [edit_request(0, args.edit_tokens)]
    edit8 = [edit_request(s, args.edit_tokens) for s in range(1, 9)]
    stories = [story_request(i, args.story_tokens) for i in range(len(STORIES))]
    for eng in engines.values():  # prompts into every prefix cache (and a warm-up)
        run(eng, [*edit1, *edit8[:4]])
        run(eng, edit8[4:])
        run(eng, stories)
    single: dict[str, list[float]] = {n: [] for n in engines}
    free: dict[str, list[float]] = {n: [] for n in engines}
    agg: dict[str, list[float]] = {n: [] for n in engines}
    accept: dict[str, list[tuple[int, int]]] = {n: [] for n in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.reps):
        for name, eng in engines.items():
            _, d, ids = run(eng, edit1)
            single[name].append(d[0].timings.decode_tokens_per_s)
            accept[name].append((d[0].usage.accepted_draft_tokens, d[0].usage.draft_tokens))
            outs = list(ids)
            for r in stories:
                _, d, ids = run(eng, [r])
                free[name].append(d[0].timings.decode_tokens_per_s)
                outs += ids
            wall, d, ids = run(eng, edit8)
            agg[name].append(sum(x.usage.output_tokens for x in d) / wall)
            outs += ids
            if name in outputs:
                assert outputs[name] == outs, f"{name}: outputs changed between runs"
            outputs[name] = outs
    for name in engines:
        assert outputs[name] == outputs["plain"], f"{name}: greedy output differs from plain"
    for eng in engines.values():
        eng.close()

    def med(v: list[float]) -> float:
        return statistics.median(v)

    base = {k: med(v["plain"]) for k, v in (("s", single), ("f", free), ("a", agg))}
    print(f"SmolLM2-135M fp32, greedy, {args.reps} interleaved reps (medians); outputs equal")
    print()
    print(
        "| engine | code edit x1 tok/s | vs plain | free text x1 tok/s | vs plain "
        "| code edit x8 tok/s | vs plain | accepted / drafted (x1) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in engines:
        a, p = accept[name][-1]
        print(
            f"| {name} | {med(single[name]):.1f} | {med(single[name]) / base['s']:.2f}x "
            f"| {med(free[name]):.1f} | {med(free[name]) / base['f']:.2f}x "
            f"| {med(agg[name]):.1f} | {med(agg[name]) / base['a']:.2f}x | {a} / {p} |"
        )
    print()
    for name in engines:
        print(
            f"- {name}: code edit x1 per run "
            + " / ".join(f"{x:.1f}" for x in single[name])
            + "; x8 per run "
            + " / ".join(f"{x:.1f}" for x in agg[name])
        )


if __name__ == "__main__":
    main()
