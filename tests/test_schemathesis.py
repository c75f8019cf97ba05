"""schemathesis against the server's own OpenAPI document, every route, bounded.

The document is fetched from the running server (``/openapi.json``, behind the
auth gate like everything else). schemathesis generates bodies that fit the
documented schemas and bodies that do not, plus odd path parameters, and sends
them to a real uvicorn server running the real engine with the scripted model.
Every answer must come in time, never be a 5xx, and every 4xx must be in the
envelope of the dialect that owns the path. Afterwards the engine is at rest.

Budget: ``CAIRN_SCHEMATHESIS_EXAMPLES`` examples per operation (default: the
hypothesis profile's count, at most 30); raise it for a deeper run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from live_server import ANTHROPIC_ERROR_TYPES, registry_for, serve
from mlx_cairn.api import ModelRegistry, ServerConfig, create_app
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.embedder import EmbeddingEngine
from mlx_cairn.models.embedding import load_embedding_model
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.testing.tiny_embed import save_tiny_embedding
from scripted_model import scripted_model

TOKEN = "schemathesis-token"
AUTH = {"x-api-key": TOKEN}
EXAMPLES = int(
    os.environ.get(
        "CAIRN_SCHEMATHESIS_EXAMPLES",
        min(30, int(os.environ.get("CAIRN_HYPOTHESIS_EXAMPLES", "100"))),
    )
)
CONFIG = ServerConfig(api_token=TOKEN, max_body_bytes=256 * 1024, max_tokens_limit=4096)
#: Seconds one request may take; longer is a hang.
REQUEST_TIMEOUT = 30.0


#: Routes answered by an embedding model (a tiny BERT served as "embed").
EMBEDDING_PATHS = ("/v1/embeddings", "/api/embed", "/api/embeddings")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    engine = Engine(
        scripted_model("scripted"), EngineConfig(num_blocks=256, block_size=16, max_queue=16)
    )
    folder = save_tiny_embedding("bert", tmp_path_factory.mktemp("embed") / "bert")
    embed = EmbeddingEngine(load_embedding_model(folder), max_queue=16)
    with serve(registry_for({"scripted": engine, "embed": embed}), CONFIG) as srv:
        yield {"url": srv.url, "engine": engine}
    engine.close()
    embed.close()


def _document() -> dict[str, Any]:
    """The OpenAPI document ``create_app`` builds (the live server's is checked equal below)."""
    return create_app(ModelRegistry(["scripted", "embed"]), CONFIG).openapi()


DOCUMENT = _document()
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_live_server_serves_this_document(live: dict[str, Any]) -> None:
    r = httpx.get(live["url"] + "/openapi.json", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json() == DOCUMENT
    assert httpx.get(live["url"] + "/openapi.json", timeout=10).status_code == 401
    posts = [p for p, ops in DOCUMENT["paths"].items() if "post" in ops]
    assert posts and all("requestBody" in DOCUMENT["paths"][p]["post"] for p in posts)


def check_envelope(path: str, r: Any) -> None:
    """A 4xx body in the envelope of the dialect that owns ``path``."""
    content_type = (r.headers.get("content-type") or [""])[0]  # schemathesis: lists of values
    assert content_type.startswith("application/json"), r.headers
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data.get("type") == "error", data
        assert data["error"]["type"] in ANTHROPIC_ERROR_TYPES, data
        assert isinstance(data["error"]["message"], str), data
    elif path.startswith("/api/"):  # Ollama's envelope
        assert isinstance(data.get("error"), str) and data["error"], data
    else:  # OpenAI paths and the shared ones (OpenAI shape unless anthropic-version is sent)
        err = data["error"]
        assert set(err) >= {"message", "type", "param", "code"}, data


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_every_route_survives_generated_requests(case: Any, live: dict[str, Any]) -> None:
    headers = dict(AUTH)
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        # Reach the engine (unknown names are 404s elsewhere).
        case.body["model"] = "embed" if case.path in EMBEDDING_PATHS else "scripted"
        # An Ollama keep_alive would unload the model, closing this test's one engine.
        case.body.pop("keep_alive", None)
    if case.path.startswith("/v1/messages"):
        headers["anthropic-version"] = "2023-06-01"
    r = case.call(base_url=live["url"], headers=headers, timeout=REQUEST_TIMEOUT)
    assert r.status_code < 500, (case.method, case.path, r.status_code, r.text[:500])
    if r.status_code >= 400:
        check_envelope(case.path, r)


def test_engine_at_rest_afterwards(live: dict[str, Any]) -> None:
    st = assert_at_rest(live["engine"])
    assert st.queue_depth == 0
    # Generated bodies reached the model on every generation route, and many were refused.
    text = httpx.get(live["url"] + "/metrics", headers=AUTH, timeout=10).text
    assert st.requests_completed > 0
    for path, ops in DOCUMENT["paths"].items():
        if "post" in ops:
            for status in ("200", "400"):
                line = (
                    f'cairn_http_requests_total{{method="POST",route="{path}",status="{status}"}}'
                )
                assert line in text, (path, status)
