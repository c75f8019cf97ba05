"""Writing small GGUF files in-process with gguf-py's own GGUFWriter, the way llama.cpp would."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType

Q = GGMLQuantizationType

#: Types gguf-py can quantize (the rest it only dequantizes).
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16, Q.F16, Q.F32)
#: Dequantize-only types (K-quants, IQ, ...) and the byte offsets of their fp16 scale
#: fields, which random blocks get sane values in (IQ1_M spreads its scale over
#: several nibbles: it keeps whatever the random bytes say).
DEQUANT_ONLY: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ1_M: (),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,),
    Q.TQ2_0: (64,),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random raw blocks ``[rows, bytes_per_row]`` of ``qtype`` (scales in 1e-3..1e-2)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    n = rows * (cols // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in DEQUANT_ONLY.get(qtype, ()):
        d = rng.uniform(1e-3, 1e-2, size=n).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def gguf_arch_enum(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)


def _add(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, np.ndarray) and value.dtype == np.int32:
        w.add_key_value(key, value.tolist(), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    elif isinstance(value, np.ndarray):
        w.add_key_value(key, value.tolist(), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    else:
        w.add_array(key, list(value))


def write_gguf(
    path: Path,
    arch: str,
    meta: Mapping[str, Any],
    tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType | None]],
) -> Path:
    """Write ``tensors`` (name -> (float array, type to quantize to) or (raw blocks, type)).

    A float32 array with a quantizable type is quantized by ``gguf.quants``; a
    uint8 array is taken as raw blocks of that type.
    """
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        _add(w, k, v)
    for name, (arr, qtype) in tensors.items():
        if qtype is None or qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qtype)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_vocab(extra: list[str]) -> tuple[list[str], list[int]]:
    """A 256-token byte-level (GPT-2 alphabet) vocabulary plus control tokens ``extra``."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + extra
    return tokens, [1] * 256 + [3] * len(extra)


def tokenizer_meta(extra: list[str] | None = None) -> dict[str, Any]:
    tokens, types = byte_level_vocab(extra or ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF split-half RoPE rows -> llama.cpp's interleaved rows (convert_hf_to_gguf's permute)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
