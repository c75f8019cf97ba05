"""The embedded default model through the gguf-package reader: same weights, same tokens.

The reference is the loader this replaced: MLX's own GGUF reader (``mx.load``)
plus ``mx.dequantize``, still available to compare against. The greedy
tokens were recorded with that loader before the change.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.backends.cpu.layout import hf_parameters
from mlx_cairn.engine.reference import generate_tokens
from mlx_cairn.models.gguf_check import read_header
from mlx_cairn.models.loader import default_model_path
from mlx_cairn.types import ChatRequest, Message, SamplingParams

pytestmark = pytest.mark.slow

#: Greedy tokens of the default model, recorded with the mx.load loader (commit 2b64afc).
RECORDED = {
    "What is the capital of France?": [504, 3575, 282, 4649, 314, 7042, 30, 2],
    "Write a haiku about the sea.": [
        504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282, 260,
        10393, 28, 198, 49, 13151, 282, 260, 6122, 338, 5721, 8823, 28, 198, 49, 13151, 282, 260,
        5065, 506, 1149, 30, 2,
    ],
    "List three prime numbers and explain why.": [
        4590, 359, 1296, 9552, 2966, 42, 216, 34, 28, 216, 35, 28, 284, 216, 37, 30, 198, 198, 504,
        808, 9552, 1230, 314, 216, 34, 28, 527, 314, 260, 805, 908, 9552, 1230, 30, 378, 1796,
        9552, 1230, 314, 216,
    ],
}  # fmt: skip

_RENAME = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _old_loader_weights() -> dict[str, np.ndarray]:
    """What the mx.load loader installed: MLX's reader, fp32 scales, mx.dequantize."""
    raw, _ = mx.load(str(default_model_path()), return_metadata=True)
    out = {}
    for k, v in raw.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k.removesuffix(".weight")
        if f"{base}.scales" in raw:
            s, b = raw[f"{base}.scales"], raw[f"{base}.biases"]
            bits = v.shape[-1] * 32 // (s.shape[-1] * 32)
            v = mx.dequantize(
                v, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits
            )
        if k.startswith("blk."):
            _, i, kind, _ = k.split(".")
            name = f"model.layers.{i}.{_RENAME[kind]}.weight"
        else:
            name = {
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
            }[k]
        out[name] = np.array(v.astype(mx.float32))
    return out


def test_weights_equal_the_mx_load_loader_bit_for_bit(default_model):
    new = {k: np.array(v) for k, v in hf_parameters(default_model.model).items()}
    old = _old_loader_weights()
    assert set(new) == set(old)
    for k in old:
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)


@pytest.mark.parametrize("text", list(RECORDED))
def test_greedy_tokens_are_the_recorded_ones(default_model, text):
    lm = default_model
    prompt = lm.prompt(ChatRequest(messages=[Message("user", text)]))
    ids = list(
        generate_tokens(
            lm.model,
            prompt.ids,
            max_tokens=40,
            sampling=SamplingParams(temperature=0.0),
            eos_token_ids=lm.eos_token_ids,
        )
    )
    assert ids == RECORDED[text]


def test_header_reader_agrees_with_gguf_reader():
    """Our one-pass header walk against gguf-py's GGUFReader (slow: ~3 s on this file)."""
    path = default_model_path()
    ours = read_header(path)
    ref = gguf.GGUFReader(str(path))
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert set(ours.metadata) == set(ref.fields) - skip
    for key, field in ref.fields.items():
        if key in skip:
            continue
        want = field.contents()
        got = ours.metadata[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.ggml_type, a.offset, a.nbytes) == (
            b.name,
            b.tensor_type,
            int(b.data_offset),
            int(b.n_bytes),
        )
        assert a.shape == tuple(int(d) for d in reversed(b.shape))


def test_gpu_branch_keeps_the_blocks_quantized_and_answers_the_same():
    """keep_quantized (the GPU default) on CPU: MLX affine modules straight from the Q4_1 blocks."""
    import mlx.nn as nn

    from mlx_cairn.models import load

    lm = load(keep_quantized=True)
    quantized = [
        n
        for n, m in lm.model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]
    assert len(quantized) == 30 * 7 + 1  # every projection and the (Q8_0) embedding
    assert lm.identity.endswith(":float32+q")
    text = "What is the capital of France?"
    prompt = lm.prompt(ChatRequest(messages=[Message("user", text)]))
    ids = generate_tokens(
        lm.model,
        prompt.ids,
        max_tokens=40,
        sampling=SamplingParams(temperature=0.0),
        eos_token_ids=lm.eos_token_ids,
    )
    assert list(ids) == RECORDED[text]


@pytest.mark.parametrize("qk_order", ["hf", "gguf"])
def test_mlx_lm_llama_on_the_read_weights_answers_the_same(default_model, qk_order):
    """read_gguf's output as mlx-lm's llama takes it, in either Q/K row order."""
    pytest.importorskip("mlx_lm", reason="mlx-lm provides the reference llama class")
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_cairn.models import zoo
    from mlx_cairn.models.gguf import read_gguf

    contents = read_gguf(default_model_path(), qk_order=qk_order)
    model = zoo.build_model(contents.config, dict(contents.weights))
    text = "What is the capital of France?"
    ids = default_model.prompt(ChatRequest(messages=[Message("user", text)])).ids
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out: list[int] = []
    while len(out) < len(RECORDED[text]):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([out[-1:]]), cache=cache)
    assert out == RECORDED[text]
