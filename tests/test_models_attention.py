"""The CPU attention path (prefill and decode) against mx.fast.scaled_dot_product_attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.backends.cpu.attention import _cpu_attention, _exp2_shifted, attention

RTOL = 2e-5


def _qkv(
    b: int, h: int, kvh: int, length: int, t: int, d: int = 16, seed: int = 0, spread: float = 1.0
):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.normal(size=(b, h, length, d)).astype(np.float32) * spread)
    k = mx.array(rng.normal(size=(b, kvh, t, d)).astype(np.float32) * spread)
    v = mx.array(rng.normal(size=(b, kvh, t, d)).astype(np.float32))
    return q, k, v


def _close(got: mx.array, want: mx.array) -> None:
    g, w = np.array(got), np.array(want)
    assert g.shape == w.shape
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max())


def _ragged_mask(offsets: list[int], lengths: list[int], t: int) -> mx.array:
    """The paged cache's mask: [B, 1, L, T], key j visible to query i of row b iff j <= offsets[b] + i."""
    length = max(lengths)
    pos = np.asarray(offsets)[:, None] + np.arange(length)[None, :]
    return mx.array((np.arange(t)[None, None, :] <= pos[:, :, None])[:, None])


@pytest.fixture(params=[2_000_000, 700], ids=["one-chunk", "many-chunks"])
def chunk(request, monkeypatch):
    """Run each case with the default chunking and with chunks of a few query rows."""
    monkeypatch.setattr(cpu_attention, "_CHUNK_SCORES", request.param)
    return request.param


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("shape", [(37, 37), (37, 100), (5, 53)], ids=["square", "tail", "short"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_matches_fast_sdpa_none_and_causal(heads, shape, mask, chunk):
    h, kvh = heads
    length, t = shape
    q, k, v = _qkv(2, h, kvh, length, t, seed=length + t)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _close(_cpu_attention(q, k, v, 0.25, mask), want)


def test_matches_fast_sdpa_ragged_paged_mask(chunk):
    # Three rows of a padded prefill call: different offsets and lengths, keys
    # padded to a block multiple; pad queries still see real keys.
    offsets, lengths = [0, 40, 7], [30, 12, 25]
    t = 80
    q, k, v = _qkv(3, 6, 2, max(lengths), t, seed=3)
    mask = _ragged_mask(offsets, lengths, t)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _close(_cpu_attention(q, k, v, 0.25, mask), want)
    _close(attention(q, k, v, 0.25, mask), want)


@pytest.mark.parametrize(
    "mask_shape",
    [(1, 1, 20, 50), (2, 6, 20, 50), (20, 50), (2, 1, 1, 50)],
    ids=["b1", "per-head", "2d", "one-row"],
)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_matches_fast_sdpa_array_masks(mask_shape, kind, chunk):
    q, k, v = _qkv(2, 6, 2, 20, 50, seed=5)
    rng = np.random.default_rng(9)
    visible = rng.random(mask_shape) < 0.7
    visible[..., 0] = True  # no row fully masked
    if kind == "bool":
        mask = mx.array(visible)
    else:
        mask = mx.array(np.where(visible, rng.normal(size=mask_shape), -np.inf).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _close(_cpu_attention(q, k, v, 0.25, mask), want)


def test_fully_masked_row_averages_like_mlx():
    q, k, v = _qkv(1, 4, 2, 3, 6, seed=12)
    mask = mx.array([[True] * 6, [False] * 6, [True] + [False] * 5])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _close(_cpu_attention(q, k, v, 0.25, mask), want)


def test_large_scores_are_shifted_not_overflowed():
    # Scores in the hundreds: exp without the max shift would overflow fp32.
    q, k, v = _qkv(1, 4, 2, 24, 64, d=16, seed=11, spread=8.0)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
    _close(_cpu_attention(q, k, v, 1.0, "causal"), want)


@pytest.mark.parametrize("mask", ["ragged", "causal", None])
def test_decode_rows_take_the_cpu_path_and_match(mask):
    # One query per row (decode), rows at different lengths of a padded cache.
    q, k, v = _qkv(2, 6, 2, 1, 30, seed=2, spread=3.0)
    m = _ragged_mask([29, 10], [1, 1], 30) if mask == "ragged" else mask
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = attention(q, k, v, 0.25, m)
    assert not mx.array_equal(got, want).item()  # (computed by the base-2 path, not MLX's)
    _close(got, want)


def test_other_dtypes_keep_the_fast_path():
    q, k, v = (x.astype(mx.float16) for x in _qkv(1, 6, 2, 8, 8, seed=4))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.array_equal(attention(q, k, v, 0.25, "causal"), want).item()


def test_unknown_mask_string_is_an_error():
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="mask"):
        _cpu_attention(q, k, v, 0.25, "sliding")


def test_exp2_matches_power_fused_and_plain():
    x = np.concatenate([-np.geomspace(1e-6, 125.0, 4000), [0.0, -125.99, -126.5, -200.0, -np.inf]])
    x = x.astype(np.float32)
    s = mx.array(x).reshape(1, 1, 1, 1, -1)
    m = mx.zeros((1, 1, 1, 1, 1))
    want = np.exp2(x.astype(np.float64))
    want[x <= -126.0] = 0.0
    for got in (np.array(cpu_attention._exp2(s, m)).ravel(), np.array(_exp2_shifted(s, m)).ravel()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
