"""The one-sequence reference loop: prompt ids -> prefill -> decode over a contiguous cache.

It is the simplest correct generator and the yardstick the paged, batched
engine is tested against (same sampler, same per-row random stream, so a
seeded request yields the same tokens in both). It also backs
``cairn generate`` and the single-stream benchmark.

Example::

    ids = generate_ids(lm.model, prompt_ids, max_tokens=32,
                       sampling=SamplingParams(temperature=0), eos_token_ids=lm.eos_token_ids)

The decode loop is pipelined: step n+1's graph is built and queued with
``mx.async_eval`` before step n's token is read back, so Python graph
construction overlaps the forward pass::

    y0 = sample(prefill)          async_eval(y0)
    y1 = sample(step(y0))         async_eval(y1)    yield y0.item()
    y2 = sample(step(y1))         async_eval(y2)    yield y1.item()   ...
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_cairn.engine.sampler import RowSampler, sample
from mlx_cairn.models.base import Model
from mlx_cairn.models.cache import ContiguousKVCache
from mlx_cairn.types import SamplingParams

#: Prompt tokens per prefill forward call (bounds the attention scratch memory).
PREFILL_STEP = 512


@dataclass
class GenerationStats:
    """What one reference run did (filled in while the generator runs)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: "eos" (an EOS id was sampled; it is the last token) or "length".
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes out of the prefill; the rest are decode steps.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s and steps > 0 else 0.0


def prefill(
    model: Model, cache: ContiguousKVCache, prompt_ids: list[int], step: int = PREFILL_STEP
) -> mx.array:
    """Run the prompt through ``model`` in chunks; return the last position's fp32 logits [1, vocab]."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    ids = mx.array(prompt_ids, dtype=mx.int32)[None]
    n = len(prompt_ids)
    start = 0
    while n - start > step:
        model(ids[:, start : start + step], cache)
        mx.eval(cache.state)
        start += step
    h = model(ids[:, start:], cache)
    return model.logits(h[:, -1, :])


def generate_tokens(
    model: Model,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams | RowSampler | None = None,
    eos_token_ids: Iterable[int] = (),
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one by one; an EOS id is yielded and ends the stream."""
    row = sampling if isinstance(sampling, RowSampler) else RowSampler(sampling)
    eos = {int(t) for t in eos_token_ids}
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if max_tokens <= 0:
        stats.finish_reason = "length"
        return
    cache = ContiguousKVCache(model.num_layers)
    if row.params.uses_processors:
        yield from _with_processors(model, cache, prompt_ids, max_tokens, row, eos, stats)
        return

    def step(y: mx.array) -> mx.array:
        h = model(y[:, None], cache)
        return sample(model.logits(h[:, -1, :]), [row])

    t0 = time.perf_counter()
    y = sample(prefill(model, cache, prompt_ids), [row])
    mx.async_eval(y)
    n = 0
    t_decode = 0.0
    while True:
        nxt = None
        if n + 1 < max_tokens:
            nxt = step(y)
            mx.async_eval(nxt)
        tok = int(y.item())  # type: ignore[arg-type]
        if n == 0:
            t_decode = time.perf_counter()
            stats.prefill_s = t_decode - t0
        n += 1
        stats.generated_tokens = n
        stats.token_ids.append(tok)
        stats.decode_s = time.perf_counter() - t_decode
        done = tok in eos or n >= max_tokens
        if done:
            stats.finish_reason = "eos" if tok in eos else "length"
        yield tok
        if done or nxt is None:
            return
        y = nxt


def _with_processors(
    model: Model,
    cache: ContiguousKVCache,
    prompt_ids: list[int],
    max_tokens: int,
    row: RowSampler,
    eos: set[int],
    stats: GenerationStats,
) -> Iterator[int]:
    """The unpipelined loop with the logits processors written out plainly (numpy, one row)."""
    out: list[int] = []
    logits = prefill(model, cache, prompt_ids)
    while True:
        raw = np.array(logits[0].astype(mx.float32))
        processed = naive_process(raw, row.params, prompt_ids, out)
        tok = int(sample(mx.array(processed)[None], [row]).item())  # type: ignore[arg-type]
        out.append(tok)
        stats.generated_tokens = len(out)
        stats.token_ids.append(tok)
        done = tok in eos or len(out) >= max_tokens
        if done:
            stats.finish_reason = "eos" if tok in eos else "length"
        yield tok
        if done:
            return
        h = model(mx.array([[tok]], dtype=mx.int32), cache)
        logits = model.logits(h[:, -1, :])


def naive_process(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """Penalties and bias on one row's logits, token by token (the yardstick for logits.py)."""
    out = logits.astype(np.float32).copy()
    rp = params.repetition_penalty
    if rp != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
    for t, c in Counter(output).items():
        out[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, b in params.logit_bias.items():
        out[t] += b
    return out


def generate_ids(
    model: Model,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams | RowSampler | None = None,
    eos_token_ids: Iterable[int] = (),
) -> list[int]:
    """All generated token ids (ending with the EOS id when one was sampled)."""
    return list(
        generate_tokens(
            model, prompt_ids, max_tokens=max_tokens, sampling=sampling, eos_token_ids=eos_token_ids
        )
    )
