"""Loading tiny models back from HF folders, MLX-quantized folders and GGUF files."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_cairn.errors import ModelLoadError, ModelNotFound
from mlx_cairn.models import ContiguousKVCache, load
from mlx_cairn.models.export import save_folder
from mlx_cairn.models.llama import RoPE
from mlx_cairn.testing.tiny_models import tiny_model
from models_fixtures import write_tiny_gguf

IDS = [1, 40, 7, 99, 250, 3, 17]
ARCHS = ["llama", "qwen2", "qwen3"]


def _blocked(lm) -> bool:
    from mlx_cairn.backends.cpu.layout import BlockedLinear

    return any(isinstance(m, BlockedLinear) for _, m in lm.model.named_modules())


def _same(a: np.ndarray, b: np.ndarray) -> None:
    # Loaded fp32 models on CPU run the blocked layout (models.cpu_layout): equal up to rounding.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _logits(lm, ids=IDS) -> np.ndarray:
    cache = ContiguousKVCache(lm.model.num_layers)
    return np.array(lm.model.logits(lm.model(mx.array([ids]), cache))[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_round_trip(tmp_path, arch):
    lm = tiny_model(arch, seed=3)
    save_folder(lm, tmp_path / arch)
    back = load(str(tmp_path / arch))
    _same(_logits(back), _logits(lm))
    assert back.source_format == "hf"
    assert back.eos_token_ids == lm.eos_token_ids
    assert back.parser_family == lm.parser_family
    assert back.reasoning == lm.reasoning
    assert back.context_length == 2048
    assert back.template.source == lm.template.source
    text = "Hello <|im_start|>world 😀"
    assert back.tokenizer.encode(text) == lm.tokenizer.encode(text)
    assert back.identity == load(str(tmp_path / arch)).identity


def test_sharded_folder_with_index(tmp_path):
    lm = tiny_model("llama", seed=4)
    folder = save_folder(lm, tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for name, ks in shards.items():
        mx.save_safetensors(str(folder / name), {k: weights[k] for k in ks})
        weight_map.update(dict.fromkeys(ks, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _same(_logits(load(str(folder))), _logits(lm))


def _fake_quantized(lm, group_size: int, bits: int) -> np.ndarray:
    """Reference logits: every matrix replaced by dequantize(quantize(w))."""
    params = []
    for k, v in tree_flatten(lm.model.parameters()):
        if k.endswith(".weight") and v.ndim == 2 and "norm" not in k:
            v = mx.dequantize(
                *mx.quantize(v, group_size=group_size, bits=bits), group_size=group_size, bits=bits
            )
        params.append((k, v))
    lm.model.load_weights(params)
    return _logits(lm)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_quantized_folder(tmp_path, arch, bits):
    lm = tiny_model(arch, seed=5)
    save_folder(lm, tmp_path / "q", quantize=(32, bits))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits}

    dense = load(str(tmp_path / "q"))  # CPU: dequantized at load
    assert dense.source_format == "mlx-quantized"
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dense.model.named_modules())
    want = _fake_quantized(lm, 32, bits)
    np.testing.assert_allclose(_logits(dense), want, rtol=1e-4, atol=1e-4)

    kept = load(str(tmp_path / "q"), keep_quantized=True)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in kept.model.named_modules())
    np.testing.assert_allclose(_logits(kept), want, rtol=1e-3, atol=1e-3)
    assert kept.identity != dense.identity


def test_gguf_round_trip_with_interleaved_rope(tmp_path):
    lm = tiny_model("llama", seed=6)
    path = write_tiny_gguf(lm, tmp_path / "tiny.gguf")
    back = load(str(path))
    assert back.source_format == "gguf"
    assert back.model.args.rope_traditional
    np.testing.assert_allclose(_logits(back), _logits(lm), rtol=1e-5, atol=1e-5)
    for text in [
        "The capital of France is Paris.",
        "<|im_start|>user\nhéllo 日本語 😀<|im_end|>",
        "  x\n\n12345",
    ]:
        assert back.tokenizer.encode(text) == lm.tokenizer.encode(text)
        assert back.tokenizer.decode(back.tokenizer.encode(text)) == lm.tokenizer.decode(
            lm.tokenizer.encode(text)
        )
    assert back.tokenizer.token_to_id("<|im_end|>") in back.eos_token_ids
    with pytest.raises(ValueError, match="RoPE factors"):
        save_folder(back, tmp_path / "hf")


def test_gguf_export_restores_split_half_rope(tmp_path):
    lm = tiny_model("llama", seed=7)
    lm.model.args.rope_scaling = None
    for layer in lm.model.model.layers:
        layer.self_attn.rope = RoPE(lm.model.args)
    back = load(str(write_tiny_gguf(lm, tmp_path / "tiny.gguf")))
    np.testing.assert_allclose(_logits(back), _logits(lm), rtol=1e-5, atol=1e-5)
    save_folder(back, tmp_path / "hf")
    again = load(str(tmp_path / "hf"))
    assert back.model.args.rope_traditional and not again.model.args.rope_traditional
    np.testing.assert_allclose(_logits(again), _logits(lm), rtol=1e-5, atol=1e-5)


def test_errors_are_clear(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load(str(tmp_path / "empty"))
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="neither"):
        load(str(tmp_path / "x.bin"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        load(str(tmp_path / "bad.gguf"))

    folder = save_folder(tiny_model("llama"), tmp_path / "m")
    with pytest.raises(ModelLoadError, match="dtype"):
        load(str(folder), dtype="float64")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama4"}))
    with pytest.raises(
        ModelLoadError, match=r"unsupported model architecture 'llama4'.*ChunkedKVCache"
    ):
        load(str(folder))
    (folder / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    )
    with pytest.raises(ModelLoadError, match="gptq"):
        load(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="does not match"):
        load(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load(str(folder))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    mx.save_gguf(
        str(path), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "mamba"}
    )
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'mamba'") as e:
        load(str(path))
    assert "gemma3" in str(e.value) and "qwen3moe" in str(e.value)  # says what loads


def test_eos_ids_are_merged_from_every_source(tmp_path):
    lm = tiny_model("qwen3")
    folder = save_folder(lm, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    back = load(str(folder))
    assert back.eos_token_ids == {5, 6, 7, lm.tokenizer.eos_token_id}


def test_detection_can_be_overridden(tmp_path):
    from mlx_cairn.chat import ReasoningInfo

    folder = save_folder(tiny_model("qwen3"), tmp_path / "m")
    assert load(str(folder)).parser_family == "hermes"
    lm = load(str(folder), parser_family="qwen3_coder", reasoning=ReasoningInfo())
    assert lm.parser_family == "qwen3_coder" and not lm.reasoning.supported
    assert load(str(folder), parser_family=None).parser_family is None
    with pytest.raises(ModelLoadError, match="parser family"):
        load(str(folder), parser_family="xml")


def test_cpu_layout_is_applied_on_load_and_can_be_disabled(tmp_path, monkeypatch):
    lm = tiny_model("llama", seed=9)
    folder = save_folder(lm, tmp_path / "m")
    monkeypatch.setenv("CAIRN_CPU_LAYOUT", "1")
    blocked = load(str(folder))
    assert _blocked(blocked)
    _same(_logits(blocked), _logits(lm))
    monkeypatch.setenv("CAIRN_CPU_LAYOUT", "auto")  # measured: either layout, same logits
    _same(_logits(load(str(folder))), _logits(lm))
    monkeypatch.setenv("CAIRN_CPU_LAYOUT", "0")
    plain = load(str(folder))
    assert not _blocked(plain)
    # mlx-lm's llama class runs the folder (models/zoo.py): equal up to rounding.
    _same(_logits(plain), _logits(lm))


def test_mlx_quantized_folder_with_per_layer_overrides(tmp_path):
    """mlx-community configs may keep some layers dense or use other bits for them."""
    lm = tiny_model("qwen3", seed=8)
    folder = save_folder(lm, tmp_path / "q", quantize=(32, 4))
    dense = save_folder(lm, tmp_path / "d")
    weights = mx.load(str(folder / "model.safetensors"))
    dense_w = mx.load(str(dense / "model.safetensors"))
    keep = "model.layers.1.mlp.down_proj"
    eight = "model.layers.0.self_attn.q_proj"
    for suffix in ("scales", "biases"):
        del weights[f"{keep}.{suffix}"]
    weights[f"{keep}.weight"] = dense_w[f"{keep}.weight"]
    wq, s, b = mx.quantize(dense_w[f"{eight}.weight"], group_size=64, bits=8)
    weights.update({f"{eight}.weight": wq, f"{eight}.scales": s, f"{eight}.biases": b})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"].update({keep: False, eight: {"group_size": 64, "bits": 8}})
    (folder / "config.json").write_text(json.dumps(config))

    ref = dict(tree_flatten(lm.model.parameters()))
    params = []
    for k, v in ref.items():
        base = k.removesuffix(".weight")
        if k.endswith(".weight") and v.ndim == 2 and "norm" not in k and base != keep:
            gs, bits = (64, 8) if base == eight else (32, 4)
            v = mx.dequantize(*mx.quantize(v, group_size=gs, bits=bits), group_size=gs, bits=bits)
        params.append((k, v))
    lm.model.load_weights(params)
    want = _logits(lm)
    np.testing.assert_allclose(_logits(load(str(folder))), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        _logits(load(str(folder), keep_quantized=True)), want, rtol=1e-3, atol=1e-3
    )


def test_context_length_of_a_wrapper_is_its_language_models():
    from mlx_cairn.models.hf import DEFAULT_CONTEXT, context_length

    wrapped = {"max_position_embeddings": 2048, "text_config": {"max_position_embeddings": 262144}}
    assert context_length(wrapped) == 262144
    assert context_length({"text_config": {}, "seq_length": 8192}) == 8192
    assert context_length({"max_position_embeddings": 32768}) == 32768
    assert context_length({}) == DEFAULT_CONTEXT
