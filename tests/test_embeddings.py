"""Embeddings end to end: ``/v1/embeddings`` and Ollama's ``/api/embed`` / ``/api/embeddings``.

One live server serves four tiny random-weight embedding models saved as HF
folders (BERT, XLM-RoBERTa with sentence-transformers CLS pooling, ModernBERT
with sliding-window layers, a Qwen3-Embedding shaped decoder) and a tiny chat
model. Every vector the server returns for a batch must match an independent
computation of each input alone with the same library (mlx-embeddings' own
model call; mlx-lm's backbone with the pooling done here), cosine >= 0.999.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from live_server import serve
from mlx_cairn.api import ModelRegistry, create_app
from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.models.export import save_folder
from mlx_cairn.protocol.embeddings import (
    EmbeddingRequest,
    parse_ollama_embed,
    parse_ollama_embeddings,
    parse_openai,
)
from mlx_cairn.testing.engine_checks import assert_at_rest, wait_idle
from mlx_cairn.testing.tiny_embed import save_tiny_embedding
from mlx_cairn.testing.tiny_models import tiny_zoo_model

pytestmark = pytest.mark.timeout(300)

FAMILIES = ["bert", "xlm_roberta", "modernbert", "qwen3"]
TEXTS = [
    "Hello world! How are you today?",
    "The capital of France is Paris.",
    "héllo wörld — ünïcode ✓",
    "def add(x, y):\n    return x + y",
    "tool",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed")
    out = {fam: save_tiny_embedding(fam, root / fam, seed=3) for fam in FAMILIES}
    out["bert-mrl"] = save_tiny_embedding(
        "bert", root / "bert-mrl", seed=4, matryoshka_dimensions=[16, 32]
    )
    out["chat"] = save_folder(tiny_zoo_model("qwen3", seed=5), root / "chat")
    return out


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[dict[str, Any]]:
    registry = ModelRegistry([str(p) for p in folders.values()])
    with serve(registry) as srv:
        yield {"url": srv.url, "registry": registry}
    registry.close()


def _unit(v: Any) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    return a / np.linalg.norm(a)


def reference(folder: Path, text: str) -> np.ndarray:
    """One input alone, computed with the family's library and no server code."""
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] == "qwen3":
        from mlx_lm.models import qwen3

        model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
        model.model.load_weights(list(mx.load(str(folder / "model.safetensors")).items()))
        with cpu_attention.disabled():  # mlx-lm's own attention, not our CPU path
            hidden = model.model(mx.array([ids]))
        return _unit(hidden[0, -1])  # last-token pooling, as 1_Pooling/config.json says
    from mlx_embeddings.utils import load_model

    model = load_model(folder)
    out = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))
    if config["model_type"] == "xlm-roberta":
        return _unit(out.last_hidden_state[0, 0])  # CLS pooling (sentence-transformers files)
    return _unit(out.text_embeds[0])  # the library's own mean pooling + normalization


def _cos(a: Any, b: Any) -> float:
    return float(_unit(a) @ _unit(b))


@pytest.fixture(scope="module")
def oa(server: dict[str, Any]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server["url"] + "/v1", api_key="x", max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def ol(server: dict[str, Any]) -> Iterator[ollama.Client]:
    with ollama.Client(host=server["url"], timeout=60) as client:
        yield client


@pytest.mark.parametrize("family", FAMILIES)
def test_vectors_match_the_library_computed_alone(
    oa: openai.OpenAI, folders: dict[str, Path], family: str
) -> None:
    # The SDK asks for base64 by default and decodes it: the batch is padded, each
    # reference is one unpadded input.
    got = oa.embeddings.create(model=family, input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    ids = Tokenizer.from_file(str(folders[family] / "tokenizer.json"))
    assert got.usage.prompt_tokens == sum(len(ids.encode(t).ids) for t in TEXTS)
    for text, d in zip(TEXTS, got.data, strict=True):
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4
        assert _cos(d.embedding, reference(folders[family], text)) >= 0.999, (family, text)


def test_float_and_base64_agree(server: dict[str, Any]) -> None:
    url = server["url"] + "/v1/embeddings"
    body = {"model": "bert", "input": TEXTS[:2]}
    floats = httpx.post(url, json=body | {"encoding_format": "float"}).json()
    b64 = httpx.post(url, json=body | {"encoding_format": "base64"}).json()
    assert floats["object"] == "list" and floats["model"] == "bert"
    assert floats["usage"] == b64["usage"]
    for f, b in zip(floats["data"], b64["data"], strict=True):
        assert f["object"] == b["object"] == "embedding"
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], np.float32))


def test_token_ids_give_the_vectors_of_their_text(
    oa: openai.OpenAI, folders: dict[str, Path]
) -> None:
    tok = Tokenizer.from_file(str(folders["qwen3"] / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in TEXTS[:3]]
    by_text = oa.embeddings.create(model="qwen3", input=TEXTS[:3], encoding_format="float")
    by_ids = oa.embeddings.create(model="qwen3", input=ids, encoding_format="float")
    one = oa.embeddings.create(model="qwen3", input=ids[0], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert _cos(a.embedding, b.embedding) >= 0.9999
    assert _cos(one.data[0].embedding, by_text.data[0].embedding) >= 0.9999
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_dimensions_cut_and_normalize_matryoshka_models_only(oa: openai.OpenAI) -> None:
    full = oa.embeddings.create(model="qwen3", input=TEXTS[0], encoding_format="float")
    cut = oa.embeddings.create(
        model="qwen3", input=TEXTS[0], dimensions=32, encoding_format="float"
    )
    vec = np.asarray(cut.data[0].embedding)
    assert vec.shape == (32,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert _cos(vec, full.data[0].embedding[:32]) >= 0.9999
    listed = oa.embeddings.create(model="bert-mrl", input="x", dimensions=16)
    assert len(listed.data[0].embedding) == 16
    for model, dims, words in (
        ("bert", 32, "not trained to be truncated"),
        ("qwen3", 16, "32 to 64"),  # below Qwen3-Embedding's floor
        ("qwen3", 65, "32 to 64"),
        ("bert-mrl", 20, "16, 32"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            oa.embeddings.create(model=model, input="x", dimensions=dims)
        assert words in str(e.value) and e.value.body["param"] == "dimensions"


def test_ollama_client_shapes(
    ol: ollama.Client, oa: openai.OpenAI, folders: dict[str, Path]
) -> None:
    client = ol
    got = client.embed(model="xlm_roberta", input=TEXTS[:2])
    assert got.model == "xlm_roberta" and len(got.embeddings) == 2
    assert got.prompt_eval_count and got.total_duration and got.load_duration is not None
    for text, v in zip(TEXTS, got.embeddings, strict=False):
        assert _cos(v, reference(folders["xlm_roberta"], text)) >= 0.999
    one = client.embed(model="qwen3", input=TEXTS[1], dimensions=32)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 32
    legacy = client.embeddings(model="bert", prompt=TEXTS[0])
    openai_vec = oa.embeddings.create(model="bert", input=TEXTS[0]).data[0]
    assert _cos(legacy.embedding, openai_vec.embedding) >= 0.9999
    assert client.embed(model="bert", input=[]).embeddings == []  # loads, embeds nothing
    assert client.embeddings(model="bert", prompt="").embedding == []
    # Ollama truncates by default; truncate=false refuses a long input in its envelope.
    long = "Hello world! " * 40
    cut = client.embed(model="xlm_roberta", input=long)
    assert cut.prompt_eval_count == 48  # sentence_bert_config.json's max_seq_length
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="xlm_roberta", input=long, truncate=False)
    assert e.value.status_code == 400 and "48 maximum" in e.value.error
    # The listings know a loaded embedding model (Open WebUI polls /api/tags).
    assert "xlm_roberta" in {m.model for m in client.list().models}
    assert "xlm_roberta" in {m.model for m in client.ps().models}
    shown = client.show("xlm_roberta")
    assert shown.capabilities == ["embedding"] and not shown.template


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "bert"}, "input: field required"),
        ({"model": "bert", "input": []}, "non-empty list"),
        ({"model": "bert", "input": ""}, "must not be empty"),
        ({"model": "bert", "input": ["a", 1]}, "all strings"),
        ({"model": "bert", "input": [[1], []]}, "must not be empty"),
        ({"model": "bert", "input": [-1]}, "non-negative"),
        ({"model": "bert", "input": [10**6]}, "outside the vocabulary"),
        ({"model": "bert", "input": ["a"] * 2049}, "at most 2048"),
        ({"model": "bert", "input": "a", "encoding_format": "int8"}, "'float' or 'base64'"),
        ({"model": "bert", "input": "a", "dimensions": 0}, "positive integer"),
        ({"model": "bert", "input": "Hello world! " * 60}, "maximum context length is 128"),
        ({"model": "chat", "input": "a"}, "is a chat model"),
    ],
)
def test_openai_refusals(server: dict[str, Any], body: dict[str, Any], words: str) -> None:
    r = httpx.post(server["url"] + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"], err


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = ["model", "input", "prompt", "encoding_format", "dimensions", "truncate", "options"]


@given(
    body=_JSON | st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5),
    parse=st.sampled_from([parse_openai, parse_ollama_embed, parse_ollama_embeddings]),
)
def test_parsers_answer_a_request_or_a_400(body: Any, parse: Any) -> None:
    """Whatever JSON arrives: a well-formed request, or InvalidRequest (never a 500)."""
    try:
        req = parse(body)
    except InvalidRequest:
        return
    assert isinstance(req, EmbeddingRequest) and isinstance(req.model, str) and req.model
    assert (req.texts is None) != (req.ids is None)
    assert all(isinstance(t, str) and t for t in req.texts or [])
    assert all(s and all(isinstance(i, int) and i >= 0 for i in s) for s in req.ids or [])
    assert req.dimensions is None or req.dimensions >= 1


def test_kind_mismatch_in_each_dialects_envelope(server: dict[str, Any]) -> None:
    url = server["url"]
    chat = {"model": "bert", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(url + path, json=chat)
        assert r.status_code == 400, (path, r.text)
        assert "is an embedding model" in r.text, r.text
    assert httpx.post(url + "/v1/messages", json=chat).json()["type"] == "error"
    for path, body in (
        ("/api/embed", {"model": "chat", "input": "a"}),
        ("/api/embeddings", {"model": "chat", "prompt": "a"}),
    ):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and "is a chat model" in r.json()["error"], r.text
    r = httpx.post(url + "/api/embed", json={"model": "bert", "input": 3})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_mismatch_is_refused_before_loading(folders: dict[str, Path]) -> None:
    from starlette.testclient import TestClient

    registry = ModelRegistry([str(folders["bert"]), str(folders["chat"])])
    with TestClient(create_app(registry)) as client:
        chat = {"model": "bert", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 400
        assert (
            client.post("/v1/embeddings", json={"model": "chat", "input": "a"}).status_code == 400
        )
        assert not any(m.loaded for m in registry.listing())
    registry.close()


def test_engines_at_rest(server: dict[str, Any]) -> None:
    """Last in this file: nothing queued or running anywhere, no lease or KV block held
    (the refusals above, before and after their model's lease, gave everything back)."""
    for sm in server["registry"].models:
        assert sm.active == 0, sm.name
        if sm.engine is None:
            continue
        if getattr(sm.loaded, "kind", None) == "embedding":
            st = wait_idle(sm.engine)
            assert st.requests_failed == 0
        else:
            assert_at_rest(sm.engine)
