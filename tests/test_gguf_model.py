"""GGUF files -> Hugging Face config and names, checked through mlx-lm's own model classes.

A tiny random mlx-lm model of each family is written as llama.cpp would write
it (names from gguf-py's tables, Llama Q/K permuted, Gemma norms stored as
1 + w, MoE experts stacked), read back by ``read_gguf``, and loaded strictly
into a fresh model of the same class: no missing or extra keys, same logits.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from gguf_fixtures import Q, gguf_arch_enum, permute_qk, tokenizer_meta, write_gguf
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import gguf_arch
from mlx_cairn.models.gguf import read_gguf

mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm builds the reference models")

VOCAB = 259  # byte-level alphabet + 3 control tokens (gguf_fixtures.tokenizer_meta)

#: GGUF arch -> (mlx-lm model_type, tiny config, extra GGUF metadata).
FAMILIES = {
    "llama": ("llama", {"rope_theta": 10000.0}, {}),
    "qwen2": ("qwen2", {"rope_theta": 1e6}, {}),
    "qwen3": ("qwen3", {"rope_theta": 1e6, "head_dim": 16}, {}),
    "qwen3moe": (
        "qwen3_moe",
        {
            "rope_theta": 1e6,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 24},
    ),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,  # one full-attention layer in six
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "rope_global_base_freq": 1e6,
            "rope_local_base_freq": 10000.0,
        },
        {"attention.sliding_window": 8},
    ),
    "phi3": ("phi3", {"rope_theta": 10000.0, "original_max_position_embeddings": 256}, {}),
}


def _tiny_config(arch: str) -> dict:
    model_type, extra, _ = FAMILIES[arch]
    cfg = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch in ("gemma3", "qwen3"),
    }
    cfg.update(extra)
    return cfg


def _mlx_lm_model(cfg: dict) -> nn.Module:
    from mlx_cairn.models import zoo

    model_cls, args_cls = zoo.model_classes(cfg)
    mx.random.seed(3)
    model = model_cls(args_cls.from_dict(cfg))
    # Random norms too (they start at 1 or 0), so a missed shift or a swapped norm shows.
    params = [
        (
            k,
            mx.random.normal(v.shape) * 0.2
            + (k.endswith("norm.weight") and not cfg["model_type"].startswith("gemma")),
        )
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(params)
    if cfg["tie_word_embeddings"] and "lm_head" in model:  # gemma3_text keeps a copy
        model.lm_head.weight = model.model.embed_tokens.weight
    mx.eval(model.parameters())
    return model


def _write_like_llama_cpp(path, arch: str, cfg: dict, model: nn.Module, qtype=None):
    """HF/mlx-lm weights -> GGUF the way convert_hf_to_gguf.py does, for these families."""
    tmap = gguf.get_tensor_name_map(gguf_arch_enum(arch), cfg["num_hidden_layers"])
    spec = gguf_arch.ARCHS[arch]
    tensors = {}
    for k, v in tree_flatten(model.parameters()):
        if k == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue  # llama.cpp writes no output tensor for tied embeddings
        w = np.array(v, dtype=np.float32)
        base, suffix = k.rsplit(".", 1)
        base = base.replace(".mlp.switch_mlp.", ".mlp.experts.")  # mlx-lm stacks; llama.cpp too
        if spec.permuted_qk and base.endswith("self_attn.q_proj"):
            w = permute_qk(w, cfg["num_attention_heads"])
        elif spec.permuted_qk and base.endswith("self_attn.k_proj"):
            w = permute_qk(w, cfg["num_key_value_heads"])
        if spec.norm_shift and base.endswith("norm"):
            w = w + spec.norm_shift
        name = tmap.get_name(base)
        assert name is not None, base
        quant = qtype if (qtype is not None and w.ndim >= 2 and w.shape[-1] % 32 == 0) else None
        tensors[f"{name}.{suffix}"] = (w, quant)
    p = f"{arch}."
    meta = {
        p + "block_count": cfg["num_hidden_layers"],
        p + "embedding_length": cfg["hidden_size"],
        p + "feed_forward_length": cfg["intermediate_size"],
        p + "attention.head_count": cfg["num_attention_heads"],
        p + "attention.head_count_kv": cfg["num_key_value_heads"],
        p + "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        p + "rope.freq_base": cfg.get("rope_theta", cfg.get("rope_global_base_freq", 10000.0)),
        p + "context_length": cfg["max_position_embeddings"],
        **{p + k: v for k, v in FAMILIES[arch][2].items()},
        **tokenizer_meta(),
    }
    if "head_dim" in cfg:
        meta[p + "attention.key_length"] = cfg["head_dim"]
        meta[p + "attention.value_length"] = cfg["head_dim"]
    return write_gguf(path, arch, meta, tensors)


def _logits(model: nn.Module) -> np.ndarray:
    return np.array(model(mx.array([[5, 17, 250, 3, 99, 42]])).astype(mx.float32))


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_gguf_round_trip_through_mlx_lm_classes(tmp_path, arch):
    from mlx_cairn.models import zoo

    cfg = _tiny_config(arch)
    original = _mlx_lm_model(cfg)
    path = _write_like_llama_cpp(tmp_path / f"{arch}.gguf", arch, cfg, original)
    contents = read_gguf(path)
    assert contents.config["model_type"] == cfg["model_type"]
    assert "rope_traditional" not in contents.config  # HF split-half order by default
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert contents.config[key] == cfg[key], key
    assert contents.config["tie_word_embeddings"] == cfg["tie_word_embeddings"]
    assert all(v.dtype == mx.float32 for v in contents.weights.values())
    if arch == "qwen3moe":  # experts stay stacked, as mlx-lm holds them
        assert contents.weights["model.layers.1.mlp.switch_mlp.down_proj.weight"].shape[0] == 4
    # Strict load: build_model raises on any missing or unexpected key.
    back = zoo.build_model(contents.config, dict(contents.weights))
    np.testing.assert_allclose(_logits(back), _logits(original), rtol=1e-4, atol=1e-4)


def test_llama_gguf_order_keeps_interleaved_rows_and_says_so(tmp_path):
    from mlx_cairn.models import zoo

    cfg = _tiny_config("llama")
    original = _mlx_lm_model(cfg)
    path = _write_like_llama_cpp(tmp_path / "l.gguf", "llama", cfg, original)
    hf = read_gguf(path)
    kept = read_gguf(path, qk_order="gguf")
    assert kept.config["rope_traditional"] is True
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(
        np.array(kept.weights[q]), permute_qk(np.array(hf.weights[q]), cfg["num_attention_heads"])
    )
    back = zoo.build_model(kept.config, dict(kept.weights))  # mlx-lm's llama reads rope_traditional
    np.testing.assert_allclose(_logits(back), _logits(original), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe"])
def test_quantized_gguf_round_trip(tmp_path, arch):
    """K-quant / Q8_0 tensors: dense on CPU equals gguf's dequantization of the same file."""
    from mlx_cairn.models import zoo
    from mlx_cairn.models.gguf import dequantize
    from mlx_cairn.models.gguf_check import read_header

    cfg = _tiny_config(arch)
    original = _mlx_lm_model(cfg)
    path = _write_like_llama_cpp(tmp_path / "q.gguf", arch, cfg, original, qtype=Q.Q8_0)
    contents = read_gguf(path)
    header = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    embd = next(t for t in header.tensors if t.name == "token_embd.weight")
    assert embd.ggml_type == Q.Q8_0
    np.testing.assert_array_equal(
        np.array(contents.weights["model.embed_tokens.weight"]), dequantize(data, embd)
    )
    back = zoo.build_model(contents.config, dict(contents.weights))
    got, want = _logits(back), _logits(original)
    assert np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)  # 8-bit noise only
    # The GPU path: affine triples and mlx-lm's quantization config for them.
    kept = read_gguf(path, keep_quantized=True)
    assert kept.config["quantization"]["bits"] == 8
    assert kept.weights["model.embed_tokens.weight"].dtype == mx.uint32
    qback = zoo.build_model(kept.config, dict(kept.weights))
    np.testing.assert_allclose(_logits(qback), _logits(back), rtol=1e-3, atol=1e-3)


EXPECTED_NAMES = {
    "llama": {
        "blk.0.ffn_norm": "model.layers.0.post_attention_layernorm",
        "blk.1.attn_output": "model.layers.1.self_attn.o_proj",
        "output": "lm_head",
        "token_embd": "model.embed_tokens",
    },
    "qwen3": {"blk.0.attn_q_norm": "model.layers.0.self_attn.q_norm"},
    "qwen3moe": {
        "blk.0.ffn_gate_inp": "model.layers.0.mlp.gate",
        "blk.0.ffn_up_exps": "model.layers.0.mlp.experts.up_proj",
    },
    "gemma3": {
        "blk.0.attn_norm": "model.layers.0.input_layernorm",
        "blk.0.post_attention_norm": "model.layers.0.post_attention_layernorm",
        "blk.0.ffn_norm": "model.layers.0.pre_feedforward_layernorm",
        "blk.0.post_ffw_norm": "model.layers.0.post_feedforward_layernorm",
    },
    "phi3": {
        "blk.0.attn_qkv": "model.layers.0.self_attn.qkv_proj",
        "blk.0.ffn_up": "model.layers.0.mlp.gate_up_proj",
        "blk.0.ffn_norm": "model.layers.0.post_attention_layernorm",
    },
}


@pytest.mark.parametrize("arch", list(EXPECTED_NAMES))
def test_name_map_from_gguf_tables(arch):
    names = gguf_arch.hf_name_map(arch, 2)
    for g, hf in EXPECTED_NAMES[arch].items():
        assert names[g] == hf, g
    assert len(set(names.values())) == len(names)  # one HF module per GGUF tensor


def test_unknown_tensor_and_architecture_are_named(tmp_path):
    cfg = _tiny_config("llama")
    model = _mlx_lm_model(cfg)
    path = _write_like_llama_cpp(tmp_path / "a.gguf", "llama", cfg, model)
    import gguf_fixtures

    header_meta = {"llama.block_count": 1, **tokenizer_meta()}
    odd = gguf_fixtures.write_gguf(
        tmp_path / "odd.gguf",
        "llama",
        header_meta,
        {"blk.0.mystery.weight": (np.zeros((4, 32), np.float32), None)},
    )
    with pytest.raises(ModelLoadError, match=r"lacks llama\.embedding_length"):
        read_gguf(odd)
    assert read_gguf(path).arch == "llama"
    mamba = gguf_fixtures.write_gguf(tmp_path / "m.gguf", "mamba", {}, {})
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'mamba'"):
        read_gguf(mamba)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.mystery\.weight has no Hugging Face name"):
        gguf_arch.hf_name(gguf_arch.hf_name_map("llama", 1), "blk.0.mystery.weight")
