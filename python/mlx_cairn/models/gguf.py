"""Load a GGUF file: every llama.cpp tensor type through the ``gguf`` package.

Two layers:

- :func:`read_gguf` turns any supported file (:data:`gguf_arch.ARCHS`: llama,
  qwen2, qwen3, qwen3moe, gemma3, phi3) into what a Hugging Face / mlx-lm
  model class takes: a ``config.json`` dict, weights under HF names, the
  tokenizer and chat template. It runs no model.
- :func:`load_gguf` hands that to mlx-lm's class for the ``model_type``
  (:func:`mlx_cairn.models.zoo.from_weights`), as HF folders load; GGUF
  llama files still run models/llama.py (:data:`LLAMA_PY_ARCHS`).

Tensors, by GGUF type and backend::

    type                      CPU (dequantize)               GPU (keep quantized)
    Q4_0 Q4_1 Q8_0            repacked to MLX affine, then   the affine triple itself
                              mx.dequantize (exact)          (lossless, as mx.load did)
    every other quantized     gguf.quants.dequantize         mx.quantize of that, bits and
    type (K-quants, IQ, ...)                                 group from REQUANT
    F32 F16 BF16              float                          float

The affine repacking is exact: those three formats *are* affine per 32
values (``x = d*q + m``), and ``d*q`` is exact in fp32, so the result equals
``gguf.quants.dequantize`` bit for bit (``tests/test_gguf_quants.py``).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mlx_cairn.chat.builtin_templates import CHATML
from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_header
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import gguf_arch, hf, zoo
from mlx_cairn.models.gguf_check import GGUFHeader, TensorInfo, read_header
from mlx_cairn.models.loaded import LoadedModel, assemble
from mlx_cairn.models.weights import dtype_name, resolve_dtype, weights_identity
from mlx_cairn.models.zoo import ZooModel

Q = GGMLQuantizationType
_FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})
#: Formats that are MLX affine quantization already: type -> bits (group size 32).
EXACT_AFFINE = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
#: GPU re-quantization of the other types: (bits, group size), about the GGUF size.
#: Group 64 matches the bits per weight of the 256-value K-quant super-blocks
#: (Q4_K 4.5 bpw -> 4-bit/64 4.5 bpw); below 2 bits MLX has nothing smaller.
REQUANT: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.Q5_0: (5, 32),
    Q.Q5_1: (5, 32),
    Q.Q2_K: (2, 32),
    Q.Q3_K: (3, 64),
    Q.Q4_K: (4, 64),
    Q.Q5_K: (5, 64),
    Q.Q6_K: (6, 64),
    Q.IQ1_S: (2, 64),
    Q.IQ1_M: (2, 64),
    Q.IQ2_XXS: (2, 32),
    Q.IQ2_XS: (2, 32),
    Q.IQ2_S: (2, 32),
    Q.IQ3_XXS: (3, 64),
    Q.IQ3_S: (3, 64),
    Q.IQ4_NL: (4, 32),
    Q.IQ4_XS: (4, 64),
    Q.TQ1_0: (2, 64),
    Q.TQ2_0: (2, 64),
    Q.MXFP4: (4, 32),
}
_DEFAULT_REQUANT = (8, 32)
#: Tensors decoded ahead of the one being converted (bounds the extra memory).
_AHEAD = 8


@dataclass
class GGUFContents:
    """A GGUF file in Hugging Face terms (what ``read_gguf`` returns).

    ``weights`` hold dense arrays, or for a quantized module the MLX affine
    triple ``<m>.weight`` (uint32) / ``<m>.scales`` / ``<m>.biases`` with
    ``quantization[<m>] = (group_size, bits)``; ``config["quantization"]``
    says the same in mlx-lm's format.
    """

    arch: str
    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: set[int]
    header: GGUFHeader
    quantization: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Llama 3.1 long-context RoPE: llama.cpp's per-frequency divisors (``rope_freqs.weight``).
    rope_freqs: mx.array | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        return self.header.metadata


def raw_blocks(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes shaped ``[*rows, bytes_per_row]`` (what ``gguf.quants`` takes)."""
    block, size = GGML_QUANT_SIZES[info.ggml_type]
    raw = data[info.offset : info.offset + info.nbytes]
    return raw.reshape(*info.shape[:-1], info.shape[-1] // block * size)


def dequantize(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The tensor as float32 numpy, by ``gguf.quants.dequantize``."""
    try:
        out = gguf.quants.dequantize(raw_blocks(data, info), info.ggml_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"GGUF tensor {info.name} has type {info.ggml_type.name}, which the gguf package "
            "cannot dequantize"
        ) from None
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def affine_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, ...]:
    """Q4_0 / Q4_1 / Q8_0 blocks as MLX affine arrays (packed uint32, scales, biases; fp16).

    A block holds 32 values ``x = d*q + m`` (Q4_0: ``m = -8d``, Q8_0: ``m = -128d``
    with ``q`` taken unsigned). GGUF 4-bit blocks keep values 0-15 in the low
    nibbles and 16-31 in the high ones; MLX packs value ``i`` at bits
    ``4*(i % 8)`` of word ``i // 8``, i.e. two consecutive values per byte::

        GGUF byte j = v[j] | v[j+16] << 4       MLX byte j = v[2j] | v[2j+1] << 4
    """
    rows = raw.shape[:-1]
    _, size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(-1, size)
    d = b[:, 0:2].copy().view(np.float16)
    if qtype == Q.Q8_0:
        # int8 q + 128 as a byte is q's two's-complement byte with the sign bit flipped.
        packed = b[:, 2:] ^ np.uint8(0x80)
        biases = d * np.float16(-128)
    else:
        qs = b[:, 4:] if qtype == Q.Q4_1 else b[:, 2:]
        # Byte pairs as little-endian u16 (even | odd << 8): half the elements per pass.
        u = np.ascontiguousarray(qs).view(np.uint16)
        packed = np.empty((b.shape[0], 16), dtype=np.uint8)
        packed[:, :8] = (u & 0x0F) | ((u >> 4) & 0xF0)  # values 0-15: the low nibbles
        packed[:, 8:] = ((u >> 4) & 0x0F) | ((u >> 8) & 0xF0)  # values 16-31: the high ones
        biases = b[:, 2:4].copy().view(np.float16) if qtype == Q.Q4_1 else d * np.float16(-8)
    packed = np.ascontiguousarray(packed).reshape(*rows, -1).view(np.uint32)
    return packed, d.reshape(*rows, -1), biases.reshape(*rows, -1)


def _triple(
    w: mx.array, scales: mx.array, biases: mx.array, dtype: mx.Dtype
) -> dict[str, mx.array]:
    return {"weight": w, "scales": scales.astype(dtype), "biases": biases.astype(dtype)}


def _numpy_stage(data: np.ndarray, info: TensorInfo) -> tuple[np.ndarray, ...]:
    """The numpy part of decoding (run on worker threads): affine blocks or float32 values."""
    if info.ggml_type in EXACT_AFFINE and len(info.shape) >= 2:
        return affine_blocks(raw_blocks(data, info), info.ggml_type)
    return (dequantize(data, info),)


def _mlx_stage(
    info: TensorInfo, parts: tuple[np.ndarray, ...], *, keep_quantized: bool, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], tuple[int, int] | None]:
    qtype = info.ggml_type
    quantized = qtype not in _FLOAT_TYPES and len(info.shape) >= 2
    if len(parts) == 3:
        bits = EXACT_AFFINE[qtype]
        packed, scales, biases = (mx.array(a) for a in parts)
        if keep_quantized:
            return _triple(packed, scales, biases, dtype), (32, bits)
        # fp32 scales: d*q is exact there, so this equals gguf.quants.dequantize.
        w = mx.dequantize(
            packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits
        )
        return {"weight": w.astype(dtype)}, None
    w = mx.array(parts[0])
    if quantized and keep_quantized:
        bits, group = REQUANT.get(qtype, _DEFAULT_REQUANT)
        if info.shape[-1] % group:
            group = 32
        wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        return _triple(wq, scales, biases, dtype), (group, bits)
    return {"weight": w.astype(dtype)}, None


def decode_tensor(
    data: np.ndarray, info: TensorInfo, *, keep_quantized: bool, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], tuple[int, int] | None]:
    """One tensor as ``{"weight": w}`` (dense ``dtype``) or an affine triple with (group, bits)."""
    return _mlx_stage(info, _numpy_stage(data, info), keep_quantized=keep_quantized, dtype=dtype)


def _decoded(
    data: np.ndarray, infos: list[TensorInfo], *, keep_quantized: bool, dtype: mx.Dtype
) -> Iterator[tuple[TensorInfo, dict[str, mx.array], tuple[int, int] | None]]:
    """Decode ``infos`` in order: numpy work on a few threads (it releases the GIL), at most
    :data:`_AHEAD` tensors ahead of the MLX conversion, which stays on this thread."""
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="gguf") as pool:
        pending: deque[tuple[TensorInfo, Future[tuple[np.ndarray, ...]]]] = deque()
        queue = iter(infos)
        for info in queue:
            pending.append((info, pool.submit(_numpy_stage, data, info)))
            if len(pending) >= _AHEAD:
                break
        while pending:
            info, fut = pending.popleft()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_numpy_stage, data, nxt)))
            arrays, q = _mlx_stage(info, fut.result(), keep_quantized=keep_quantized, dtype=dtype)
            yield info, arrays, q


def read_gguf(
    path: Path,
    *,
    keep_quantized: bool = False,
    dtype: mx.Dtype = mx.float32,
    qk_order: str = "hf",
    header: GGUFHeader | None = None,
) -> GGUFContents:
    """Read ``path`` into HF-named weights, config, tokenizer and template.

    ``keep_quantized``: quantized tensors as MLX affine triples (the GPU path)
    instead of dense ``dtype`` arrays. ``qk_order``: "hf" gives Llama Q/K in
    HF's split-half RoPE order; "gguf" keeps llama.cpp's interleaved rows and
    sets ``config["rope_traditional"]`` (same model, fewer copies).
    """
    if qk_order not in ("hf", "gguf"):
        raise ValueError(f"qk_order must be 'hf' or 'gguf', not {qk_order!r}")
    header = header or read_header(path)
    meta = header.metadata
    arch, spec = gguf_arch.arch_spec(meta)
    by_name = {t.name: t for t in header.tensors}
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def small(name: str) -> np.ndarray | None:
        info = by_name.get(name)
        return None if info is None else dequantize(data, info)

    config = gguf_arch.config_from_gguf(meta, by_name, small, qk_order=qk_order)
    names = gguf_arch.hf_name_map(arch, config["num_hidden_layers"])
    weights: dict[str, mx.array] = {}
    quantization: dict[str, tuple[int, int]] = {}
    modules = [t for t in header.tensors if not gguf_arch.NOT_MODULES.fullmatch(t.name)]
    hf_names = {t.name: gguf_arch.hf_name(names, t.name) for t in modules}  # fail before work
    for info, arrays, q in _decoded(data, modules, keep_quantized=keep_quantized, dtype=dtype):
        hf = hf_names[info.name]
        base, parts = gguf_arch.to_hf(spec, config, hf, arrays, qk_order=qk_order)
        for k, v in parts.items():
            weights[f"{base}.{k}"] = v
        if q is not None:
            quantization[base] = q
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError("GGUF file has no token_embd.weight")
    if quantization:
        common = max(set(quantization.values()), key=list(quantization.values()).count)
        config["quantization"] = {
            "group_size": common[0],
            "bits": common[1],
            **{m: {"group_size": g, "bits": b} for m, (g, b) in quantization.items()},
        }
    mx.eval(weights)
    rope_freqs = small("rope_freqs.weight")
    template = meta.get("tokenizer.chat_template")
    eos = {
        int(meta[f"tokenizer.ggml.{k}"])
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if meta.get(f"tokenizer.ggml.{k}") is not None
    }
    return GGUFContents(
        arch=arch,
        config=config,
        weights=weights,
        tokenizer=tokenizer_from_header(meta),
        chat_template=template if isinstance(template, str) else None,
        eos_token_ids=eos,
        header=header,
        quantization=quantization,
        rope_freqs=None if rope_freqs is None else mx.array(rope_freqs),
    )


class FreqsRoPE(nn.Module):
    """RoPE with explicit per-pair periods: llama.cpp's ``rope_freqs.weight`` (Llama 3.1
    long context) divides each frequency, which no ``rope_scaling`` entry spells exactly.
    Called as mlx-lm's attention calls its rope: ``rope(x, offset=...)``."""

    def __init__(self, dims: int, freqs: mx.array) -> None:
        super().__init__()
        self.dims = dims
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _install_rope_freqs(model: ZooModel, config: dict[str, Any], divisors: mx.array) -> None:
    d = int(config["head_dim"])
    freqs = float(config["rope_theta"]) ** (mx.arange(0, d, 2, dtype=mx.float32) / d) * divisors
    layers = getattr(model.inner, "layers", None) or []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or "rope" not in attn:
            raise ModelLoadError(
                f"GGUF rope_freqs.weight has no place in {config['model_type']}'s attention"
            )
        attn.rope = FreqsRoPE(d, freqs)


#: GGUF architectures that still run the hand-written models/llama.py: its 2,000-token
#: prefill measured 7-9% faster than mlx-lm's llama over the same cache on the default
#: model (decode was slower; bench/RESULTS.md, "GGUF through the zoo").
LLAMA_PY_ARCHS = frozenset({"llama"})


def _llama_py_runs(arch: str, config: dict[str, Any]) -> bool:
    rs = config.get("rope_scaling") or {}
    return arch in LLAMA_PY_ARCHS and rs.get("rope_type", rs.get("type")) in (None, "linear")


def _llama_py_model(contents: GGUFContents) -> Any:
    """models/llama.py over llama.cpp's interleaved Q/K rows as they are (rope_traditional)."""
    from mlx_cairn.models.llama import LlamaModel, ModelArgs
    from mlx_cairn.models.weights import install_weights

    config = dict(contents.config)
    config.pop("quantization", None)
    args = ModelArgs.from_config(config)
    model = LlamaModel(args)
    install_weights(
        model, contents.weights, contents.quantization.get if contents.quantization else None
    )
    if contents.rope_freqs is not None:
        # Llama 3.1 GGUFs store the long-context scaling as per-frequency divisors.
        d = args.head_dim or 0
        freqs = args.rope_theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d) * contents.rope_freqs
        for layer in model.model.layers:
            layer.self_attn.rope.set_freqs(freqs)
        args.extra["rope_freqs_from_gguf"] = True
    return model


def load_gguf(
    path: Path, *, dtype: str = "auto", keep_quantized: bool | None = None
) -> LoadedModel:
    """Load a ``.gguf`` file into mlx-lm's class for its architecture (models/zoo.py), or
    for :data:`LLAMA_PY_ARCHS` into models/llama.py.

    Every architecture :func:`read_gguf` maps (:data:`gguf_arch.ARCHS`) loads;
    anything else, or anything unreadable, is a :class:`ModelLoadError`.
    """
    header = read_header(path)
    arch, _ = gguf_arch.arch_spec(header.metadata)  # an unsupported architecture is named first
    # GGUF norms are F32: "auto" computes in fp32 (dequantized on CPU, quantized on GPU).
    compute, dequant = resolve_dtype(dtype, mx.float32)
    if keep_quantized is not None:
        dequant = not keep_quantized
    order = "gguf" if arch in LLAMA_PY_ARCHS else "hf"
    contents = read_gguf(
        path, keep_quantized=not dequant, dtype=compute, qk_order=order, header=header
    )
    config = contents.config
    model: Any
    if order == "gguf" and not _llama_py_runs(arch, config):
        # A RoPE scaling llama.py lacks: mlx-lm's llama, Q/K rows back in HF's order.
        contents = read_gguf(path, keep_quantized=not dequant, dtype=compute, header=header)
        config = contents.config
    if _llama_py_runs(arch, config):
        model = _llama_py_model(contents)
    else:
        model = zoo.from_weights(config, contents.weights, compute=compute, dequant=dequant)
        if contents.rope_freqs is not None:
            _install_rope_freqs(model, config, contents.rope_freqs)
    tag = dtype_name(compute) + ("+q" if contents.quantization and not dequant else "")
    name = path.name.removesuffix(".gguf")
    return assemble(
        name=name,
        model=model,
        tokenizer=contents.tokenizer,
        template_source=contents.chat_template or CHATML,
        eos_token_ids=contents.eos_token_ids,
        context_length=hf.context_length(config),
        identity=f"{name}@{weights_identity([path], tag)}:{tag}",
        path=str(path),
        source_format="gguf",
    )


__all__ = ["GGUFContents", "decode_tensor", "dequantize", "load_gguf", "read_gguf"]
