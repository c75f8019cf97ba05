"""Runs planned steps on MLX: batched decode, chunked prefill, sampling, pipelined.

One step is built as a single lazy MLX graph and queued with ``mx.async_eval``::

    decode rows  (B x 1 tokens, ragged contexts)   -> logits [B, vocab]
    prefill chunk per sequence (1 x n tokens)      -> logits [1, vocab] if it is the
                                                      sequence's last pending chunk
    sample(all logits, per-row settings)           -> one token per finished row
    async_eval(tokens, every pool array)

The engine launches step n+1 (whose decode inputs are step n's still-lazy
tokens) before reading step n's tokens back, so building the next graph in
Python overlaps the forward pass on the device::

    launch(1)  launch(2) finalize(1)  launch(3) finalize(2)  ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.sampler import RowSampler, sample
from mlx_cairn.engine.scheduler import StepPlan
from mlx_cairn.engine.sequence import Sequence


@dataclass(slots=True)
class InFlight:
    """A launched step: its plan, the rows that sample, and their lazy tokens."""

    plan: StepPlan
    rows: list[Sequence]
    sampled: mx.array | None


class ModelRunner:
    """Owns the forward calls of the engine thread."""

    def __init__(self, model: Any, pools: KVPools) -> None:
        self.model = model
        self.pools = pools

    def launch(self, plan: StepPlan) -> InFlight:
        """Build and queue ``plan``'s graph; advance ``num_computed`` and push lazy tokens."""
        rows: list[Sequence] = []
        parts: list[mx.array] = []
        if plan.decode:
            seqs = plan.decode
            tokens = mx.stack([_token_at(s, s.num_computed) for s in seqs])[:, None]
            cache = PagedKVCache(
                self.pools, [s.block_ids for s in seqs], [s.num_computed for s in seqs], 1
            )
            h = self.model(tokens, cache)
            parts.append(self.model.logits(h[:, -1, :]))
            rows.extend(seqs)
        for seq, n in plan.prefill:
            start = seq.num_computed
            if seq.inflight:
                raise RuntimeError("a prefill chunk cannot include a token in flight")
            tokens = mx.array([seq.tokens[start : start + n]], dtype=mx.int32)
            cache = PagedKVCache(self.pools, [seq.block_ids], [start], n)
            h = self.model(tokens, cache)
            if start + n == seq.num_tokens:
                parts.append(self.model.logits(h[:, -1, :]))
                rows.append(seq)
        sampled = None
        if rows:
            logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            samplers = []
            for seq in rows:
                if seq.sampler is None:
                    seq.sampler = RowSampler(seq.sampling)
                # A row's random stream is keyed by (seed, output index) only.
                seq.sampler.step = seq.num_tokens - seq.num_prompt
                samplers.append(seq.sampler)
            sampled = sample(logits, samplers)
            mx.async_eval(sampled, self.pools.arrays())
        else:
            mx.async_eval(self.pools.arrays())
        # Only now that nothing can fail: commit the bookkeeping.
        for seq in plan.decode:
            seq.num_computed += 1
        for seq, n in plan.prefill:
            seq.num_computed += n
        if sampled is not None:
            for i, seq in enumerate(rows):
                seq.inflight.append(sampled[i])
        return InFlight(plan, rows, sampled)

    def finalize(self, step: InFlight) -> list[tuple[Sequence, int]]:
        """Wait for ``step``; return (sequence, token) per sampling row."""
        if step.sampled is None:
            mx.eval(self.pools.arrays())
            return []
        values = step.sampled.tolist()
        return list(zip(step.rows, values, strict=True))


def _token_at(seq: Sequence, pos: int) -> mx.array:
    """Token ``pos`` of ``seq`` as an int32 scalar (lazy if it is still in flight)."""
    known = len(seq.tokens)
    if pos < known:
        return mx.array(seq.tokens[pos], dtype=mx.int32)
    return seq.inflight[pos - known].astype(mx.int32)
