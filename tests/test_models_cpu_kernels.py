"""The fused fp32 CPU activations (backends/cpu/kernels.py) against float64 and mlx.nn."""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.backends.cpu import kernels as cpu_kernels
from mlx_cairn.testing.tiny_models import tiny_zoo_model

EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 88.0, -88.0, 104.0, -104.0, np.inf, -np.inf]


def _grid() -> np.ndarray:
    return np.concatenate([np.linspace(-60.0, 60.0, 240_001), EDGES]).astype(np.float32)


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    r = x.astype(np.float64)
    with np.errstate(all="ignore"):
        sig = np.where(r >= 0, 1.0 / (1.0 + np.exp(-r)), np.exp(r) / (1.0 + np.exp(r)))
        if name == "sigmoid":
            return sig
        if name == "silu":
            return r * sig
        z = 2.0 * math.sqrt(2.0 / math.pi) * (r + 0.044715 * r**3)
        # x * sigmoid(2z): the tanh form 0.5 x (1 + tanh z), free of its cancellation.
        return r * np.where(z >= 0, 1.0 / (1.0 + np.exp(-z)), np.exp(z) / (1.0 + np.exp(z)))


KERNELS = {
    "sigmoid": lambda a: mx.compile(cpu_kernels.sigmoid)(a),
    "silu": cpu_kernels.fast_silu,
    "gelu": cpu_kernels.fast_gelu_approx,
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels_match_float64_as_closely_as_fp32_allows(name):
    x = _grid()
    got = np.array(KERNELS[name](mx.array(x))).astype(np.float64)
    want = _reference(name, x)
    finite = np.isfinite(want)
    # Infinities where the function has them; no NaN from a finite input.
    assert np.array_equal(got[~finite], want[~finite], equal_nan=True)
    assert np.isfinite(got[finite]).all()
    # Relative error ~1e-6 where the value is a normal float and |x| < 30 (the fp32
    # rounding of x * log2(e) alone is 1e-6 there), and never more than 1e-6 absolute.
    ok = finite & (np.abs(want) > 1e-30) & (np.abs(x) < 30)
    rel = np.abs(got[ok] - want[ok]) / np.abs(want[ok])
    assert rel.max() < (2e-5 if name == "gelu" else 4e-6), rel.max()
    assert np.abs(got[finite] - want[finite]).max() < 2e-6


def test_nan_stays_nan():
    x = mx.array([np.nan, 1.0], dtype=mx.float32)
    for f in KERNELS.values():
        assert math.isnan(f(x)[0].item())


def test_swiglu_is_silu_times_x_and_other_dtypes_use_the_original():
    rng = np.random.default_rng(0)
    g = mx.array(rng.normal(size=(3, 40)).astype(np.float32) * 4)
    u = mx.array(rng.normal(size=(3, 40)).astype(np.float32))
    np.testing.assert_allclose(
        np.array(cpu_kernels.swiglu(g, u)), np.array(nn.silu(g) * u), rtol=1e-5, atol=1e-6
    )
    calls = []

    def original(a, b):
        calls.append(a.dtype)
        return nn.silu(a) * b

    h = cpu_kernels.swiglu(g.astype(mx.float16), u.astype(mx.float16), original)
    assert calls == [mx.float16] and h.dtype == mx.float16
    # Broadcasting shapes go to the original too (the kernel is traced per shape).
    cpu_kernels.swiglu(g, u[:1], original)
    assert calls == [mx.float16, mx.float32]


def test_install_routes_a_models_activations_and_disabled_restores_them():
    lm = tiny_zoo_model("gemma3_text", seed=1)  # its MLP calls nn.gelu_approx
    cpu_kernels.install(lm.model.inner)  # (as zoo.finish does for fp32 on the CPU)
    mod = sys.modules[type(lm.model.inner.layers[0].mlp).__module__]
    assert getattr(mod.nn, "_cairn_fast", False)
    assert mod.nn.Linear is nn.Linear and mod.nn.Module is nn.Module
    x = mx.array(np.linspace(-8, 8, 64, dtype=np.float32)).reshape(2, 32)
    assert not mx.array_equal(mod.nn.gelu_approx(x), nn.gelu_approx(x)).item()
    with cpu_attention.disabled():
        assert mx.array_equal(mod.nn.gelu_approx(x), nn.gelu_approx(x)).item()
    np.testing.assert_allclose(
        np.array(mod.nn.gelu_approx(x)), np.array(nn.gelu_approx(x)), rtol=1e-5, atol=1e-6
    )
    llama = tiny_zoo_model("llama", seed=1)
    cpu_kernels.install(llama.model.inner)
    mod = sys.modules[type(llama.model.inner.layers[0].mlp).__module__]
    assert hasattr(mod.swiglu, "_cairn_original")
    assert cpu_kernels.install(llama.model.inner) == 0  # (already installed: nothing twice)


def test_softmax_matches_mx_softmax_with_masked_and_extreme_logits():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5000)).astype(np.float32) * 8
    x[1, :4990] = -np.inf  # a grammar mask leaving ten tokens
    x[2, 7] = 1e4  # one overwhelming logit
    x[3] = 0.0  # uniform
    got = np.array(cpu_kernels.softmax(mx.array(x)))
    want = np.array(mx.softmax(mx.array(x), axis=-1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    assert (got[1, :4990] == 0).all() and got[2, 7] == 1.0
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    half = mx.array(x[:1]).astype(mx.float16)  # other dtypes: MLX's own
    assert mx.array_equal(cpu_kernels.softmax(half), mx.softmax(half, axis=-1)).item()


def test_a_shapeless_compiled_function_never_meets_the_kernels():
    # gpt_oss's SwigluOAI lives in mlx-lm's activations module, whose own compiled
    # (shapeless) swiglu calls nn.silu: that module keeps mlx.nn, and the compiled
    # function still runs at new shapes after the install (the kernels' view has no
    # shape rule; routing nn.silu there broke every later caller of swiglu).
    import mlx_lm.models.activations as activations

    lm = tiny_zoo_model("gpt_oss", seed=1)
    assert "mlx_lm.models.activations" in cpu_kernels.model_modules(lm.model.inner)
    cpu_kernels.install(lm.model.inner)
    assert activations.nn is nn
    assert not hasattr(activations.swiglu, "_cairn_original")
    for shape in ((2, 8), (3, 5), (1, 1, 7)):
        g = mx.ones(shape)
        mx.eval(activations.swiglu(g, g))
    assert "silu" in cpu_kernels._compiled_names(activations)
