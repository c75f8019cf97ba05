"""Batched token sampling with per-row settings and per-row random streams.

Each row b of a batch has its own temperature / top_k / top_p / min_p and its
own seed. A row draws one uniform number per step from a generator keyed by
``(seed, step)`` and picks the token by inverse-CDF over its filtered
distribution, so a row's tokens never depend on which other rows share the
batch, on their order, or on how many there are.

Example::

    rows = [RowSampler(SamplingParams(temperature=0.7, seed=1)), RowSampler(SamplingParams(0.0))]
    tokens = sample(logits, rows)          # logits [2, vocab] fp32 -> [2] int32

Filters apply in the usual order: temperature, top_k, top_p (over the
top_k-renormalised mass), min_p (relative to the most likely token).
A temperature below ``GREEDY_BELOW_TEMPERATURE`` (0 included) is greedy (argmax).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlx_cairn.backends.cpu import kernels as cpu_kernels
from mlx_cairn.types import GREEDY_BELOW_TEMPERATURE, SamplingParams

_SEED_MASK = (1 << 63) - 1


def row_uniform(seed: int, step: int) -> float:
    """The uniform draw in (0, 1) of the row seeded ``seed`` at ``step``."""
    u = float(np.random.Generator(np.random.PCG64([seed & _SEED_MASK, step])).random())
    return max(u, 1e-12)


class RowSampler:
    """The sampling state of one sequence: its settings and its step counter.

    Without an explicit seed a random one is drawn, so unseeded rows differ
    run to run while seeded rows reproduce exactly.
    """

    __slots__ = ("params", "seed", "step")

    def __init__(self, params: SamplingParams | None = None, *, step: int = 0) -> None:
        self.params = params or SamplingParams()
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.step = step

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW_TEMPERATURE

    def next_uniform(self) -> float:
        u = row_uniform(self.seed, self.step)
        self.step += 1
        return u


def sample_tokens(
    logits: mx.array,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    uniform: np.ndarray,
) -> mx.array:
    """Stateless batched sampling: ``logits`` [B, V] and per-row parameter vectors [B] -> [B] int32."""
    _B, V = logits.shape
    logits = logits.astype(mx.float32)
    greedy_rows = temperature < GREEDY_BELOW_TEMPERATURE
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if bool(np.all(greedy_rows)):
        return greedy

    probs, order = _filtered(logits, temperature, top_k, top_p, min_p)
    cdf = mx.cumsum(probs, axis=-1)
    target = mx.array(uniform.astype(np.float32))[:, None] * cdf[:, -1:]
    idx = mx.minimum((cdf < target).sum(axis=-1), V - 1).astype(mx.int32)
    if order is not None:
        idx = mx.take_along_axis(order, idx[:, None], axis=-1)[:, 0].astype(mx.int32)
    return mx.where(mx.array(greedy_rows), greedy, idx)


def _filtered(
    logits: mx.array,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> tuple[mx.array, mx.array | None]:
    """Each row's filtered distribution [B, V] (greedy rows at temperature 1), sorted
    descending with its ``order`` when a top-k / top-p / min-p filter needs the sort."""
    V = logits.shape[-1]
    greedy_rows = temperature < GREEDY_BELOW_TEMPERATURE
    temp = mx.array(np.where(greedy_rows, 1.0, temperature).astype(np.float32))[:, None]
    scaled = logits / temp
    k = np.where(top_k > 0, np.minimum(top_k, V), V).astype(np.int32)
    need_sort = bool(np.any(k < V) or np.any(top_p < 1.0) or np.any(min_p > 0.0))

    order: mx.array | None = None
    if need_sort:
        order = mx.argsort(-scaled, axis=-1)  # descending
        scaled = mx.take_along_axis(scaled, order, axis=-1)
    probs = cpu_kernels.softmax(scaled, axis=-1)
    if need_sort:
        ranks = mx.arange(V, dtype=mx.int32)[None, :]
        keep = ranks < mx.array(k)[:, None]
        probs_k = mx.where(keep, probs, 0.0)
        mass = probs_k.sum(axis=-1, keepdims=True)
        # Mass strictly before each rank; rank 0 is always kept.
        before = (mx.cumsum(probs_k, axis=-1) - probs_k) / mass
        keep = keep & (before < mx.array(top_p.astype(np.float32))[:, None])
        floor = mx.array(min_p.astype(np.float32))[:, None] * probs[:, :1]
        keep = keep & (probs >= floor)
        probs = mx.where(keep, probs, 0.0)
    return probs, order


def filtered_probs(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """The distribution each row of ``logits`` [B, V] samples from, normalized, in
    vocabulary order (greedy rows: at temperature 1; their sampling takes the argmax)."""
    probs, order = _filtered(
        logits.astype(mx.float32),
        np.array([p.temperature for p in params], dtype=np.float32),
        np.array([p.top_k for p in params], dtype=np.int32),
        np.array([p.top_p for p in params], dtype=np.float32),
        np.array([p.min_p for p in params], dtype=np.float32),
    )
    probs = probs / probs.sum(axis=-1, keepdims=True)
    if order is None:
        return probs
    return mx.put_along_axis(mx.zeros_like(probs), order, probs, axis=-1)


def sample(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Sample one token per row of ``logits`` [B, V]; advances each row's step."""
    out = sample_rows(
        logits, [r.params for r in rows], [r.step for r in rows], [r.seed for r in rows]
    )
    for r in rows:
        r.step += 1
    return out


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    seeds: Sequence[int] | None = None,
) -> mx.array:
    """Stateless: sample row b of ``logits`` [B, V] with ``params[b]`` at output index ``steps[b]``.

    ``seeds`` default to each row's ``params.seed`` (resolved by the engine's
    prepare step, so never None there).
    """
    if logits.ndim != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {logits.shape} do not match {len(params)} rows")
    ps = params
    uniform = np.ones(len(ps), dtype=np.float64)
    for i, p in enumerate(ps):
        if p.temperature >= GREEDY_BELOW_TEMPERATURE:  # greedy rows leave the draw unused
            seed = seeds[i] if seeds is not None else p.seed
            if seed is None:
                raise ValueError("a sampled row needs a seed")
            uniform[i] = row_uniform(seed, steps[i])
    return sample_tokens(
        logits,
        temperature=np.array([p.temperature for p in ps], dtype=np.float32),
        top_k=np.array([p.top_k for p in ps], dtype=np.int32),
        top_p=np.array([p.top_p for p in ps], dtype=np.float32),
        min_p=np.array([p.min_p for p in ps], dtype=np.float32),
        uniform=uniform,
    )
