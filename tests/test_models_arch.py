"""The decoder architecture against the KV-cache contract (tiny random models)."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import ContiguousKVCache, ModelArgs
from mlx_cairn.testing.tiny_models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]


def _full_logits(model, ids: list[int]) -> np.ndarray:
    """Logits at every position from one pass over the whole sequence."""
    cache = ContiguousKVCache(model.num_layers)
    h = model(mx.array([ids]), cache)
    return np.array(model.logits(h)[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_full_recompute(arch):
    lm = tiny_model(arch, seed=1)
    model = lm.model
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.vocab_size, size=40).tolist()
    full = _full_logits(model, ids)

    cache = ContiguousKVCache(model.num_layers)
    prompt = 13
    h = model(mx.array([ids[:prompt]]), cache)
    got = [np.array(model.logits(h[:, -1, :])[0])]
    for t in ids[prompt:]:
        h = model(mx.array([[t]]), cache)
        got.append(np.array(model.logits(h[:, -1, :])[0]))
    assert cache.offset == len(ids)
    want = full[prompt - 1 :]
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-4, atol=1e-4)
    assert np.argmax(got[-1]) == np.argmax(want[-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_full(arch):
    lm = tiny_model(arch, seed=2)
    model = lm.model
    ids = np.random.default_rng(1).integers(0, model.vocab_size, size=300).tolist()
    full = _full_logits(model, ids)
    cache = ContiguousKVCache(model.num_layers)
    # Chunks straddle the cache's 256-token growth step.
    for a, b in [(0, 100), (100, 250), (250, 299), (299, 300)]:
        h = model(mx.array([ids[a:b]]), cache)
        np.testing.assert_allclose(np.array(model.logits(h[0])), full[a:b], rtol=1e-4, atol=1e-4)


class _RaggedCache:
    """A minimal batched cache: per-row histories padded on the right, with an array mask."""

    def __init__(self, histories: list[list[tuple]], offsets: list[int]):
        self._hist = histories  # [row][layer] -> (k, v) of shape [1, H, T_row, D]
        self._offsets = mx.array(offsets, dtype=mx.int32)

    @property
    def offsets(self):
        return self._offsets

    def update_and_fetch(self, layer, k, v):
        B, _H, L, _D = k.shape
        assert L == 1
        ks, vs, lens = [], [], []
        for b in range(B):
            hk, hv = self._hist[b][layer]
            ks.append(mx.concatenate([hk, k[b : b + 1]], axis=2))
            vs.append(mx.concatenate([hv, v[b : b + 1]], axis=2))
            lens.append(ks[-1].shape[2])
        T = max(lens)
        pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, T - x.shape[2]), (0, 0)])  # noqa: E731
        mask = mx.array([[i < n for i in range(T)] for n in lens])[:, None, None, :]
        return mx.concatenate([pad(x) for x in ks]), mx.concatenate([pad(x) for x in vs]), mask


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ragged_batch_uses_per_row_offsets(arch):
    """Two sequences of different lengths decode together, each at its own position."""
    lm = tiny_model(arch, seed=3)
    model = lm.model
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, model.vocab_size, size=n).tolist() for n in (7, 12)]
    caches, hist, want = [], [], []
    for s in seqs:
        c = ContiguousKVCache(model.num_layers)
        model(mx.array([s[:-1]]), c)
        caches.append(c)
        n = c.offset
        hist.append(
            [(c.keys[i][:, :, :n, :], c.values[i][:, :, :n, :]) for i in range(model.num_layers)]
        )
        want.append(_full_logits(model, s)[-1])
    cache = _RaggedCache(hist, [len(s) - 1 for s in seqs])
    h = model(mx.array([[s[-1]] for s in seqs]), cache)
    got = np.array(model.logits(h[:, -1, :]))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-4)


def test_contract_attributes():
    lm = tiny_model("qwen3")
    m = lm.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.vocab_size) == (2, 2, 32, 384)
    h = m(mx.array([[1, 2, 3]]), ContiguousKVCache(m.num_layers))
    assert h.shape == (1, 3, 64)
    assert m.logits(h).dtype == mx.float32


def test_tiny_model_is_deterministic():
    a, b = tiny_model("llama", seed=5), tiny_model("llama", seed=5)
    c = tiny_model("llama", seed=6)
    ids = [1, 5, 9, 30]
    la, lb, lc = (_full_logits(x.model, ids) for x in (a, b, c))
    np.testing.assert_array_equal(la, lb)
    assert not np.allclose(la, lc)
    assert a.identity == b.identity != c.identity


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}, "gpt_neox"),
        ({"architectures": ["Mamba"]}, "None"),
    ],
)
def test_unsupported_architecture_is_named(config, needle):
    with pytest.raises(ModelLoadError, match="unsupported model architecture") as e:
        ModelArgs.from_config(config)
    assert needle in str(e.value)


def test_unknown_rope_scaling_is_clear():
    from mlx_cairn.models.llama import LlamaModel

    cfg = dict(
        model_type="llama",
        hidden_size=8,
        num_hidden_layers=1,
        intermediate_size=8,
        num_attention_heads=2,
        vocab_size=10,
        rope_scaling={"type": "yarn-ish", "factor": 2},
    )
    with pytest.raises(ModelLoadError, match="rope_scaling"):
        LlamaModel(ModelArgs.from_config(cfg))


def test_rope_layouts_differ_but_both_run():
    kind: Literal["llama"] = "llama"
    lm = tiny_model(kind)
    ids = [3, 4, 5, 6]
    a = _full_logits(lm.model, ids)
    for layer in lm.model.model.layers:
        layer.self_attn.rope.traditional = True
    b = _full_logits(lm.model, ids)
    assert a.shape == b.shape and not np.allclose(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_layout_gives_the_same_logits(arch):
    from mlx.utils import tree_flatten

    from mlx_cairn.backends.cpu.layout import BlockedLinear, apply_cpu_layout, hf_parameters

    lm = tiny_model(arch, seed=4)
    before = dict(tree_flatten(lm.model.parameters()))
    ids = mx.array(np.random.default_rng(3).integers(0, 384, size=(2, 9)))
    want = np.array(lm.model.logits(lm.model(ids, _TwoRows(lm.model.num_layers))))
    assert apply_cpu_layout(lm.model, "on") > 0
    mods = dict(lm.model.named_modules())
    assert isinstance(mods["head"], BlockedLinear)
    assert isinstance(mods["model.layers.0.mlp.gate_proj"], BlockedLinear)  # 128 out > 64 in
    assert isinstance(
        mods["model.layers.0.mlp.down_proj"], BlockedLinear
    )  # narrow: 64 out < 128 in
    got = np.array(lm.model.logits(lm.model(ids, _TwoRows(lm.model.num_layers))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    after = hf_parameters(lm.model)
    assert set(after) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(np.array(after[k]), np.array(v))


class _TwoRows:
    """Two independent contiguous caches side by side (rows at offset 0)."""

    def __init__(self, n):
        self.offsets = mx.array([0, 0], dtype=mx.int32)

    def update_and_fetch(self, layer, k, v):
        return k, v, "causal"
