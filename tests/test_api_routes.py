"""``GET /v1/models/{id}``, the ``HEAD /`` / ``HEAD /health`` probes, and the one log line per 4xx.

In-process (Starlette's TestClient, which the SDKs accept as their HTTP
client) with the real engine and the scripted test model, plus one real
uvicorn server for the probes as Claude Code sends them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.testclient import TestClient

from live_server import registry_for, serve
from mlx_cairn.api import ModelRegistry, ServerConfig, create_app
from mlx_cairn.engine import Engine, EngineConfig
from scripted_model import scripted_model

TOKEN = "routes-token-0123456789"
KEY = {"x-api-key": TOKEN}
JSON = {"accept": "application/json"}
ANTHROPIC = {**KEY, "anthropic-version": "2023-06-01"}
ALIASES = {"fast": "scripted", "claude-haiku-*": "scripted"}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(
        scripted_model("scripted"), EngineConfig(num_blocks=128, block_size=16, max_queue=8)
    )
    yield eng
    eng.close()


def make_app(engine: Engine, **registry: Any) -> Any:
    config = ServerConfig(api_token=TOKEN, max_body_bytes=64 * 1024)
    return create_app(registry_for({"scripted": engine}, **registry), config)


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(make_app(engine, aliases=ALIASES), raise_server_exceptions=False) as c:
        yield c


def api_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mlx_cairn.api"]


# ------------------------------------------------------------ GET /v1/models/{id}


@pytest.mark.parametrize("headers", [KEY, ANTHROPIC], ids=["openai", "anthropic"])
def test_each_model_is_its_listing_entry(client: TestClient, headers: dict[str, str]) -> None:
    listing = client.get("/v1/models", headers=headers).json()["data"]
    assert {m["id"] for m in listing} == {"scripted", "fast"}
    for entry in listing:
        r = client.get(f"/v1/models/{entry['id']}", headers=headers)
        assert r.status_code == 200 and r.json() == entry


def load(client: TestClient, model: str = "scripted") -> None:
    """Have ``model`` loaded (a count_tokens request loads it, as any request does)."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    r = client.post("/v1/messages/count_tokens", json=body, headers=ANTHROPIC)
    assert r.status_code == 200, r.text


def test_model_shapes(client: TestClient) -> None:
    load(client)
    a = client.get("/v1/models/scripted", headers=ANTHROPIC).json()
    assert set(a) == {
        "type",
        "id",
        "display_name",
        "created_at",
        "loaded",
        "context_length",
        "capabilities",
    }
    assert a["capabilities"] == {"vision": False}
    assert a["type"] == "model" and a["id"] == "scripted" and a["created_at"].endswith("Z")
    o = client.get("/v1/models/scripted", headers=KEY).json()
    assert o == {
        "id": "scripted",
        "object": "model",
        "created": o["created"],
        "owned_by": "mlx-cairn",
        "loaded": True,
        "capabilities": {"vision": False},
        "context_length": 8192,
        "max_model_len": 8192,
    }


def test_model_ids_resolve_like_generation_requests(client: TestClient) -> None:
    load(client)
    created = client.get("/v1/models/scripted", headers=KEY).json()["created"]
    for name in ("fast", "claude-haiku-4-5-20251001", "default"):  # alias, glob, default
        r = client.get(f"/v1/models/{name}", headers=KEY)
        assert r.status_code == 200, (name, r.text)
        assert r.json() == {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "mlx-cairn",
            "loaded": True,
            "capabilities": {"vision": False},
            "context_length": 8192,
            "max_model_len": 8192,
        }
    # Without --default-model, a claude-* name no alias matches is unknown.
    r = client.get("/v1/models/claude-sonnet-4-5", headers=ANTHROPIC)
    assert r.status_code == 404


def test_default_model_fallback(engine: Engine) -> None:
    with TestClient(make_app(engine, default_model="")) as c:
        r = c.get("/v1/models/claude-sonnet-4-5", headers=ANTHROPIC)
        assert r.status_code == 200 and r.json()["id"] == "claude-sonnet-4-5"
        assert c.get("/v1/models/gpt-4o", headers=KEY).status_code == 404


def test_unknown_model_is_a_404_in_the_callers_envelope(client: TestClient) -> None:
    r = client.get("/v1/models/nope", headers=ANTHROPIC)
    assert r.status_code == 404
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "not_found_error"
    assert "nope" in data["error"]["message"]
    r = client.get("/v1/models/nope", headers=KEY)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and set(err) == {"message", "type", "param", "code"}
    r = client.get("/v1/models/org/nope", headers=KEY)  # ids may hold a slash
    assert r.status_code == 404 and "org/nope" in r.json()["error"]["message"]


def test_model_by_id_is_behind_the_gate(client: TestClient) -> None:
    for headers in ({}, {"x-api-key": "wrong"}):
        r = client.get("/v1/models/scripted", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("headers", [KEY, ANTHROPIC], ids=["openai", "anthropic"])
def test_models_report_their_context_length_once_loaded(
    engine: Engine, headers: dict[str, str]
) -> None:
    # A model is loaded on first use; until then its context is not known.
    with TestClient(make_app(engine, aliases=ALIASES)) as c:
        before = c.get("/v1/models", headers=headers).json()["data"]
        assert before and all(
            "context_length" not in m and "max_model_len" not in m for m in before
        )
        load(c)
        listing = c.get("/v1/models", headers=headers).json()["data"]
        assert {m["id"]: m["context_length"] for m in listing} == {"scripted": 8192, "fast": 8192}
        for m in listing:
            assert c.get(f"/v1/models/{m['id']}", headers=headers).json() == m
            if headers is KEY:  # vLLM's name for it too
                assert m["max_model_len"] == 8192
    assert engine.context_length == 8192


def test_sdks_see_the_context_length(client: TestClient) -> None:
    load(client)
    base = str(client.base_url)
    with openai.OpenAI(
        base_url=base + "/v1", api_key=TOKEN, http_client=TestClient(client.app), max_retries=0
    ) as o:
        models = {m.id: m for m in o.models.list()}
        assert models["scripted"].model_extra == {
            "loaded": True,
            "capabilities": {"vision": False},
            "context_length": 8192,
            "max_model_len": 8192,
        }
        assert o.models.retrieve("fast").model_extra["context_length"] == 8192  # type: ignore[index]


def test_model_by_id_loads_nothing() -> None:
    loads: list[Any] = []
    registry = ModelRegistry(["lazy"], loader=loads.append, engine_factory=lambda lm: object())
    with TestClient(create_app(registry)) as c:
        r = c.get("/v1/models/lazy")
        assert r.status_code == 200 and r.json()["id"] == "lazy"
    assert loads == [] and registry.models[0].engine is None


def test_sdks_retrieve_a_model(client: TestClient) -> None:
    # A TestClient is an httpx2.Client, the HTTP client both SDKs run on; each SDK
    # closes the one it was given.
    base = str(client.base_url)
    with anthropic.Anthropic(
        base_url=base, api_key=TOKEN, http_client=TestClient(client.app), max_retries=0
    ) as a:
        m = a.models.retrieve("fast")
        assert (m.id, m.type, m.display_name) == ("fast", "model", "fast")
        with pytest.raises(anthropic.NotFoundError):
            a.models.retrieve("nope")
    with openai.OpenAI(
        base_url=base + "/v1", api_key=TOKEN, http_client=TestClient(client.app), max_retries=0
    ) as o:
        m2 = o.models.retrieve("claude-haiku-4-5")
        assert (m2.id, m2.object, m2.owned_by) == ("claude-haiku-4-5", "model", "mlx-cairn")
        with pytest.raises(openai.NotFoundError):
            o.models.retrieve("nope")


# -------------------------------------------------------------- HEAD probes


def test_root_and_health_probes(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for path in ("/", "/health"):
        r = client.head(path, headers=JSON)
        assert r.status_code == 200 and r.content == b"", path
        assert r.headers["content-type"] == "application/json"
    # What Ollama clients look for; JSON for callers that ask for it.
    assert client.get("/").text == "Ollama is running"
    assert client.head("/").headers["content-type"].startswith("text/plain")
    assert client.get("/", headers=JSON).json() == {"status": "ok"}  # anonymous: liveness only
    full = client.get("/", headers={**KEY, **JSON}).json()
    assert full["status"] == "ok" and full["name"] == "mlx-cairn" and "version" in full
    assert client.head("/", headers=KEY).status_code == 200
    assert client.head("/health", headers=KEY).status_code == 200
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert api_lines(caplog) == []


def test_probes_follow_the_health_auth_rule(client: TestClient) -> None:
    for path in ("/", "/health"):
        for method in ("HEAD", "GET"):
            r = client.request(method, path, headers={"x-api-key": "wrong"})
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"] == "Bearer"


def test_probes_over_a_real_server(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = ServerConfig(api_token=TOKEN)
    with serve(registry_for({"scripted": engine}), config) as srv:
        # As Claude Code sends it: no credential, a HEAD of the base URL.
        for path in ("/", "/health"):
            r = httpx.head(srv.url + path, timeout=10)
            assert r.status_code == 200 and r.content == b""
        assert httpx.get(srv.url + "/", headers=JSON, timeout=10).json() == {"status": "ok"}
        assert httpx.get(srv.url + "/", timeout=10).text == "Ollama is running"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert api_lines(caplog) == []


# ------------------------------------------------------------ 4xx log lines

LOGGED = [
    (
        "POST",
        "/v1/messages?beta=true",
        {"model": "scripted", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
        ANTHROPIC,
        "400 POST /v1/messages: invalid_request_error: messages[0].role: ",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "scripted", "messages": []},
        KEY,
        "400 POST /v1/chat/completions: invalid_request_error: messages",
    ),
    (
        "POST",
        "/v1/messages",
        {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        ANTHROPIC,
        "404 POST /v1/messages: not_found_error: model 'nope' not found",
    ),
    ("GET", "/v1/models/nope", None, KEY, "404 GET /v1/models/nope: not_found_error: model 'nope'"),
    ("GET", "/no/such/route", None, KEY, "404 GET /no/such/route: not_found_error: not found"),
    ("PUT", "/v1/messages", None, KEY, "405 PUT /v1/messages: invalid_request_error: Method Not"),
    (
        "POST",
        "/v1/messages",
        {"model": "scripted", "messages": [{"role": "user", "content": "x" * 70_000}]},
        KEY,
        "413 POST /v1/messages: request_too_large: request body is larger than",
    ),
    (
        "GET",
        "/v1/responses/resp_missing",
        None,
        KEY,
        "404 GET /v1/responses/resp_missing: not_found_error: ",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "payload", "headers", "line"),
    LOGGED,
    ids=[f"{m} {p}" for m, p, *_ in LOGGED],
)
def test_each_4xx_is_one_log_line_that_says_why(
    client: TestClient,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    payload: Any,
    headers: dict[str, str],
    line: str,
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_cairn.api")
    r = client.request(method, path, json=payload, headers=headers)
    assert r.status_code == int(line[:3]), r.text
    [rec] = api_lines(caplog)
    assert rec.levelno == logging.INFO
    assert rec.getMessage().startswith(line), rec.getMessage()


def test_401_lines_say_nothing_about_the_credential(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_cairn.api")
    secret = "sk-wrong-credential-value"
    cases = [
        {},
        {"x-api-key": secret},
        {"authorization": f"Bearer {secret}"},
        {"authorization": f"Basic {secret}"},
    ]
    for headers in cases:
        assert client.get("/v1/models?key=" + secret, headers=headers).status_code == 401
    lines = [rec.getMessage() for rec in api_lines(caplog)]
    assert lines == ["401 GET /v1/models: authentication_error: invalid or missing credentials"] * 4


def test_the_query_string_is_never_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_cairn.api")
    r = client.post("/v1/messages?beta=true&api_key=hunter2", json={}, headers=ANTHROPIC)
    assert r.status_code == 400
    [rec] = api_lines(caplog)
    assert "hunter2" not in rec.getMessage() and "?" not in rec.getMessage()


def test_a_log_line_stays_one_line(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlx_cairn.api")
    name = "evil\nINFO mlx_cairn.api: 200 GET / forged\r\x1b[2J" + "x" * 2000
    body = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/messages", json=body, headers=ANTHROPIC).status_code == 404
    [rec] = api_lines(caplog)
    text = rec.getMessage()
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert "evil\\nINFO" in text and len(text) < 1000


def test_successes_log_nothing(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlx_cairn.api")
    body = {"model": "fast", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/messages", json=body, headers=ANTHROPIC).status_code == 200
    assert client.get("/v1/models/fast", headers=KEY).status_code == 200
    assert api_lines(caplog) == []


# ---------------------------------------------------------------- x-should-retry


def test_errors_say_whether_a_retry_can_help(client: TestClient) -> None:
    """Claude Code and the SDKs read x-should-retry first: a wrong token must not be
    retried ten times over three minutes."""
    cases = [
        (client.post("/v1/messages", json={}, headers={"x-api-key": "wrong"}), 401, "false"),
        (client.post("/v1/messages", json={"model": "scripted"}, headers=KEY), 400, "false"),
        (client.get("/v1/nowhere", headers=KEY), 404, "false"),
        (
            client.post(
                "/v1/messages", content=b"x" * (70 * 1024), headers=KEY | {"content-type": "a/b"}
            ),
            413,
            "false",
        ),
    ]
    for r, status, retry in cases:
        assert r.status_code == status, r.text
        assert r.headers["x-should-retry"] == retry, (status, r.headers)


def test_a_full_queue_is_worth_retrying() -> None:
    from mlx_cairn.api.dialects import RETRYABLE

    assert {408, 429, 500, 529} <= RETRYABLE and not {400, 401, 403, 404, 413} & RETRYABLE
