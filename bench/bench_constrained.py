"""Constrained decoding on the embedded model: how often answers end and validate,
what one row's mask costs, and decode speed with a grammar on every row.

SmolLM2-135M-Instruct (fp32, optimized BLAS), one process:

1. the 32 schemas of tests/test_constrained.py at temperature 0 and 0.8
   (seeded), batched: answers that end (end of turn) and validate with
   ``jsonschema``, and answers cut by ``max_tokens`` (a small model looping
   inside a string);
1b. forced tool calls in every parser family's syntax: the same model with
   its parser family set to each family in turn (the grammar writes that
   family's syntax, its Rust parser reads the result), 5 prompts x 2
   temperatures each: calls to the right tool whose input validates;
2. mask cost: median time to compute one row's mask in Rust and turn it into
   the MLX array added to its logits, over a walk through a JSON answer;
3. decode tokens/s at batch 8, 48 tokens each (EOS ignored): every row under a
   JSON-schema grammar vs no grammar, interleaved rounds. Constrained rows read
   each token back before the next step (no look-ahead).

Run (about 8 minutes on 2 idle cores)::

    .venv/bin/python bench/bench_constrained.py
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
import jsonschema
import numpy as np

from mlx_cairn import constrain
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.models import load
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Message,
    OutputFormat,
    SamplingParams,
    TextDelta,
    ToolCall,
)

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_constrained import FORCED, SCHEMAS, TOOLS


def pass_rates(engine: Engine, temperature: float) -> tuple[int, int, int]:
    reqs = [
        ChatRequest(
            [Message("user", p + " Answer in JSON.")],
            max_tokens=160,
            sampling=SamplingParams(temperature=temperature, seed=i),
            output_format=OutputFormat(s),
        )
        for i, (p, s) in enumerate(SCHEMAS)
    ]
    prepared = [engine.prepare(r) for r in reqs]
    with engine._lock:
        streams = [engine.submit(p) for p in prepared]
    ok = cut = 0
    for (_, schema), s in zip(SCHEMAS, streams, strict=True):
        events = list(s.iter_sync(600))
        done = events[-1]
        assert isinstance(done, Done), done
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        if done.stop_reason == "max_tokens":
            cut += 1
            continue
        jsonschema.validate(json.loads(text), schema)  # an ended answer always validates
        ok += 1
    return ok, cut, len(SCHEMAS)


def forced_calls(lm, family: str) -> tuple[int, int]:
    """Forced calls (both temperatures) that come back as one call of the right tool
    with valid input, out of all, with ``family``'s grammar and parser."""
    engine = Engine(
        dataclasses.replace(lm, parser_family=family), EngineConfig(max_batch=16, num_blocks=512)
    )
    reqs = [
        ChatRequest(
            [Message("user", prompt)],
            max_tokens=160,
            sampling=SamplingParams(temperature=temp, seed=i),
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        for temp in (0.0, 0.8)
        for i, (prompt, choice, _) in enumerate(FORCED)
    ]
    prepared = [engine.prepare(r) for r in reqs]
    with engine._lock:
        streams = [engine.submit(p) for p in prepared]
    by_name = {t.name: t.parameters for t in TOOLS}
    ok = 0
    for (_, _, want), s in zip(FORCED * 2, streams, strict=True):
        events = list(s.iter_sync(600))
        calls = [e for e in events if isinstance(e, ToolCall)]
        done = events[-1]
        if not (isinstance(done, Done) and done.stop_reason == "tool_use" and len(calls) == 1):
            continue
        if want is not None and calls[0].name != want:
            continue
        try:
            jsonschema.validate(json.loads(calls[0].arguments), by_name[calls[0].name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            continue
        ok += 1
    engine.close()
    del engine
    gc.collect()
    mx.clear_cache()  # one engine per family: free each one's KV pool before the next
    return ok, len(reqs)


def mask_cost(lm) -> float:
    """Median microseconds per row step: Rust mask + bytes -> numpy -> MLX array."""
    vocab = constrain.vocabulary(lm)
    schema = SCHEMAS[8][1]
    grammar = vocab.compile_json_schema(constrain.styled(schema))
    text = '{"items": [{"name": "apples", "qty": 3}, {"name": "pears", "qty": 12}]}'
    ids = lm.tokenizer.encode(text)
    times = []
    for _ in range(20):
        m = vocab.matcher(grammar)
        for t in ids:
            t0 = time.perf_counter()
            arr = mx.array(np.frombuffer(m.mask(), dtype=np.float32))
            mx.eval(arr)
            times.append(time.perf_counter() - t0)
            m.consume(t)
    return 1e6 * statistics.median(times)


def decode_rate(engine: Engine, constrained: bool, tokens: int) -> float:
    # The story cannot end within the run (EOS is ignored there, so a grammar that
    # ended would leave the row nothing to sample).
    long = {"type": "string", "minLength": 300}
    schema = {"type": "object", "properties": {"story": long}, "required": ["story"]}
    reqs = [
        ChatRequest(
            [Message("user", f"Write a long story about topic {i}.")],
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            output_format=OutputFormat(schema) if constrained else None,
        )
        for i in range(8)
    ]
    prepared = [engine.prepare(r) for r in reqs]
    with engine._lock:
        streams = [engine.submit(p) for p in prepared]
    rates = []
    for s in streams:
        done = next(e for e in s.iter_sync(600) if isinstance(e, Done))
        rates.append(done.timings.decode_tokens_per_s)
    return 8 * statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--families-only", action="store_true", help="only the forced calls per family")
    ap.add_argument("--speed-only", action="store_true", help="only mask cost and decode speed")
    args = ap.parse_args()
    lm = load(None)
    engine = Engine(lm, EngineConfig(max_batch=32, num_blocks=4096))
    if args.speed_only:
        print(f"mask cost per row step (median): {mask_cost(lm):.0f} us")
        speed(lm, args)
        return
    if args.families_only:
        for family in constrain.GRAMMAR_FAMILIES:
            ok, n = forced_calls(lm, family)
            print(f"| {family} | {ok} / {n} |", flush=True)
        return
    print("| temperature | ended and valid | cut by max_tokens | schemas |")
    print("|---:|---:|---:|---:|")
    for temp in (0.0, 0.8):
        ok, cut, n = pass_rates(engine, temp)
        print(f"| {temp} | {ok} | {cut} | {n} |")
    engine.close()
    print("\n| family | forced calls: one call of the right tool, valid input |")
    print("|---|---:|")
    for family in constrain.GRAMMAR_FAMILIES:
        ok, n = forced_calls(lm, family)
        print(f"| {family} | {ok} / {n} |", flush=True)
    print(f"\nmask cost per row step (median): {mask_cost(lm):.0f} us")
    speed(lm, args)


def speed(lm, args) -> None:
    constrain.vocabulary(lm)  # built with the real end-of-turn ids, shared by `fixed`
    fixed = dataclasses.replace(lm, eos_token_ids=set())  # fixed-length outputs
    engine = Engine(fixed, EngineConfig(max_batch=8))
    decode_rate(engine, False, 8)  # warm-up
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for c in (False, True):
            rates[c].append(decode_rate(engine, c, args.tokens))
    engine.close()
    plain, gram = statistics.median(rates[False]), statistics.median(rates[True])
    print(
        f"batch 8 decode: {plain:.1f} tok/s plain, {gram:.1f} tok/s with a grammar on every row "
        f"({gram / plain:.2f}x), medians of {args.rounds} interleaved rounds"
    )


if __name__ == "__main__":
    main()
