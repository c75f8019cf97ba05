"""Fast ``exp``-based elementwise kernels for fp32 on the CPU backend, and their hook into mlx-lm.

MLX's CPU ``exp`` (and so ``sigmoid``, ``tanh``, ``silu``, ``gelu_approx``)
runs at only ~50-80 M elements/s here. The gated MLPs of nearly every
architecture apply one of them to a [tokens, intermediate] array per layer:
for SmolLM2-135M that was ~30% of a 1,024-token prefill and ~6% of a decode
step at 8 rows (bench/RESULTS.md). This file computes ``2**y`` (``y <= 0``)
from a degree-5 polynomial and an exponent-bit add, fused with the rest of
the activation into one mx.compile'd kernel (~4x faster on [128, 1536];
relative error ~2e-7, i.e. fp32 rounding, where |x| < 30):

    sigmoid(x)     = 1 / (1 + e)  or  e / (1 + e),   e = 2**(-|x| log2 e)
    silu(x)        = x * sigmoid(x)
    gelu_approx(x) = x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x**3))   (= mlx.nn's tanh form)
    swiglu(g, x)   = silu(g) * x
    softmax(x)     = 2**(x log2 e - max) / sum    (the sampler's, over a whole vocabulary)

:func:`install` routes the ``swiglu`` of an mlx-lm model's modules, and the
``nn.silu`` / ``nn.gelu_approx`` they call, here for fp32 arrays on the CPU
(not in a module whose own compiled functions call them: a shapeless
compiled function cannot hold these kernels); everything else (other dtypes, devices, ``cpu_attention.disabled()``) runs
mlx-lm's and mlx.nn's own functions.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_LOG2E = math.log2(math.e)
_FIT_X = np.linspace(-1.0, 0.0, 20001)
#: 2**f on (-1, 0], least-squares degree 5 (max relative error ~2.4e-7).
EXP2_COEFFS = [float(c) for c in np.polyfit(_FIT_X, 2.0**_FIT_X, 5)]
#: sqrt(2/pi) doubled: gelu's tanh(z) is 2 sigmoid(2z) - 1.
_GELU_K = 2.0 * math.sqrt(2.0 / math.pi)


def exp2_nonpositive(y: mx.array) -> mx.array:
    """``2 ** y`` for ``y <= 0`` (``-inf`` gives 0), by polynomial and exponent bits."""
    n = y.astype(mx.int32)  # truncates toward zero, so f is in (-1, 0]
    f = y - n.astype(mx.float32)
    p = f * EXP2_COEFFS[0] + EXP2_COEFFS[1]
    for c in EXP2_COEFFS[2:]:
        p = p * f + c
    bits = p.view(mx.int32) + (n << 23)
    # Below 2**-126 the exponent add would leave the normal range: flush to 0.
    return mx.where(y <= -126.0, 0.0, bits.view(mx.float32))  # (NaN stays NaN)


def sigmoid(x: mx.array) -> mx.array:
    """The logistic function from :func:`exp2_nonpositive` (NaN stays NaN)."""
    e = exp2_nonpositive(mx.minimum(x, -x) * _LOG2E)  # exp(-|x|)
    r = 1.0 / (1.0 + e)
    return mx.where(x >= 0, r, e * r)


def _silu(x: mx.array) -> mx.array:
    return x * sigmoid(x)


def _gelu_approx(x: mx.array) -> mx.array:
    return x * sigmoid(_GELU_K * (x + 0.044715 * x * x * x))


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return _silu(gate) * x


class ShapedKernel:
    """``fn`` as one fused kernel (mx.compile builds it with the system C++ compiler).

    It cannot be shapeless (``view`` needs shapes), so each new combination
    of input shapes is traced once; the compiled wrapper is rebuilt after
    ``limit`` shapes to bound its cache. Where compiling fails (no compiler),
    the same ops run unfused: slower, same result.
    """

    def __init__(self, fn: Callable[..., mx.array], arity: int, limit: int = 256) -> None:
        self.fn = fn
        self.arity = arity
        self.limit = limit
        self._compiled: Callable[..., mx.array] | None = None
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()

    def __call__(self, *args: mx.array) -> mx.array:
        key = tuple(tuple(a.shape) for a in args)
        if self._compiled is None or (key not in self._shapes and len(self._shapes) >= self.limit):
            self._shapes.clear()
            fused = mx.compile(self.fn)
            try:
                probe = mx.zeros((1, 1, 1, 2, 3))
                mx.eval(fused(*[probe] * self.arity))
                self._compiled = fused
            except Exception:  # any JIT failure means "use the plain ops"
                self._compiled = self.fn
        self._shapes.add(key)
        return self._compiled(*args)


def exp2_shifted(s: mx.array, m: mx.array) -> mx.array:
    """``2 ** (s - m)`` for ``s <= m`` (``-inf`` gives 0)."""
    return exp2_nonpositive(s - m)


fused_exp2_shifted = ShapedKernel(exp2_shifted, 2)
fast_silu = ShapedKernel(_silu, 1)
fast_gelu_approx = ShapedKernel(_gelu_approx, 1)
fast_swiglu = ShapedKernel(_swiglu, 2)

#: Off inside ``cpu_attention.disabled()`` (references that must run mlx-lm's own code),
#: and with ``CAIRN_CPU_ACTIVATIONS=0``.
STATE = {"active": os.environ.get("CAIRN_CPU_ACTIVATIONS", "1").lower() not in ("0", "off")}


def _fp32_cpu(*xs: mx.array) -> bool:
    return (
        STATE["active"]
        and all(x.dtype == mx.float32 for x in xs)
        and mx.default_device().type == mx.DeviceType.cpu
    )


def swiglu(
    gate: mx.array, x: mx.array, original: Callable[..., mx.array] | None = None
) -> mx.array:
    """``silu(gate) * x``: the fused kernel for fp32 on the CPU, else ``original`` (mlx-lm's)."""
    if _fp32_cpu(gate, x) and gate.shape == x.shape:
        return fast_swiglu(gate, x)
    if original is None:
        return nn.silu(gate) * x
    return original(gate, x)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax`` with the fused ``exp`` for fp32 on the CPU (sampling over a vocabulary)."""
    if not _fp32_cpu(x):
        return mx.softmax(x, axis=axis)
    s = x * _LOG2E
    e = fused_exp2_shifted(s, s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def silu(x: mx.array) -> mx.array:
    return fast_silu(x) if _fp32_cpu(x) else nn.silu(x)


def gelu_approx(x: mx.array) -> mx.array:
    return fast_gelu_approx(x) if _fp32_cpu(x) else nn.gelu_approx(x)


class _NN(types.ModuleType):
    """``mlx.nn`` as an mlx-lm model module sees it: the same, except silu and gelu_approx."""

    def __init__(self) -> None:
        super().__init__("mlx.nn")
        self.silu = silu
        self.gelu_approx = gelu_approx
        self._cairn_fast = True

    def __getattr__(self, name: str) -> Any:
        return getattr(nn, name)


def _wrap_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def patched(gate: mx.array, x: mx.array) -> mx.array:
        return swiglu(gate, x, original)

    patched._cairn_original = original  # type: ignore[attr-defined]
    return patched


def model_modules(model: nn.Module) -> set[str]:
    """The names of the modules that define ``model``'s classes."""
    return {type(model).__module__} | {type(m).__module__ for m in model.modules()}


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _python_function(obj: Any) -> types.FunctionType | None:
    """The Python function an mx.compile'd callable wraps (it holds it as a GC referent)."""
    if type(obj).__name__ != "_gc_func":
        return None
    return next((r for r in gc.get_referents(obj) if isinstance(r, types.FunctionType)), None)


def _compiled_names(mod: types.ModuleType) -> set[str]:
    """Names the mx.compile'd functions defined in ``mod`` (or its classes) refer to.

    The fused kernels cannot run inside a shapeless compiled function (their
    ``view`` has no shape rule), so a name such a function calls is left alone.
    """
    objs = list(vars(mod).values())
    objs += [
        a
        for c in objs
        if isinstance(c, type) and c.__module__ == mod.__name__
        for a in vars(c).values()
    ]
    names: set[str] = set()
    for obj in objs:
        fn = _python_function(obj)
        if fn is not None and fn.__module__ == mod.__name__:
            names |= _code_names(fn.__code__)
    return names


def install(model: nn.Module) -> int:
    """Route the activations of ``model``'s ``mlx_lm.models`` modules to this file.

    Process-wide for those modules; other dtypes and devices still run the
    originals. ``CAIRN_CPU_ACTIVATIONS=0`` turns it off. Returns the number of
    modules patched.
    """
    if not STATE["active"]:
        return 0
    patched = 0
    for name in sorted(model_modules(model)):
        mod = sys.modules.get(name)
        if mod is None or not name.startswith("mlx_lm.models."):
            continue
        done = False
        compiled = _compiled_names(mod)
        fn = getattr(mod, "swiglu", None)
        own = (f := _python_function(fn)) is not None and f.__module__ == name  # (activations)
        if (
            fn is not None
            and not hasattr(fn, "_cairn_original")
            and not own
            and "swiglu" not in compiled
        ):
            mod.swiglu = _wrap_swiglu(fn)  # type: ignore[attr-defined]
            done = True
        if getattr(mod, "nn", None) is nn and not compiled & {"silu", "gelu_approx"}:
            mod.nn = _NN()  # type: ignore[attr-defined]
            done = True
        patched += done
    return patched
