"""Quantized KV block pools (engine/paged_quant.py) against mlx-lm's QuantizedKVCache."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from mlx_cairn.engine.paged_quant import (
    QuantBlocks,
    block_bytes,
    check_kv_quant,
)
from mlx_cairn.models.base import LayerSpec

H, D, BS = 2, 64, 4


def _blocks(bits: int, num_blocks: int = 8) -> QuantBlocks:
    return QuantBlocks(layers=[LayerSpec(H, D, D)], num_blocks=num_blocks, block_size=BS, bits=bits)


def _write_seq(qb: QuantBlocks, table: list[int], k: mx.array, v: mx.array) -> None:
    """Write ``k``/``v`` [H, T, D] at positions 0..T-1 of the blocks in ``table``."""
    t = k.shape[1]
    blocks = mx.array([table[p // BS] for p in range(t)], dtype=mx.int32)
    rows = mx.array([p % BS for p in range(t)], dtype=mx.int32)
    qb.write(0, blocks, rows, k, v)


@pytest.mark.parametrize("bits", [8, 4])
def test_attention_matches_mlx_lm_quantized_cache(bits: int) -> None:
    # Same quantization (mx.quantize along the head dim, groups of 64) and the
    # same two quantized matmuls as mlx-lm: the blocks only change where rows
    # live, so outputs agree to float rounding.
    mx.random.seed(0)
    t, qh = 10, 4
    k = mx.random.normal((H, t, D))
    v = mx.random.normal((H, t, D))
    q = mx.random.normal((1, qh, 1, D))
    qb = _blocks(bits)
    table = [5, 2, 7]  # scattered on purpose
    _write_seq(qb, table, k, v)
    span = len(table) * BS
    mask = mx.arange(span)[None, None, None, :] < t  # padding past t is hidden
    ours = qb.attend(q, 0, mx.array([table], dtype=mx.int32), scale=D**-0.5, mask=mask)

    ref = QuantizedKVCache(group_size=64, bits=bits)
    rk, rv = ref.update_and_fetch(k[None], v[None])
    # q * 1.0: a copy, as mlx-lm scales its queries in place.
    want = quantized_scaled_dot_product_attention(
        q * 1.0, rk, rv, scale=D**-0.5, mask=None, group_size=64, bits=bits
    )
    assert mx.allclose(ours, want, atol=1e-5).item()
    # ... and both stay near full precision attention (quantization noise only).
    full = mx.fast.scaled_dot_product_attention(q, k[None], v[None], scale=D**-0.5)
    assert mx.abs(ours - full).max().item() < (0.05 if bits == 8 else 0.5)


def test_gather_is_packed_not_dequantized() -> None:
    qb = _blocks(8)
    (kq, ks, kb), _ = qb.gather(0, mx.array([[1, 2]], dtype=mx.int32))
    assert kq.dtype == mx.uint32 and kq.shape == (1, H, 2 * BS, D * 8 // 32)
    assert ks.shape == kb.shape == (1, H, 2 * BS, D // 64)


def test_copy_rows_copies_packed_rows_scales_and_biases() -> None:
    mx.random.seed(1)
    qb = _blocks(4)
    k = mx.random.normal((H, BS, D))
    v = mx.random.normal((H, BS, D))
    _write_seq(qb, [3], k, v)
    qb.copy_rows([(3, 6, 3)])
    for pool in (qb.k[0], qb.v[0]):
        assert pool is not None
        for a in pool:
            assert mx.array_equal(a[:, 6, :3], a[:, 3, :3]).item()
            assert not mx.any(a[:, 6, 3:]).item()  # rows past n untouched (zero)


def test_budget_counts_quantized_bytes() -> None:
    layers = [LayerSpec(8, 128, 128)] * 4
    full = 16 * sum(s.bytes_per_token(2) for s in layers)  # fp16 reference, as mlx-lm
    q8 = block_bytes(layers, 16, 8, 64, 2)
    q4 = block_bytes(layers, 16, 4, 64, 2)
    assert 1.8 < full / q8 < 2.0
    assert 3.0 < full / q4 < 3.6
    qb = _blocks(8, num_blocks=5)
    assert qb.nbytes == 5 * block_bytes(qb.layers, BS, 8, 64, 4)


@pytest.mark.parametrize(
    ("bits", "group", "message"),
    [
        (3, 64, "kv_bits must be 8 or 4"),
        (16, 64, "kv_bits must be 8 or 4"),
        (8, 48, "kv_group_size must be one of"),
        (8, 128, "does not divide layer 0's key head dimension 64"),
    ],
)
def test_bad_settings_are_refused(bits: int, group: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_kv_quant(bits, group, [LayerSpec(H, D, D)])


def test_full_precision_and_recurrent_layers_pass() -> None:
    check_kv_quant(None, 7, [LayerSpec(H, 48, 48)])
    check_kv_quant(8, 64, [LayerSpec(0, 0, 0), LayerSpec(H, D, D)])
