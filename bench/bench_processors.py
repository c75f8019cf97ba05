"""Cost of the logits-processor chain and of logprobs at batch 8 on the default model.

SmolLM2-135M-Instruct (the embedded GGUF, fp32, optimized BLAS), one process.
Eight greedy requests decode together, four ways, interleaved round by round:

- ``plain``: no processors;
- ``processors``: repetition 1.1 + frequency 0.3 + presence 0.2 penalties and a
  16-entry ``logit_bias`` (small values, so greedy tokens barely move) on every row;
- ``logprobs``: ``logprobs`` with ``top_logprobs=5`` on every row;
- ``both``.

Reports the time per decode step (from each row's decode rate) and the
aggregate tokens/s of each, and the processors' share of the step: (step_with - step_plain) / step_with.
It also times ``engine.logits.process`` alone on [8, vocab] logits (graph
built and evaluated), which is the processors' cost without the forward pass.

Run (about 3 minutes on 2 idle cores)::

    .venv/bin/python bench/bench_processors.py --rounds 3 --tokens 48
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx

# isort: on
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine import logits as L
from mlx_cairn.models import load
from mlx_cairn.models.loaded import vocab_size
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

TOPICS = ["a lighthouse", "bread", "Mars", "a jazz trio", "volcanoes", "bees", "the sea", "chess"]


def sampling(kind: str) -> SamplingParams:
    s: dict[str, Any] = {"temperature": 0.0}
    if kind in ("processors", "both"):
        s.update(
            repetition_penalty=1.1,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            logit_bias={i * 97 + 5: 0.01 for i in range(16)},
        )
    if kind in ("logprobs", "both"):
        s.update(logprobs=True, top_logprobs=5)
    return SamplingParams(**s)


def run(engine: Engine, kind: str, tokens: int) -> float:
    """Seconds per decode step: each row gets one token per step, so a row's decode
    rate (``Done.timings``, first token to last) is the step rate; median over rows."""
    reqs = [
        ChatRequest(
            [Message("user", f"Write a long story about {t}.")],
            max_tokens=tokens,
            sampling=sampling(kind),
        )
        for t in TOPICS
    ]
    prepared = [engine.prepare(r) for r in reqs]
    with engine._lock:
        streams = [engine.submit(p) for p in prepared]
    rates = []
    for s in streams:
        done = [ev for ev in s.iter_sync(120) if isinstance(ev, Done)]
        assert done and done[0].usage.output_tokens == tokens, done
        rates.append(done[0].timings.decode_tokens_per_s)
    return 1.0 / statistics.median(rates)


def micro(vocab: int, rows: int = 8, iters: int = 50) -> dict[str, float]:
    """ms per call of the processor chain alone on [rows, vocab] logits."""

    class Row:  # just what logits.process reads
        def __init__(self, kind: str) -> None:
            from mlx_cairn.engine.request import PreparedRequest

            self.prepared = PreparedRequest(
                request=ChatRequest([Message("user", "x")]),
                prompt_ids=list(range(200)),
                parser_family=None,
                reasoning=False,
                in_reasoning=False,
                salt="",
                max_tokens=64,
                sampling=sampling(kind),
            )
            self.tokens = list(range(200)) + [i * 13 % vocab for i in range(40)]
            self.num_prompt = 200
            self.inflight: list[Any] = []
            self.processors = None
            self.row_masks: list[Any] = []

    out = {}
    logits = mx.random.normal((rows, vocab))
    mx.eval(logits)
    for kind in ("plain", "processors"):
        seqs = [Row(kind) for _ in range(rows)]
        mx.eval(L.process(seqs, logits))  # warm (builds the per-row caches)
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(L.process(seqs, logits))
        out[kind] = 1000 * (time.perf_counter() - t0) / iters
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    lm = dataclasses.replace(load(None), eos_token_ids=set())  # fixed-length outputs
    engine = Engine(lm, EngineConfig(max_batch=8))
    kinds = ["plain", "processors", "logprobs", "both"]
    run(engine, "plain", 8)  # warm-up
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            steps[k].append(run(engine, k, args.tokens))
    engine.close()
    base = statistics.median(steps["plain"])
    print(
        f"| batch 8, {args.tokens} tokens, {args.rounds} rounds | step ms (median) | tok/s | share of step |"
    )
    print("|---|---:|---:|---:|")
    for k in kinds:
        m = statistics.median(steps[k])
        share = (m - base) / m if k != "plain" else 0.0
        print(f"| {k} | {1000 * m:.1f} | {8 / m:.1f} | {100 * share:+.1f}% |")
    vocab = vocab_size(lm)
    mic = micro(vocab)
    print(
        f"\nprocess() alone on [8, {vocab}]: plain {mic['plain']:.3f} ms, "
        f"penalties + bias {mic['processors']:.3f} ms per step"
    )


if __name__ == "__main__":
    main()
