"""``cairn generate PROMPT``: one chat turn streamed to the terminal.

The prompt runs through :meth:`mlx_cairn.Engine.generate_sync`: the same
engine, finish rules, reasoning budget, stop sequences and output parser as
the server, one request.

Example::

    cairn generate "What is the capital of France?" --max-tokens 64 --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import TextIO

from mlx_cairn.errors import CairnError
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Error,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    ToolCall,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message ('-' reads it from stdin)")
    p.add_argument(
        "--model", default=None, help="HF/MLX folder or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    p.add_argument(
        "--think", choices=["on", "off"], default=None, help="reasoning on/off (models that reason)"
    )
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--verbose", "-v", action="store_true", help="print timings to stderr")


def _load_with_progress(model: str | None, dtype: str, err: TextIO):
    from mlx_cairn.models import load

    done = threading.Event()

    def notice() -> None:
        if not done.wait(1.0):
            print(
                f"loading {model or 'the default model (SmolLM2-135M-Instruct)'}...",
                file=err,
                flush=True,
            )

    threading.Thread(target=notice, daemon=True).start()
    t0 = time.perf_counter()
    try:
        return load(model, dtype=dtype), time.perf_counter() - t0
    finally:
        done.set()


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the subcommand; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    from mlx_cairn.engine import Engine, EngineConfig

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = ([Message("system", args.system)] if args.system else []) + [Message("user", text)]
    req = ChatRequest(
        messages=messages,
        max_tokens=args.max_tokens,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
        ),
        stop=list(args.stop),
        reasoning=None if args.think is None else args.think == "on",
    )
    try:
        lm, load_s = _load_with_progress(args.model, args.dtype, err)
        # One request: a KV pool of one context (or a few hundred MiB, if smaller).
        engine = Engine(lm, EngineConfig(kv_cache_gb=None, max_batch=1))
    except CairnError as e:
        print(f"error: {e.message}", file=err)
        return 2
    in_reasoning = False
    done: Done | None = None
    try:
        try:
            prepared = engine.prepare(req)
        except CairnError as e:
            print(f"error: {e.message}", file=err)
            return 2
        for ev in engine.generate_sync(prepared):
            if isinstance(ev, ReasoningDelta):
                if not in_reasoning:
                    out.write("<think>")
                    in_reasoning = True
                out.write(ev.text)
            elif isinstance(ev, TextDelta):
                if in_reasoning:
                    out.write("</think>\n")
                    in_reasoning = False
                out.write(ev.text)
            elif isinstance(ev, ToolCall):
                out.write(
                    f"\n[tool call] {ev.name}({json.dumps(json.loads(ev.arguments or '{}'))})\n"
                )
            elif isinstance(ev, Done):
                done = ev
            elif isinstance(ev, Error):
                print(f"\nerror: {ev.message}", file=err)
                return 1
            out.flush()
    finally:
        engine.close()
    if in_reasoning:
        out.write("</think>")
    out.write("\n")
    out.flush()
    if args.verbose and done is not None:
        t, u = done.timings, done.usage
        print(
            f"[{lm.name}] load {load_s:.2f}s | prompt {u.input_tokens} tok, "
            f"{t.prefill_tokens_per_s:.1f} tok/s | generated {u.output_tokens} tok, "
            f"{t.decode_tokens_per_s:.1f} tok/s | finish: {done.stop_reason}",
            file=err,
        )
    return 0
