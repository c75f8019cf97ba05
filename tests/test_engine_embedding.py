"""The embedding engine and loader: chunked batches equal inputs alone, the round-robin
plan, the queue cap, cancellation, bidirectional decoders, and refused folders."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.engine.embedder import EmbeddingEngine
from mlx_cairn.errors import InvalidRequest, ModelLoadError, QueueFull
from mlx_cairn.models import load
from mlx_cairn.models.embedding import EmbeddingModel, load_embedding_model
from mlx_cairn.testing.tiny_embed import save_tiny_embedding
from mlx_cairn.types import ChatRequest, Message

pytestmark = pytest.mark.timeout(300)

WORDS = ["Hello", "world", "Paris", "ünïcode", "x + y", "tool_call", "0123", "!"]
EXAMPLES = min(25, int(os.environ.get("CAIRN_HYPOTHESIS_EXAMPLES", "100")))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EmbeddingModel]:
    root = tmp_path_factory.mktemp("embed-engine")
    return {
        f: load_embedding_model(save_tiny_embedding(f, root / f, seed=7)) for f in ("bert", "qwen3")
    }


@pytest.fixture
def held(models: dict[str, EmbeddingModel]) -> Iterator[EmbeddingEngine]:
    """A bert engine (two rows, 64 padded tokens a forward) whose worker waits while the
    test holds its lock: what the test submits meanwhile stays queued."""
    engine = EmbeddingEngine(models["bert"], max_queue=2, max_batch_rows=2, max_batch_tokens=64)
    yield engine
    engine.close()


def _alone(model: EmbeddingModel, seqs: list[list[int]]) -> np.ndarray:
    return np.concatenate([model.embed([s]) for s in seqs])


@settings(max_examples=EXAMPLES)
@given(
    family=st.sampled_from(["bert", "qwen3"]),
    texts=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join),
        min_size=1,
        max_size=9,
    ),
    rows=st.integers(1, 4),
    tokens=st.integers(1, 80),
)
def test_any_chunking_gives_each_input_its_own_vector(
    models: dict[str, EmbeddingModel], family: str, texts: list[str], rows: int, tokens: int
) -> None:
    model = models[family]
    seqs = model.tokenize(texts, truncate=False)
    with EmbeddingEngine(model, max_batch_rows=rows, max_batch_tokens=tokens) as engine:
        got = engine.embed_sync(seqs, timeout=60)
        st_ = engine.stats()
    want = _alone(model, seqs)
    assert got.shape == want.shape
    assert np.min(np.sum(got * want, axis=1)) >= 0.9999
    assert st_.requests_completed == 1 and st_.prefill_tokens == sum(map(len, seqs))


def test_forwards_take_requests_in_turn(held: EmbeddingEngine) -> None:
    model = held.loaded
    big = model.tokenize(["Hello world " * 4, "Paris", "Hello world", "x"], truncate=False)
    small = model.tokenize(["tool_call"], truncate=False)
    with held._lock:
        a = held.submit(big)
        b = held.submit(small)
        first = held._take()
    # Longest of the first request, then the second request's one: two rows fit.
    assert [(j.seqs[i], len(j.seqs)) for j, i in first] == [(big[0], 4), (small[0], 1)]
    held._store(first, model.embed([j.seqs[i] for j, i in first]))
    assert b.result(60).vectors.shape == (1, model.dimensions)
    vecs = a.result(60).vectors
    assert np.min(np.sum(vecs * _alone(model, big), axis=1)) >= 0.9999


def test_queue_cap_and_cancel(held: EmbeddingEngine) -> None:
    seqs = held.loaded.tokenize(["Hello", "world"], truncate=False)
    with held._lock:
        first = held.submit(seqs)
        second = held.submit(seqs)
        with pytest.raises(QueueFull):
            held.submit(seqs)
        second.cancel()
        assert held.stats().queue_depth == 1
    assert first.result(60).vectors.shape == (2, held.loaded.dimensions)
    st_ = held.stats()
    assert (st_.queue_depth, st_.running, st_.requests_cancelled) == (0, 0, 1)
    assert st_.requests_completed == 1
    assert held.submit([]).result(1).vectors.shape == (0, held.loaded.dimensions)


def test_chat_requests_are_refused(held: EmbeddingEngine) -> None:
    req = ChatRequest([Message("user", "hi")], max_tokens=4)
    for call in (held.prepare, held.count_tokens):
        with pytest.raises(InvalidRequest, match="is an embedding model"):
            call(req)
    assert held.stats().requests_total == 0


def test_bidirectional_decoder(tmp_path: Path, models: dict[str, EmbeddingModel]) -> None:
    """``is_causal: false`` (gte-Qwen2 style): every token sees the whole input, padding aside."""
    folder = save_tiny_embedding("qwen3", tmp_path / "bi", seed=7, is_causal=False)
    bi = load(str(folder))
    assert isinstance(bi, EmbeddingModel) and bi.bidirectional
    seqs = bi.tokenize(["Hello world! How are you today?", "Paris"], truncate=False)
    got = bi.embed(seqs)

    class Whole:  # mlx-lm's cache seam: no mask at all, nothing stored
        offset = 0

        def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
            return k, v

        def make_mask(self, n: int, **kw: Any) -> None:
            return None

    with cpu_attention.disabled():
        for s, v in zip(seqs, got, strict=True):
            h = np.array(bi.model(mx.array([s]), cache=[Whole()] * len(bi.model.layers))[0, -1])
            assert float(v @ (h / np.linalg.norm(h))) >= 0.999
    causal = models["qwen3"].embed(seqs)  # same weights (seed 7), causal attention
    assert float(np.sum(causal[0] * got[0])) < 0.99


def test_refused_folders(tmp_path: Path) -> None:
    dense = save_tiny_embedding("bert", tmp_path / "dense")
    modules = json.loads(
        (save_tiny_embedding("xlm_roberta", tmp_path / "st") / "modules.json").read_text()
    )
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        load(str(dense))
    nomic = tmp_path / "nomic"
    shutil.copytree(tmp_path / "st", nomic)
    config = json.loads((nomic / "config.json").read_text()) | {"model_type": "nomic_bert"}
    (nomic / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not implemented by mlx-embeddings"):
        load(str(nomic))


def test_mlx_quantized_decoder(tmp_path: Path, models: dict[str, EmbeddingModel]) -> None:
    """An mlx-community style checkpoint (affine 8-bit, ``quantization`` in config.json)
    loads through mlx-lm's quantization and agrees with its dense weights."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_cairn.models.zoo import build_model

    dense = save_tiny_embedding("qwen3", tmp_path / "dense", seed=7)
    config = json.loads((dense / "config.json").read_text())
    model = build_model(config, None)
    model.model.load_weights(list(mx.load(str(dense / "model.safetensors")).items()))
    nn.quantize(model, group_size=32, bits=8)
    quant = shutil.copytree(dense, tmp_path / "q8")
    mx.save_safetensors(str(quant / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 8, "mode": "affine"}
    (quant / "config.json").write_text(json.dumps(config))
    seqs = models["qwen3"].tokenize(["Hello world! How are you today?", "Paris"], truncate=False)
    got = load_embedding_model(quant).embed(seqs)
    assert np.min(np.sum(got * models["qwen3"].embed(seqs), axis=1)) >= 0.999
