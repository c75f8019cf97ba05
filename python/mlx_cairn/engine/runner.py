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
        for group in _prefill_groups(plan.prefill):
            for seq, _ in group:
                if seq.inflight:
                    raise RuntimeError("a prefill chunk cannot include a token in flight")
            width = max(n for _, n in group)
            ids = [
                seq.tokens[seq.num_computed : seq.num_computed + n] + [0] * (width - n)
                for seq, n in group
            ]
            cache = PagedKVCache(
                self.pools,
                [seq.block_ids for seq, _ in group],
                [seq.num_computed for seq, _ in group],
                [n for _, n in group],
            )
            h = self.model(mx.array(ids, dtype=mx.int32), cache)
            last = [
                (b, n - 1)
                for b, (seq, n) in enumerate(group)
                if seq.num_computed + n == seq.num_tokens
            ]
            if last:
                rows_idx = mx.array([b for b, _ in last], dtype=mx.int32)
                cols_idx = mx.array([c for _, c in last], dtype=mx.int32)
                parts.append(self.model.logits(h[rows_idx, cols_idx, :]))
                rows.extend(group[b][0] for b, _ in last)
        sampled = None
        if rows:
            logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            samplers = []
            for seq in rows:
                if seq.sampler is None:
                    seq.sampler = RowSampler(seq.prepared.sampling)
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
        values: list[int] = step.sampled.tolist()  # type: ignore[assignment]
        return list(zip(step.rows, values, strict=True))


def merge_inflight(parts: list[InFlight]) -> InFlight | None:
    """One in-flight step from several launched separately (rows in order)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    plan = StepPlan(
        decode=[s for p in parts for s in p.plan.decode],
        prefill=[c for p in parts for c in p.plan.prefill],
    )
    sampled = [p.sampled for p in parts if p.sampled is not None]
    return InFlight(
        plan,
        [s for p in parts for s in p.rows],
        mx.concatenate(sampled) if sampled else None,
    )


def _prefill_groups(chunks: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """Batch prefill chunks into forward calls, padding each to its longest chunk.

    One call reads the weights once, so batching saves time as long as the
    padding stays small: chunks are sorted by length and a group is cut when
    padding would exceed a quarter of its real tokens.
    """
    groups: list[list[tuple[Sequence, int]]] = []
    for seq, n in sorted(chunks, key=lambda c: -c[1]):
        g = groups[-1] if groups else None
        if g is not None:
            width = g[0][1]
            real = sum(m for _, m in g) + n
            if (len(g) + 1) * width <= 1.25 * real + 16:
                g.append((seq, n))
                continue
        groups.append([(seq, n)])
    return groups


def _token_at(seq: Sequence, pos: int) -> mx.array:
    """Token ``pos`` of ``seq`` as an int32 scalar (lazy if it is still in flight)."""
    known = len(seq.tokens)
    if pos < known:
        return mx.array(seq.tokens[pos], dtype=mx.int32)
    return seq.inflight[pos - known].astype(mx.int32)
