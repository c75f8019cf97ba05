"""PagedKVCache: a ragged batch over block pools computes what one contiguous cache per row does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.engine.paged import KVPools, PagedKVCache
from mlx_cairn.models.cache import ContiguousKVCache
from mlx_cairn.testing.tiny_models import tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lm(request):
    return tiny_model(request.param, seed=2)


def contiguous_logits(model, ids: list[int], split: int) -> np.ndarray:
    """Logits at every position of ids[split:] after prefilling ids[:split]."""
    cache = ContiguousKVCache(model.num_layers)
    if split:
        model(mx.array([ids[:split]], dtype=mx.int32), cache)
    h = model(mx.array([ids[split:]], dtype=mx.int32), cache)
    return np.array(model.logits(h[0]))


def test_ragged_chunks_match_contiguous(lm):
    model = lm.model
    bs = 4
    pools = KVPools(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        num_blocks=64,
        block_size=bs,
    )
    rng = np.random.default_rng(0)
    # (context already in the pool, new tokens this call)
    shapes = [(0, 7), (5, 1), (13, 4), (8, 8)]
    seqs = [rng.integers(0, model.vocab_size, a + b).tolist() for a, b in shapes]
    # Scrambled, non-contiguous block ids per row.
    free = rng.permutation(np.arange(1, 64)).tolist()
    tables = [[free.pop() for _ in range(-(-(a + b) // bs))] for a, b in shapes]
    # Prefill each row's context one row at a time.
    for (a, _), ids, t in zip(shapes, seqs, tables, strict=True):
        if a:
            model(mx.array([ids[:a]], dtype=mx.int32), PagedKVCache(pools, [t], [0], a))
    lengths = [b for _, b in shapes]
    width = max(lengths)
    tokens = [ids[a:] + [0] * (width - b) for (a, b), ids in zip(shapes, seqs, strict=True)]
    cache = PagedKVCache(pools, tables, [a for a, _ in shapes], lengths)
    h = model(mx.array(tokens, dtype=mx.int32), cache)
    got = np.array(model.logits(h))
    for row, ((a, b), ids) in enumerate(zip(shapes, seqs, strict=True)):
        want = contiguous_logits(model, ids, a)
        np.testing.assert_allclose(got[row, :b], want, rtol=1e-4, atol=1e-4)
    # Padding went to the null block only: every row's blocks hold exactly its tokens.
    for (a, b), ids, t in zip(shapes, seqs, tables, strict=True):
        cache2 = ContiguousKVCache(model.num_layers)
        model(mx.array([ids], dtype=mx.int32), cache2)
        k_ref = np.array(cache2.keys[0][0, :, : a + b, :])  # [kvh, T, hd]
        # Head-major pools: [kvh, blocks, bs, hd] -> [kvh, T, hd].
        k_pool = np.array(pools.k[0][:, mx.array(t)]).reshape(
            model.num_kv_heads, -1, model.head_dim
        )
        np.testing.assert_allclose(k_pool[:, : a + b], k_ref, rtol=1e-5, atol=1e-5)


def test_cache_rejects_short_tables(lm):
    model = lm.model
    pools = KVPools(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        num_blocks=8,
        block_size=4,
    )
    with pytest.raises(ValueError, match="cannot hold"):
        PagedKVCache(pools, [[1]], [3], 2)


def test_pool_shape_and_validation():
    p = KVPools(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=4)
    assert p.k[0].shape == (3, 5, 4, 8) and len(p.v) == 2
    assert p.nbytes == 2 * 2 * 5 * 4 * 3 * 8 * 4
    assert KVPools.bytes_per_block(2, 3, 8, 4, 4) * 5 == p.nbytes
    with pytest.raises(ValueError):
        KVPools(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=1, block_size=4)
    with pytest.raises(ValueError):
        KVPools(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=0)


def test_long_prefill_chunks_get_calls_of_their_own() -> None:
    """Chunks of SOLO_PREFILL_TOKENS or more are never padded into a shared call;
    shorter ones still share calls (one read of the weights)."""
    from types import SimpleNamespace

    from mlx_cairn.engine.model_runner import SOLO_PREFILL_TOKENS, _prefill_groups

    n = SOLO_PREFILL_TOKENS
    chunks = [SimpleNamespace(n=k) for k in (n + 188, n + 66, n, 20, 18, 3 * n)]
    groups = [[c.n for c in g] for g in _prefill_groups(chunks)]  # type: ignore[arg-type]
    assert groups == [[3 * n], [n + 188], [n + 66], [n], [20, 18]]
    same = [SimpleNamespace(n=k) for k in (2 * n, 2 * n, 16, 16)]
    groups = [[c.n for c in g] for g in _prefill_groups(same, ragged=False)]  # type: ignore[arg-type]
    assert groups == [[2 * n], [2 * n], [16, 16]]
