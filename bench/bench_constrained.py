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
from mlx_cairn.engine import Engine
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
from test_constrained import SCHEMAS, TOOLS


def pass_rates(engine: Engine, temperature: float) -> tuple[int, int, int, int]:
    """Answers that validate (ended by the end of turn, or closed by the budget and
    ending as max_tokens), answers that do not, and the count of each kind."""
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
    ended = closed = bad = 0
    for (_, schema), s in zip(SCHEMAS, streams, strict=True):
        events = list(s.iter_sync(600))
        done = events[-1]
        assert isinstance(done, Done), done
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
            print(f"  invalid ({done.stop_reason}): {text!r}", flush=True)
            continue
        if done.stop_reason == "max_tokens":
            closed += 1
        else:
            ended += 1
    return ended, closed, bad, len(SCHEMAS)


FORCED = [
    ("What is the weather in Paris?", "required", None),
    ("What is 2 plus 3?", {"name": "add"}, "add"),
    ("Find news about llamas.", {"name": "search"}, "search"),
    ("Hello!", {"name": "get_weather"}, "get_weather"),
    ("Tell me a joke.", "required", None),
]


def forced_calls(lm, family: str) -> tuple[int, int]:
    """Forced calls (both temperatures) that come back as one call of the right tool
    with valid input, out of all, with ``family``'s grammar and parser."""
    engine = Engine(dataclasses.replace(lm, parser_family=family), max_batch=16, num_blocks=512)
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
        # A call the budget closed ends as max_tokens, as a call cut there would.
        ended = isinstance(done, Done) and done.stop_reason in ("tool_use", "max_tokens")
        if not (ended and len(calls) == 1):
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


def mask_cost(lm) -> None:
    """Median microseconds per row step, over a walk through a JSON answer and
    through a call in each tool-call family: the Rust mask written into the row's
    numpy buffer, that buffer as an MLX array, and that added to a logits row
    (evaluated alone, so MLX's per-eval overhead is in); then the budget close's
    search for a way to finish, from each point of the JSON walk."""
    vocab = constrain.vocabulary(lm)
    tok = lm.tokenizer
    walks = [
        ("json", vocab.compile_json_schema(constrain.styled(SCHEMAS[8][1])),
         '{"items": [{"name": "apples", "qty": 3}, {"name": "pears", "qty": 12}]}'),
    ]  # fmt: skip
    for fam, text in CALLS.items():
        grammar = constrain.tool_grammar(fam, TOOLS, parallel=False, specials=tok.special_tokens)
        walks.append((fam, vocab.compile_lark(grammar), text))
    logits = mx.random.normal((vocab.width,))
    buf = np.empty(vocab.width, np.float32)
    for name, grammar, text in walks:
        ids = tok.encode(text)
        fill, conv, applied, ways = [], [], [], []
        for _ in range(10):
            m = vocab.matcher(grammar)
            for t in ids:
                t0 = time.perf_counter()
                m.mask_into(buf)
                t1 = time.perf_counter()
                arr = mx.array(buf)
                mx.eval(arr)
                t2 = time.perf_counter()
                mx.eval(logits + arr)
                t3 = time.perf_counter()
                fill.append(t1 - t0)
                conv.append(t2 - t0)
                applied.append(t3 - t0)
                if name == "json":
                    t4 = time.perf_counter()
                    m.completion(512, constrain.CLOSE_EFFORT)
                    ways.append(time.perf_counter() - t4)
                m.consume(t)
        med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
        print(
            f"| {name} | {med(fill):.0f} | {med(conv):.0f} | {med(applied):.0f} |"
            + (
                f" way to finish {med(ways):.0f} us median, {1e6 * max(ways):.0f} max"
                if ways
                else ""
            ),
            flush=True,
        )


#: One call of get_weather in each family, as its grammar writes it.
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "pythonic": '[get_weather(city="Paris", unit="celsius")]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
}


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
    engine = Engine(lm, max_batch=32, num_blocks=4096)
    if args.speed_only:
        mask_table(lm)
        speed(lm, args)
        return
    if args.families_only:
        for family in constrain.GRAMMAR_FAMILIES:
            ok, n = forced_calls(lm, family)
            print(f"| {family} | {ok} / {n} |", flush=True)
        return
    print("| temperature | ended, valid | closed at max_tokens, valid | invalid | schemas |")
    print("|---:|---:|---:|---:|---:|")
    for temp in (0.0, 0.8):
        ended, closed, bad, n = pass_rates(engine, temp)
        print(f"| {temp} | {ended} | {closed} | {bad} | {n} |", flush=True)
    engine.close()
    print("\n| family | forced calls: one call of the right tool, valid input |")
    print("|---|---:|")
    for family in constrain.GRAMMAR_FAMILIES:
        ok, n = forced_calls(lm, family)
        print(f"| {family} | {ok} / {n} |", flush=True)
    mask_table(lm)
    speed(lm, args)


def mask_table(lm) -> None:
    print("\n| grammar | mask (us) | + as MLX array | + added to logits |")
    print("|---|---:|---:|---:|")
    mask_cost(lm)


def speed(lm, args) -> None:
    constrain.vocabulary(lm)  # built with the real end-of-turn ids, shared by `fixed`
    fixed = dataclasses.replace(lm, eos_token_ids=set())  # fixed-length outputs
    engine = Engine(fixed, max_batch=8)
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
