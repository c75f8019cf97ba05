"""Loading mlx-lm architectures from folders (dense and MLX-quantized), and refusals by name."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import load
from mlx_cairn.models.export import save_folder
from mlx_cairn.models.zoo import ZooModel, model_classes
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_zoo_model
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams


def greedy_req(text: str, n: int = 8) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", text)], max_tokens=n, sampling=SamplingParams(temperature=0.0)
    )


def engine_tokens(lm, texts: list[str], n: int = 8) -> dict[str, list[int]]:
    out = {}
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=128, block_size=4))) as engine:
        streams = {t: engine.submit(greedy_req(t, n)) for t in texts}
        for t, s in streams.items():
            assert isinstance(list(s.iter_sync(timeout=120))[-1], Done)
            out[t] = s.output_ids
        ids = {t: engine.prepare(greedy_req(t, n)).prompt_ids for t in texts}
    return out, ids


TEXTS = ["Hi", "What is the capital of France? " * 3]


@pytest.mark.parametrize(
    "model_type", ["gemma3_text", "gemma3", "mistral3", "qwen3_moe", "deepseek_v3", "gpt_oss"]
)
def test_dense_folder_loads_through_mlx_lm_and_matches_it(tmp_path, monkeypatch, model_type):
    import sys

    from mlx_lm.utils import load_model

    from mlx_cairn.backends.cpu import attention as cpu_attention

    # Small query chunks, so the CPU prefill attention runs several per prompt.
    monkeypatch.setattr(cpu_attention, "_CHUNK_SCORES", 64)
    folder = save_folder(tiny_zoo_model(model_type, seed=2), tmp_path / model_type)
    lm = load(str(folder))
    assert isinstance(lm.model, ZooModel)
    # fp32 on CPU: the architecture's module runs prefill attention in cpu_attention
    # (the reference below runs mlx-lm's own, cpu_attention.disabled()).
    mods = {sys.modules[type(m).__module__] for m in lm.model.modules()}
    assert any(
        hasattr(getattr(m, "scaled_dot_product_attention", None), "_cairn_original") for m in mods
    )
    assert lm.model.model_type == model_type and lm.source_format == "hf"
    assert lm.identity.endswith(":float32")
    ref, _ = load_model(folder)  # mlx-lm's own loader on the same folder
    got, ids = engine_tokens(lm, TEXTS)
    for t in TEXTS:
        assert got[t] == mlx_lm_greedy(ref, ids[t], 8, lm.eos_token_ids)


def test_quantized_folder_dequantizes_on_cpu_or_stays_quantized(tmp_path):
    from mlx_lm.utils import load_model

    folder = save_folder(tiny_zoo_model("qwen3_moe", seed=3), tmp_path / "q", quantize=(32, 4))
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 4

    dense = load(str(folder))
    assert dense.source_format == "mlx-quantized"
    kinds = {type(m).__name__ for _, m in dense.model.named_modules()}
    assert not any(k.startswith("Quantized") for k in kinds), kinds
    assert dense.model.dtype == mx.float32

    kept = load(str(folder), keep_quantized=True)
    kinds = {type(m).__name__ for _, m in kept.model.named_modules()}
    assert "QuantizedSwitchLinear" in kinds and "QuantizedLinear" in kinds
    assert kept.identity.endswith("+q")

    # Kept quantized, the engine computes what mlx-lm computes on its own load of the folder.
    ref, _ = load_model(folder)
    got, ids = engine_tokens(kept, TEXTS)
    for t in TEXTS:
        assert got[t] == mlx_lm_greedy(ref, ids[t], 8, kept.eos_token_ids)
    # Dequantized, the logits are the quantized model's up to rounding.
    prompt = mx.array([ids[TEXTS[1]]], dtype=mx.int32)
    a = ref(prompt)[:, -1, :]
    b = dense.model.inner(prompt)[:, -1, :]
    assert mx.allclose(a, b, atol=1e-3, rtol=1e-3).item()


def test_per_layer_quantization_override_is_read(tmp_path):
    folder = save_folder(tiny_zoo_model("olmo2", seed=4), tmp_path / "q", quantize=(32, 4))
    config = json.loads((folder / "config.json").read_text())
    # Re-quantize one layer at 8 bits, the way mlx-lm's mixed recipes record it.
    from mlx_cairn.backends.cpu.layout import dense_parameters

    weights = mx.load(str(folder / "model.safetensors"))
    base = "model.layers.0.self_attn.q_proj"
    w = mx.dequantize(
        weights[f"{base}.weight"],
        weights[f"{base}.scales"],
        weights[f"{base}.biases"],
        group_size=32,
        bits=4,
    )
    q, s, b = mx.quantize(w, group_size=64, bits=8)
    weights.update({f"{base}.weight": q, f"{base}.scales": s, f"{base}.biases": b})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config["quantization"][base] = {"group_size": 64, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    kept = load(str(folder), keep_quantized=True)
    layer = dict(kept.model.named_modules())[base]
    assert (layer.bits, layer.group_size) == (8, 64)
    dense = load(str(folder))
    # Under their usual names whatever CPU layout the load picked (backends/cpu/layout.py).
    flat = dense_parameters(dense.model.inner)
    assert mx.allclose(flat[f"{base}.weight"], w, atol=0.05).item()


def test_unknown_model_type_is_refused_by_name(tmp_path):
    folder = save_folder(tiny_zoo_model("qwen3_moe", seed=0), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "frobnicator_v9"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'frobnicator_v9'.*Supported: .*attention"):
        load(str(folder))


def test_a_cache_kind_the_engine_lacks_is_refused_by_name():
    # Llama 4's chunked attention layers need mlx-lm's ChunkedKVCache.
    with pytest.raises(ModelLoadError, match=r"'llama4'.*ChunkedKVCache.*Supported"):
        model_classes({"model_type": "llama4"})


def test_logits_only_where_asked_equal_mlx_lm_full_logits():
    # The head runs on selected positions only, through mlx-lm's own Model.__call__.
    for model_type in ("granite", "gemma3_text", "qwen2"):
        lm = tiny_zoo_model(model_type, seed=5)
        zm = lm.model
        assert not zm.computes_logits_in_call
        x = mx.array([[5, 6, 7, 8, 9]], dtype=mx.int32)
        full = zm.inner(x)
        from mlx_cairn.models.cache import ContiguousKVCache

        h = zm(x, ContiguousKVCache(zm.num_layers))
        assert mx.allclose(zm.logits(h[:, 2, :]), full[:, 2, :], atol=1e-5).item(), model_type


class _Wrapper(nn.Module):
    """An architecture wrapping an mlx-lm model, its layers the inner model's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.body = inner

    @property
    def layers(self):
        return self.body.layers


def test_an_architecture_whose_call_is_not_head_of_backbone_runs_whole():
    class Odd(_Wrapper):
        def __call__(self, inputs, cache=None):
            return self.body(inputs, cache=cache) * 2.0

    lm = tiny_zoo_model("qwen3", seed=6)
    odd = Odd(lm.model.inner)
    zm = ZooModel(odd, lm.model.config)
    assert zm.computes_logits_in_call
    from mlx_cairn.models.cache import ContiguousKVCache

    x = mx.array([[5, 6, 7]], dtype=mx.int32)
    out = zm.logits(zm(x, ContiguousKVCache(zm.num_layers))[:, -1, :])
    assert mx.allclose(out, 2.0 * lm.model.inner(x)[:, -1, :], atol=1e-5).item()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3_text", "granite"])
def test_cpu_layout_keeps_the_tokens_and_exports_back(tmp_path, monkeypatch, model_type):
    from mlx_lm.utils import load_model

    from mlx_cairn.backends.cpu.layout import BlockedLinear, BlockedTiedEmbedding

    folder = save_folder(tiny_zoo_model(model_type, seed=8), tmp_path / "a")
    monkeypatch.setenv("CAIRN_CPU_LAYOUT", "1")  # force the blocked layout (measured by default)
    lm = load(str(folder))
    kinds = {type(m) for _, m in lm.model.named_modules()}
    assert BlockedLinear in kinds
    tied = bool(lm.model.config.get("tie_word_embeddings"))
    assert (BlockedTiedEmbedding in kinds) == tied
    ref, _ = load_model(folder)
    got, ids = engine_tokens(lm, TEXTS)
    for t in TEXTS:
        assert got[t] == mlx_lm_greedy(ref, ids[t], 8, lm.eos_token_ids)
    # Saved again, the folder has the usual names and loads in mlx-lm as it is.
    again = save_folder(lm, tmp_path / "b")
    ref2, _ = load_model(again)
    prompt = mx.array([ids[TEXTS[1]]], dtype=mx.int32)
    assert mx.allclose(ref(prompt), ref2(prompt), atol=1e-5).item()


def test_llama_family_folders_go_to_mlx_lm(tmp_path):
    from mlx_lm.utils import load_model

    from mlx_cairn.models.llama import LlamaModel

    plain = load(str(save_folder(tiny_zoo_model("qwen3", seed=9), tmp_path / "plain")))
    # HF folders no longer take the hand-written path (bench/RESULTS.md).
    assert not isinstance(plain.model, LlamaModel)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    folder = save_folder(tiny_zoo_model("llama", seed=9, rope_scaling=yarn), tmp_path / "yarn")
    lm = load(str(folder))
    assert isinstance(lm.model, ZooModel)
    ref, _ = load_model(folder)
    got, ids = engine_tokens(lm, TEXTS)
    for t in TEXTS:
        assert got[t] == mlx_lm_greedy(ref, ids[t], 8, lm.eos_token_ids)


def test_reference_loop_and_whole_call_architectures_through_the_engine():
    """engine/reference.py (``cairn generate``) runs mlx-lm's own caches; an architecture
    that computes logits inside __call__ serves through the engine unchanged."""
    from mlx_cairn.testing.engine_checks import greedy_reference

    lm = tiny_zoo_model("gemma3_text", seed=12)
    ids = lm.tokenizer.encode("What is the capital of France? " * 4)
    want = mlx_lm_greedy(lm.model.inner, ids, 8, lm.eos_token_ids)
    assert greedy_reference(lm, ids, 8) == want

    class Whole(_Wrapper):
        def make_cache(self):
            return self.body.make_cache()

        def __call__(self, inputs, cache=None):
            return self.body(inputs, cache=cache)

    import dataclasses

    whole = ZooModel(Whole(lm.model.inner), lm.model.config)
    assert whole.computes_logits_in_call
    got, prompt_ids = engine_tokens(dataclasses.replace(lm, model=whole), TEXTS)
    for t in TEXTS:
        assert got[t] == mlx_lm_greedy(lm.model.inner, prompt_ids[t], 8, lm.eos_token_ids)
