"""Softmax attention for fp32 on the CPU backend, and its hook into mlx-lm models.

On the CPU backend mx.fast.scaled_dot_product_attention is not fused: it
materialises the whole [B, heads, L, T] score matrix and runs a softmax
whose `exp` manages only ~50-80 M elements/s here (an add on an array that
fits in cache runs at ~4 G/s; on a 40 MB array page faults cut that to
~0.3 G/s). Prefill (L > 1) therefore spends most of its attention time in
exp and in passes over memory. `_cpu_attention` computes the same
softmax in base 2 (log2(e) folded into the query scale), in query chunks
whose scores stay cache-sized, with 2**x from a degree-5 polynomial and an
exponent-bit add fused into one mx.compile'd kernel (~450 M/s; relative
error ~2e-7, i.e. fp32 rounding). Decode (L == 1) takes it too: its
softmax over every cached key is the same slow ``exp`` (at 8 rows x 1,024
keys, 30 layers: 29 ms against MLX's 59 ms). Other dtypes and backends keep
the fast path.

:func:`install` routes the attention of an mlx-lm model's modules here for
that case (mlx-lm's ``scaled_dot_product_attention`` is what every
architecture calls); everything else goes to mlx-lm's own function.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_cairn.backends.cpu import kernels as cpu_kernels

_LOG2E = math.log2(math.e)
#: Query rows per chunk are chosen so one chunk's scores hold about this many floats
#: (3 MB; measured 0.25-4 M here: 0.75 M was fastest, 2 M ~20% slower, 4 M ~45%).
_CHUNK_SCORES = 750_000
#: Score of a masked key: finite, as in MLX, so a fully masked row averages all keys.
_MASKED = float(np.finfo(np.float32).min)


_exp2_shifted = cpu_kernels.exp2_shifted
#: ``_exp2_shifted`` as one fused kernel per shape.
_exp2 = cpu_kernels.fused_exp2_shifted


def _cpu_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None
) -> mx.array:
    """Softmax attention in base 2, chunked over queries; same contract as the fast SDPA.

    q [B, H, L, D]; k, v [B, kvh, T, D] with H a multiple of kvh; mask None,
    "causal" (aligned to the bottom-right corner, as MLX does), a boolean
    array (True = attend) or an additive array, broadcastable to [B, H, L, T].
    """
    B, H, L, D = q.shape
    kvh, T = k.shape[1], k.shape[2]
    rep = H // kvh
    # [B, kvh, rep, L, D]: query heads grouped under the K/V head they share.
    q5 = (q * (scale * _LOG2E)).reshape(B, kvh, rep, L, D)
    kt = k.swapaxes(-1, -2)[:, :, None]  # [B, kvh, 1, D, T]
    v5 = v[:, :, None]  # [B, kvh, 1, T, D]
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unsupported attention mask {mask!r}")
    m5: mx.array | None = None
    if isinstance(mask, mx.array):
        m4 = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        if m4.shape[1] == 1:
            m5 = m4[:, :, None]
        else:
            m5 = mx.broadcast_to(m4, (m4.shape[0], H, *m4.shape[2:]))
            m5 = m5.reshape(m4.shape[0], kvh, rep, *m4.shape[2:])
        if m5.dtype != mx.bool_:
            m5 = m5.astype(mx.float32) * _LOG2E  # additive, now in base-2 units
    step = max(16, min(L, _CHUNK_SCORES // max(1, B * H * T)))
    outs: list[mx.array] = []
    for i0 in range(0, L, step):
        i1 = min(L, i0 + step)
        qc = q5[:, :, :, i0:i1]
        if outs:
            # Run the chunks one after another: evaluated side by side, their
            # score matrices would no longer fit in cache together.
            qc = mx.depends(qc, outs[-1])
        if causal:
            # Keys after this chunk's last query are all masked: skip them.
            end = T - L + i1
            s = qc @ kt[..., :end]
            seen = mx.arange(T - L + i0, end)[:, None] >= mx.arange(end)[None, :]
            s = mx.where(seen, s, _MASKED)
            vc = v5[:, :, :, :end]
        else:
            s = qc @ kt
            vc = v5
            if m5 is not None:
                mc = m5 if m5.shape[-2] == 1 else m5[..., i0:i1, :]
                s = mx.where(mc, s, _MASKED) if mc.dtype == mx.bool_ else s + mc
        p = _exp2(s, s.max(-1, keepdims=True))
        outs.append((p @ vc) / p.sum(-1, keepdims=True))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, D)


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None
) -> mx.array:
    """Scaled dot-product attention: the chunked base-2 path for fp32 on the CPU, else MLX's.

    ``k`` and ``v`` may be quantized (packed, scales, biases) triples from
    quantized KV pools (engine/paged_quant.py): mlx-lm's quantized attention
    then runs over them, its bits and group size read off the shapes.
    """
    if isinstance(k, tuple):
        return _quantized_attention(q, k, v, scale, mask)
    if _active and q.dtype == mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
        return _cpu_attention(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _quantized_attention(q: mx.array, k: Any, v: Any, scale: float, mask: Any) -> mx.array:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    d = q.shape[-1]
    bits = 32 * k[0].shape[-1] // d
    group_size = d // k[1].shape[-1]
    # q * scale, scale 1.0: mlx-lm scales with ``*=``, which would rebind the caller's array.
    return quantized_scaled_dot_product_attention(
        q * scale, k, v, scale=1.0, mask=mask, group_size=group_size, bits=bits
    )


#: Off inside :func:`disabled` (references that must run mlx-lm's own attention).
_active = True


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run mlx-lm's own attention and activations in patched modules for the duration of the block."""
    global _active
    before, _active = _active, False
    kernels_before, cpu_kernels.STATE["active"] = cpu_kernels.STATE["active"], False
    try:
        yield
    finally:
        _active = before
        cpu_kernels.STATE["active"] = kernels_before


def _cpu_case(q: mx.array, k: mx.array, v: mx.array, cache: Any, sinks: Any) -> bool:
    return (
        _active
        and sinks is None
        and not hasattr(cache, "bits")  # quantized K/V come as (packed, scales, biases)
        and q.dtype == mx.float32
        and k.dtype == mx.float32
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and mx.default_device().type == mx.DeviceType.cpu
    )


def _wrap(original: Any) -> Any:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if _cpu_case(queries, keys, values, cache, sinks):
            return _cpu_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._cairn_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install(model: nn.Module, prefix: str = "mlx_lm.models.") -> int:
    """Route fp32 CPU attention of ``model``'s architecture modules to this file.

    Patches the ``scaled_dot_product_attention`` name in each ``mlx_lm.models``
    module that defines one of ``model``'s classes (process-wide for those
    modules; other cases still run mlx-lm's function). ``CAIRN_CPU_ATTENTION=0``
    turns it off. Returns the number of modules patched. ``prefix``: the package
    whose modules are patched (``"mlx_vlm.models."`` for a vision model's language
    model, whose attention function has the same contract).
    """
    if os.environ.get("CAIRN_CPU_ATTENTION", "1").lower() in ("0", "off"):
        return 0
    patched = 0
    for name in sorted(cpu_kernels.model_modules(model)):
        mod = sys.modules.get(name)
        if mod is None or not name.startswith(prefix):
            continue
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is None or hasattr(fn, "_cairn_original"):
            continue
        mod.scaled_dot_product_attention = _wrap(fn)  # type: ignore[attr-defined]
        patched += 1
    return patched
