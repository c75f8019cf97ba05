"""Per-layer pools and the mlx-lm cache views of PagedKVCache (engine/paged.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.engine.paged import KVPools, LayerSpec, PagedKVCache

BS = 4


def pools(*specs: LayerSpec, blocks: int = 40) -> KVPools:
    return KVPools(layers=list(specs), num_blocks=blocks, block_size=BS)


def test_pools_take_each_layers_shape_and_bytes():
    p = pools(LayerSpec(2, 8, 8), LayerSpec(1, 32, 8, window=16), blocks=5)
    assert p.k[0].shape == (2, 5, BS, 8) and p.v[1].shape == (1, 5, BS, 8)
    assert p.k[1].shape == (1, 5, BS, 32)
    assert KVPools.block_bytes(p.layers, BS, 4) * 5 == p.nbytes
    # The uniform form still builds (and sizes) the same pools.
    u = KVPools(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=BS)
    assert KVPools.bytes_per_block(2, 3, 8, BS, 4) * 5 == u.nbytes


def brute_mask(offsets, lengths, key_pos, window):
    """mask[b, i, t] from first principles: key_pos[b, t] <= q and > q - window."""
    L = max(lengths)
    out = np.zeros((len(offsets), L, key_pos.shape[1]), dtype=bool)
    for b, o in enumerate(offsets):
        for i in range(L):
            q = o + i
            kp = key_pos[b]
            ok = kp <= q
            if window is not None:
                ok &= kp > q - window
            out[b, i] = ok
    return out


@pytest.mark.parametrize("lengths", [[1, 1, 1], [5, 2, 3]])
def test_sliding_layers_gather_only_their_window(lengths):
    p = pools(LayerSpec(1, 4, 4), LayerSpec(1, 4, 4, window=6))
    offsets = [41, 3, 17]
    tables = [
        list(range(1, 1 + (o + n + BS - 1) // BS)) for o, n in zip(offsets, lengths, strict=True)
    ]
    tables = [[b + 10 * r for b in t] for r, t in enumerate(tables)]  # distinct blocks per row
    c = PagedKVCache(p, tables, offsets, lengths)
    glob, slide = c.layers
    assert glob.window is None and slide.window == 6
    assert (np.array(glob.offset) == offsets).all()
    g, w = c.view(None), c.view(6)
    # The global view spans the longest row; the window view only what the
    # queries can see (row 0 at position 41 skips its first 9 blocks).
    assert g.tables.shape[1] == (41 + max(lengths) + BS - 1) // BS
    assert w.tables.shape[1] < g.tables.shape[1]
    assert int(w.key_pos[0].min()) == (41 - 6 + 1) // BS * BS
    assert np.array(w.tables)[0, 0] == tables[0][(41 - 6 + 1) // BS]
    for view, layer, window in ((g, glob, None), (w, slide, 6)):
        kp = np.broadcast_to(view.key_pos, (3, view.key_pos.shape[1]))
        got = np.array(layer.make_mask(max(lengths)))[:, 0]
        assert (got == brute_mask(offsets, lengths, kp, window)).all()
        # Every query (padding ones too) sees at least one key: no empty softmax row.
        assert got.any(axis=-1).all()


def test_window_views_return_the_stored_rows_at_their_positions():
    p = pools(LayerSpec(2, 3, 5, window=5))
    offsets, lengths = [9, 2], [3, 1]
    tables = [[1, 2, 3], [4]]
    c = PagedKVCache(p, tables, offsets, lengths)
    (layer,) = c.layers
    L = max(lengths)
    keys = mx.random.normal((2, 2, L, 3))
    values = mx.random.normal((2, 2, L, 5))
    k_all, v_all = layer.update_and_fetch(keys, values)
    assert k_all.shape[:2] == (2, 2) and v_all.shape[-1] == 5
    kp = np.broadcast_to(c.view(5).key_pos, (2, k_all.shape[2]))
    for b in range(2):
        for i in range(lengths[b]):
            t = int(np.nonzero(kp[b] == offsets[b] + i)[0][0])
            assert mx.array_equal(k_all[b, :, t], keys[b, :, i]).item()
            assert mx.array_equal(v_all[b, :, t], values[b, :, i]).item()


def test_mask_for_the_wrong_step_length_is_refused():
    c = PagedKVCache(pools(LayerSpec(1, 4, 4)), [[1, 2]], [4], 2)
    with pytest.raises(ValueError, match="2"):
        c.layers[0].make_mask(3)
