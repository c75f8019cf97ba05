"""The batched sampler: greedy, filters, seeds, and row independence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.engine.sampler import RowSampler, sample, sample_tokens
from mlx_cairn.types import SamplingParams

V = 50


def _logits(seed: int, rows: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, V)).astype(np.float32) * 3)


def _run(params: SamplingParams, logits: mx.array, steps: int) -> list[int]:
    r = RowSampler(params)
    return [int(sample(logits, [r])[0]) for _ in range(steps)]


def test_greedy_is_argmax():
    lg = _logits(0, rows=4)
    rows = [RowSampler(SamplingParams(temperature=0.0)) for _ in range(4)]
    assert sample(lg, rows).tolist() == np.argmax(np.array(lg), axis=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=2),
        SamplingParams(temperature=1.0, min_p=1.0, seed=3),
    ],
)
def test_filters_that_keep_one_token_are_greedy(params):
    lg = _logits(1)
    assert set(_run(params, lg, 20)) == {int(np.argmax(np.array(lg)))}


def test_top_k_and_min_p_restrict_support():
    lg = _logits(2)
    order = np.argsort(-np.array(lg)[0])
    toks = _run(SamplingParams(temperature=5.0, top_k=3, seed=4), lg, 200)
    assert set(toks) <= set(order[:3].tolist()) and len(set(toks)) > 1
    p = np.exp(np.array(lg)[0] / 5.0)
    p /= p.sum()
    allowed = set(np.nonzero(p >= 0.5 * p.max())[0].tolist())
    toks = _run(SamplingParams(temperature=5.0, min_p=0.5, seed=5), lg, 200)
    assert set(toks) <= allowed


def test_top_p_keeps_smallest_set_reaching_p():
    lg = mx.array([[np.log(0.5), np.log(0.3), np.log(0.15), np.log(0.05)]], dtype=mx.float32)
    toks = set(_run(SamplingParams(temperature=1.0, top_p=0.7, seed=6), lg, 300))
    assert toks == {0, 1}


def test_frequencies_follow_the_distribution():
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    lg = mx.array(np.log(probs)[None].astype(np.float32))
    n = 4000
    toks = _run(SamplingParams(temperature=1.0, seed=7), lg, n)
    freq = np.bincount(toks, minlength=4) / n
    # 5 standard deviations of a binomial proportion.
    assert np.all(np.abs(freq - probs) < 5 * np.sqrt(probs * (1 - probs) / n))


def test_temperature_sharpens():
    lg = _logits(3)
    top = int(np.argmax(np.array(lg)))
    cold = _run(SamplingParams(temperature=0.2, seed=8), lg, 300).count(top)
    hot = _run(SamplingParams(temperature=3.0, seed=8), lg, 300).count(top)
    assert cold > hot


def test_seed_reproduces_and_differs():
    lg = _logits(4)
    a = _run(SamplingParams(temperature=1.0, seed=11), lg, 30)
    assert a == _run(SamplingParams(temperature=1.0, seed=11), lg, 30)
    assert a != _run(SamplingParams(temperature=1.0, seed=12), lg, 30)


@given(
    neighbours=st.lists(
        st.tuples(st.floats(0.0, 2.0), st.integers(0, 10), st.floats(0.1, 1.0), st.integers(0, 99)),
        max_size=5,
    ),
    position=st.integers(0, 5),
)
def test_row_does_not_depend_on_neighbours(neighbours, position):
    """A seeded row yields the same tokens alone or anywhere in any batch."""
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=42)
    lg_row = _logits(5)
    alone = _run(target, lg_row, 5)

    others = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s in neighbours]
    position = min(position, len(others))
    params = [*others[:position], target, *others[position:]]
    rows = [RowSampler(p) for p in params]
    lg = np.array(_logits(6, rows=len(params)))
    lg[position] = np.array(lg_row)[0]
    got = [int(sample(mx.array(lg), rows)[position]) for _ in range(5)]
    assert got == alone


def test_stateless_api_and_shape_errors():
    lg = _logits(9, rows=2)
    out = sample_tokens(
        lg,
        temperature=np.array([0.0, 1.0]),
        top_k=np.array([0, 0]),
        top_p=np.array([1.0, 1.0]),
        min_p=np.array([0.0, 0.0]),
        uniform=np.array([0.5, 1e-9]),
    )
    assert out.dtype == mx.int32 and out.shape == (2,)
    assert int(out[0]) == int(np.argmax(np.array(lg)[0]))
    with pytest.raises(ValueError):
        sample(lg, [RowSampler()])
