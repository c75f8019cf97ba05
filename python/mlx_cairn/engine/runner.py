"""Runs one planned step on MLX: batched decode, chunked prefill, sampling.

One step is built as a single lazy MLX graph and evaluated once::

    decode rows  (B x 1 tokens, ragged contexts)   -> logits [B, vocab]
    prefill chunk per sequence (1 x n tokens)      -> logits [1, vocab] if it is the
                                                      sequence's last pending chunk
    sample(all logits, per-row settings)           -> one token per finished row
    eval(tokens, every pool array)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.engine.sampler import RowSampler, sample
from mlx_cairn.engine.scheduler import StepPlan
from mlx_cairn.engine.sequence import Sequence


class ModelRunner:
    """Owns the forward calls of the engine thread."""

    def __init__(self, model: Any, pools: KVPools) -> None:
        self.model = model
        self.pools = pools

    def run(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """Compute ``plan``; return (sequence, sampled token) for rows that finished their pending tokens."""
        rows: list[Sequence] = []
        parts: list[mx.array] = []
        if plan.decode:
            seqs = plan.decode
            tokens = mx.array([[s.tokens[s.num_computed]] for s in seqs], dtype=mx.int32)
            cache = PagedKVCache(
                self.pools, [s.block_ids for s in seqs], [s.num_computed for s in seqs], 1
            )
            h = self.model(tokens, cache)
            parts.append(self.model.logits(h[:, -1, :]))
            rows.extend(seqs)
        for seq, n in plan.prefill:
            start = seq.num_computed
            tokens = mx.array([seq.tokens[start : start + n]], dtype=mx.int32)
            cache = PagedKVCache(self.pools, [seq.block_ids], [start], n)
            h = self.model(tokens, cache)
            if start + n == len(seq.tokens):
                parts.append(self.model.logits(h[:, -1, :]))
                rows.append(seq)
        if not rows:
            mx.eval(self.pools.arrays())
            return []
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        samplers = []
        for seq in rows:
            if seq.sampler is None:
                seq.sampler = RowSampler(seq.sampling)
            # A row's random stream is keyed by (seed, output index) only.
            seq.sampler.step = seq.num_output
            samplers.append(seq.sampler)
        sampled = sample(logits, samplers)
        mx.eval(sampled, self.pools.arrays())
        return list(zip(rows, sampled.tolist(), strict=True))
