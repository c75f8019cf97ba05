"""Putting a checkpoint's arrays into a model: dtype choice, (de)quantization, identity.

Quantized linear/embedding weights travel as three arrays (MLX affine
format, also what ``mx.load`` returns for GGUF Q4_0/Q4_1/Q8_0)::

    <name>.weight  uint32 [out, in * bits / 32]   packed values
    <name>.scales  [out, in / group_size]
    <name>.biases  [out, in / group_size]
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_cairn.backends.cpu import layout as cpu_layout
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.llama import LlamaModel

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

#: Per-layer quantization settings: layer path -> (group_size, bits), or None to keep dense.
QuantSpec = Callable[[str], "tuple[int, int] | None"]


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def resolve_dtype(dtype: str, checkpoint: mx.Dtype | None) -> tuple[mx.Dtype, bool]:
    """The compute dtype and whether quantized weights are dequantized.

    ``auto``: fp32 with dequantized weights on the CPU backend (bf16/fp16 do
    not use BLAS there); the checkpoint dtype with quantized weights kept on
    GPU backends. An explicit dtype is honoured; quantized weights are then
    dequantized only on CPU.
    """
    if dtype == "auto":
        if on_cpu():
            return mx.float32, True
        return checkpoint or mx.float16, False
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype], on_cpu()


def infer_bits(packed: mx.array, scales: mx.array, group_size: int) -> int:
    """Bits per value of a packed affine-quantized matrix."""
    in_features = scales.shape[-1] * group_size
    return packed.shape[-1] * 32 // in_features


def dequantize_all(
    weights: dict[str, mx.array], spec: QuantSpec, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Replace every ``x.weight``/``x.scales``/``x.biases`` triple by a dense ``x.weight``."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".scales")]:
        base = key[: -len(".scales")]
        gs_bits = spec(base)
        if gs_bits is None:
            raise ModelLoadError(f"{base} is quantized but the config gives no quantization for it")
        group_size, bits = gs_bits
        w = out[f"{base}.weight"]
        # Scales in the compute dtype: the product is formed at full precision.
        scales = out.pop(key).astype(dtype)
        biases = out.pop(f"{base}.biases").astype(dtype)
        out[f"{base}.weight"] = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return out


def cast_floats(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Cast floating-point arrays (not packed weights or quantization scales) to ``dtype``."""
    out = {}
    for k, v in weights.items():
        quant_param = (
            k.endswith((".scales", ".biases")) and k.rsplit(".", 1)[0] + ".scales" in weights
        )
        if mx.issubdtype(v.dtype, mx.floating) and not quant_param:
            v = v.astype(dtype)
        out[k] = v
    return out


def install_weights(
    model: LlamaModel, weights: dict[str, mx.array], spec: QuantSpec | None
) -> None:
    """Quantize the modules that arrive quantized, then load ``weights`` strictly."""
    weights = model.sanitize(weights)
    if spec is not None:

        def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
            if f"{path}.scales" not in weights:
                return False
            gs_bits = spec(path)
            if gs_bits is None:
                return False
            return {"group_size": gs_bits[0], "bits": gs_bits[1]}

        nn.quantize(model, class_predicate=predicate)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"checkpoint does not match the architecture: {e}") from None
    mx.eval(model.parameters())
    if spec is None and on_cpu():
        cpu_layout.apply_cpu_layout(model)


def weights_identity(files: Iterable[Path], extra: str) -> str:
    """A stable digest of checkpoint files (names, sizes, first and last MiB) and ``extra``."""
    h = hashlib.sha256(extra.encode())
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def dtype_name(dtype: mx.Dtype) -> str:
    return next((n for n, d in _DTYPES.items() if d == dtype), str(dtype))
