"""GGUF tensor types: what the loader makes of each equals gguf-py's dequantization.

Files are written in-process with GGUFWriter: float weights quantized by
``gguf.quants.quantize`` for the types it can quantize, random (valid) raw
blocks for the types it can only dequantize. K-quants are also checked
against the block formulas of ggml's ``dequantize_row_q*_K`` on hand-made
blocks, so a wrong dequantizer in gguf-py would show too.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

from gguf_fixtures import DEQUANT_ONLY, QUANTIZABLE, Q, random_blocks, write_gguf
from mlx_cairn.models import gguf as G
from mlx_cairn.models.gguf_check import read_header

ROWS, COLS = 8, 512


def _file(tmp_path, tensors):
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, tensors)
    header = read_header(path)
    return header, np.memmap(path, dtype=np.uint8, mode="r")


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {}
    for qtype in QUANTIZABLE:
        tensors[f"{qtype.name}.weight"] = (
            rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32),
            qtype,
        )
    for i, qtype in enumerate(DEQUANT_ONLY):
        tensors[f"{qtype.name}.weight"] = (random_blocks(qtype, ROWS, COLS, seed=i), qtype)
    return _file(tmp_path_factory.mktemp("q"), tensors)


ALL_TYPES = [*QUANTIZABLE, *DEQUANT_ONLY]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dense_decode_equals_gguf_dequantize(typed_file, qtype):
    header, data = typed_file
    info = next(t for t in header.tensors if t.name == f"{qtype.name}.weight")
    assert info.ggml_type == qtype and info.shape == (ROWS, COLS)
    want = gguf.quants.dequantize(G.raw_blocks(data, info), qtype).astype(np.float32)
    arrays, quant = G.decode_tensor(data, info, keep_quantized=False, dtype=mx.float32)
    assert quant is None and set(arrays) == {"weight"}
    got = np.array(arrays["weight"])
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    # Bit for bit, the exact-affine types included (NaNs from random IQ1_M scales compare equal).
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want).mean() > 0.5


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_exact_affine_types_match_mlx_own_reader(typed_file, tmp_path, qtype):
    header, data = typed_file
    info = next(t for t in header.tensors if t.name == f"{qtype.name}.weight")
    packed, scales, biases = G.affine_blocks(G.raw_blocks(data, info), qtype)
    # mx.load reads exactly these three formats into MLX's affine triple: the oracle.
    raw = G.raw_blocks(data, info)
    write_gguf(tmp_path / "one.gguf", "llama", {}, {"w.weight": (raw, qtype)})
    ref = mx.load(str(tmp_path / "one.gguf"))
    np.testing.assert_array_equal(packed, np.array(ref["w.weight"]))
    np.testing.assert_array_equal(scales, np.array(ref["w.scales"]))
    np.testing.assert_array_equal(biases, np.array(ref["w.biases"]))
    kept, quant = G.decode_tensor(data, info, keep_quantized=True, dtype=mx.float32)
    assert quant == (32, G.EXACT_AFFINE[qtype])
    # Lossless on the GPU path too.
    dense = mx.dequantize(
        kept["weight"], kept["scales"], kept["biases"], group_size=32, bits=quant[1]
    )
    want = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(np.array(dense), want)


@pytest.mark.parametrize(
    "qtype",
    [t for t in ALL_TYPES if t not in (Q.F32, Q.F16, Q.BF16, Q.IQ1_M)],
    ids=lambda t: t.name,
)
def test_gpu_path_requantizes_close_to_the_gguf_values(typed_file, qtype):
    header, data = typed_file
    info = next(t for t in header.tensors if t.name == f"{qtype.name}.weight")
    kept, quant = G.decode_tensor(data, info, keep_quantized=True, dtype=mx.float16)
    assert quant is not None and kept["weight"].dtype == mx.uint32
    assert kept["scales"].dtype == mx.float16
    group, bits = quant
    assert (bits, group) == G.REQUANT.get(qtype, (G.EXACT_AFFINE.get(qtype), 32))
    want = gguf.quants.dequantize(G.raw_blocks(data, info), qtype)
    got = np.array(
        mx.dequantize(kept["weight"], kept["scales"], kept["biases"], group_size=group, bits=bits)
    )
    # Affine re-quantization is off by at most one step of the group's range (MLX
    # rounds its scale and zero point to fp16, so not quite half a step).
    span = np.ptp(want.reshape(ROWS, -1, group), axis=-1, keepdims=True)
    err = np.abs(got - want).reshape(ROWS, -1, group)
    assert np.all(err <= span / (2**bits - 1) + 1e-3 * np.abs(want).max())
    assert err.mean() < (span / (2**bits - 1)).mean() / 2


def test_float_tensors_stay_dense_on_the_gpu_path(typed_file):
    header, data = typed_file
    for qtype in (Q.F32, Q.F16, Q.BF16):
        info = next(t for t in header.tensors if t.name == f"{qtype.name}.weight")
        kept, quant = G.decode_tensor(data, info, keep_quantized=True, dtype=mx.float32)
        assert quant is None and set(kept) == {"weight"}


def test_a_type_gguf_cannot_dequantize_is_named(tmp_path):
    raw = np.zeros((2, 2 * 40), dtype=np.uint8)  # Q8_1: gguf-py has no dequantizer for it
    header, data = _file(tmp_path, {"x.weight": (raw, Q.Q8_1)})
    from mlx_cairn.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"x\.weight has type Q8_1"):
        G.decode_tensor(data, header.tensors[0], keep_quantized=False, dtype=mx.float32)


# --- K-quant block formulas (ggml-quants.c dequantize_row_q*_K), one block of 256 -------


def _f16(b: np.ndarray, off: int) -> np.float32:
    return np.float32(b[off : off + 2].copy().view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def _ref_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    y = []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        q = qs[32 * j : 32 * j + 32].astype(np.float32)
        y += list(d * s1 * (q.astype(np.uint8) & 0xF) - dmin * m1)
        y += list(d * s2 * (q.astype(np.uint8) >> 4) - dmin * m2)
    return np.array(y, dtype=np.float32)


def _ref_q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, qh, ql = _f16(b, 0), _f16(b, 2), b[4:16], b[16:48], b[48:176]
    y = []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        q = ql[32 * j : 32 * j + 32]
        lo = (q & 0xF) + np.where(qh & (1 << (2 * j)), 16, 0)
        hi = (q >> 4) + np.where(qh & (2 << (2 * j)), 16, 0)
        y += list(d * s1 * lo.astype(np.float32) - dmin * m1)
        y += list(d * s2 * hi.astype(np.float32) - dmin * m2)
    return np.array(y, dtype=np.float32)


def _ref_q6_k(b: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        L, H, S = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for l in range(32):  # noqa: E741  (ggml's name)
            i = l // 16
            q1 = ((int(L[l]) & 0xF) | ((int(H[l]) >> 0 & 3) << 4)) - 32
            q2 = ((int(L[l + 32]) & 0xF) | ((int(H[l]) >> 2 & 3) << 4)) - 32
            q3 = ((int(L[l]) >> 4) | ((int(H[l]) >> 4 & 3) << 4)) - 32
            q4 = ((int(L[l + 32]) >> 4) | ((int(H[l]) >> 6 & 3) << 4)) - 32
            base = 128 * n
            y[base + l] = d * S[i] * q1
            y[base + l + 32] = d * S[i + 2] * q2
            y[base + l + 64] = d * S[i + 4] * q3
            y[base + l + 96] = d * S[i + 6] * q4
    return y


def _ref_q2_k(b: np.ndarray) -> np.ndarray:
    sc, qs, d, dmin = b[0:16], b[16:80], _f16(b, 80), _f16(b, 82)
    y, i = [], 0
    for n in range(2):
        q = qs[32 * n : 32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (q[:16], q[16:]):
                s = int(sc[i])
                i += 1
                y += list(
                    d * (s & 0xF) * ((half >> shift) & 3).astype(np.float32) - dmin * (s >> 4)
                )
    return np.array(y, dtype=np.float32)


# Q3_K is the one K-quant left to gguf-py alone: its 6-bit scales are packed across
# three 4-byte masks and re-deriving them here would mostly test this file.
# IQ* and TQ* have no formula here either: they decode through lookup grids (ggml-common.h's
# iq2xxs_grid and friends) that only gguf-py carries, so a re-derivation would be a copy of
# it, not a check; test_dense_decode_equals_gguf_dequantize covers what the loader does with them.
K_REFERENCES = {Q.Q2_K: _ref_q2_k, Q.Q4_K: _ref_q4_k, Q.Q5_K: _ref_q5_k, Q.Q6_K: _ref_q6_k}


@pytest.mark.parametrize("qtype", list(K_REFERENCES), ids=lambda t: t.name)
def test_k_quant_blocks_match_the_ggml_formula(tmp_path, qtype):
    raw = random_blocks(qtype, 3, 256 * 2, seed=11)
    header, data = _file(tmp_path, {"k.weight": (raw, qtype)})
    got = np.array(
        G.decode_tensor(data, header.tensors[0], keep_quantized=False, dtype=mx.float32)[0][
            "weight"
        ]
    )
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    ref = np.stack([K_REFERENCES[qtype](blk) for blk in raw.reshape(-1, size)]).reshape(3, 512)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert np.abs(ref).max() > 0
