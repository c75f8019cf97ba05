"""``--cors-origin``: preflights, CORS headers on every answer, nothing for other origins.

The app runs in-process (Starlette's TestClient) with the real engine and the
scripted test model. Preflights carry no credential (browsers never send one)
and must still be answered for an allowed origin, on every path; every
answer to an allowed origin carries the CORS headers (200, 401, 404, 400,
413, 500, streams); a request from another origin, or any request when the
flag is not given, gets no CORS header at all.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from starlette.testclient import TestClient

from live_server import registry_for, sse_events
from mlx_cairn.api import ServerConfig, create_app
from mlx_cairn.api.app import CORS_ALLOW_HEADERS
from mlx_cairn.cli.serve import add_arguments, build
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

TOKEN = "cors-token-0123456789"
ORIGIN = "http://ui.test:5173"
OTHER = "http://evil.test"
KEY = {"x-api-key": TOKEN}
ANTHROPIC = {**KEY, "anthropic-version": "2023-06-01"}

#: Every kind of path: dialect routes, a query string, shared routes, unknown ones.
PATHS = [
    "/v1/messages",
    "/v1/messages?beta=true",
    "/v1/messages/count_tokens?beta=true",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/resp_abc",
    "/v1/models",
    "/v1/models/scripted",
    "/health",
    "/",
    "/metrics",
    "/no/such/route",
]


def body(text: str = "hi", **kw: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": text}],
        **kw,
    }


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict[str, str]:
    h = {"origin": origin, "access-control-request-method": method}
    if headers is not None:
        h["access-control-request-headers"] = headers
    return h


def cors_headers(r: Any) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(
        scripted_model("scripted"), EngineConfig(num_blocks=128, block_size=16, max_queue=8)
    )
    yield eng
    eng.close()


def make_client(engine: Engine, **config: Any) -> TestClient:
    config.setdefault("max_body_bytes", 64 * 1024)
    app = create_app(registry_for({"scripted": engine}), ServerConfig(**config))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with make_client(engine, api_token=TOKEN, cors_origins=(ORIGIN,)) as c:
        yield c


# ------------------------------------------------------------------ preflights


@pytest.mark.parametrize("path", PATHS)
def test_preflight_for_an_allowed_origin_needs_no_credential(
    client: TestClient, engine: Engine, path: str
) -> None:
    before = engine.stats().requests_total
    wanted = "x-api-key, content-type, anthropic-version, anthropic-beta, x-stainless-retry-count"
    r = client.options(path, headers=preflight(ORIGIN, headers=wanted))
    assert r.status_code == 200, r.text
    assert r.text == "OK"  # nothing about the route, the models or the auth
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == ORIGIN
    assert {"GET", "POST", "DELETE", "HEAD"} <= set(h["access-control-allow-methods"].split(", "))
    allowed = {x.strip().lower() for x in h["access-control-allow-headers"].split(",")}
    assert {x.strip() for x in wanted.split(",")} <= allowed
    assert "www-authenticate" not in r.headers
    assert engine.stats().requests_total == before


def test_preflight_allows_every_header_the_browser_facing_clients_send(
    client: TestClient,
) -> None:
    for name in (
        "authorization",
        "x-api-key",
        "content-type",
        "anthropic-version",
        "anthropic-beta",
        "anthropic-dangerous-direct-browser-access",
        "x-stainless-os",
        "x-stainless-timeout",
        "x-stainless-helper-method",
    ):
        r = client.options("/v1/messages", headers=preflight(ORIGIN, headers=name))
        assert r.status_code == 200, (name, r.text)


def test_preflight_refuses_what_is_not_allowed(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mlx_cairn.api")
    r = client.options("/v1/messages", headers=preflight(ORIGIN, headers="x-made-up"))
    assert r.status_code == 400 and "headers" in r.text
    r = client.options("/v1/messages", headers=preflight(ORIGIN, method="PUT"))
    assert r.status_code == 400 and "method" in r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "mlx_cairn.api"]
    assert len(lines) == 2
    assert lines[0].startswith("400 OPTIONS /v1/messages: cors: Disallowed CORS headers")
    assert "x-made-up" in lines[0]


def test_private_network_preflight(client: TestClient) -> None:
    h = {**preflight(ORIGIN), "access-control-request-private-network": "true"}
    r = client.options("/v1/messages", headers=h)
    assert r.status_code == 200
    assert r.headers["access-control-allow-private-network"] == "true"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/models", "/health", "/no/such/route"])
def test_preflight_from_another_origin_is_an_ordinary_options(
    client: TestClient, engine: Engine, path: str
) -> None:
    r = client.options(path, headers=preflight(OTHER, headers="x-api-key"))
    assert cors_headers(r) == {}
    # The same answer as an OPTIONS without any CORS in play: the gate's 401
    # (a 405 on /health, which answers anonymous callers).
    with make_client(engine, api_token=TOKEN) as plain:
        p = plain.options(path, headers=preflight(OTHER, headers="x-api-key"))
    assert (r.status_code, r.content) == (p.status_code, p.content)
    assert r.status_code == (405 if path == "/health" else 401)
    assert r.headers["vary"] == "Origin"  # a cache must not reuse it for the allowed origin


def test_without_the_flag_there_is_no_cors_at_all(engine: Engine) -> None:
    for config in ({"api_token": TOKEN}, {}):
        with make_client(engine, **config) as c:
            r = c.options("/v1/messages", headers=preflight(ORIGIN, headers="x-api-key"))
            assert cors_headers(r) == {}
            assert r.status_code == (401 if config else 405)  # as before the flag existed
            for resp in (
                c.get("/v1/models", headers={**KEY, "origin": ORIGIN}),
                c.post("/v1/messages", json=body(), headers={**ANTHROPIC, "origin": ORIGIN}),
                c.get("/health", headers={"origin": ORIGIN}),
            ):
                assert resp.status_code == 200
                assert cors_headers(resp) == {}
                assert "vary" not in resp.headers


# --------------------------------------------------------- headers on answers


def assert_cors(r: Any, origin: str = ORIGIN) -> None:
    h = cors_headers(r)
    assert h.get("access-control-allow-origin") == origin, (r.status_code, r.headers)
    exposed = {x.strip() for x in h["access-control-expose-headers"].split(",")}
    assert {"retry-after", "x-session-cache", "x-cached-tokens"} <= exposed
    assert "Origin" in r.headers.get("vary", "") or origin == "*"


def test_cors_headers_on_success_and_on_every_error(client: TestClient) -> None:
    o = {"origin": ORIGIN}
    cases: list[tuple[int, Callable[[], Any]]] = [
        (200, lambda: client.get("/v1/models", headers={**KEY, **o})),
        (200, lambda: client.get("/v1/models/scripted", headers={**ANTHROPIC, **o})),
        (200, lambda: client.post("/v1/messages", json=body(), headers={**ANTHROPIC, **o})),
        (200, lambda: client.head("/", headers=o)),
        (200, lambda: client.get("/health", headers=o)),
        (401, lambda: client.post("/v1/messages", json=body(), headers=o)),
        (401, lambda: client.get("/v1/models", headers={"x-api-key": "wrong", **o})),
        (404, lambda: client.get("/v1/models/nope", headers={**ANTHROPIC, **o})),
        (404, lambda: client.get("/no/such/route", headers={**KEY, **o})),
        (405, lambda: client.put("/v1/messages", headers={**KEY, **o})),
        (400, lambda: client.post("/v1/messages", json={"x": 1}, headers={**ANTHROPIC, **o})),
        (
            413,
            lambda: client.post("/v1/messages", json=body("x" * 70_000), headers={**KEY, **o}),
        ),
    ]
    for status, send in cases:
        r = send()
        assert r.status_code == status, (status, r.text)
        assert_cors(r)
    r = client.post("/v1/messages", json={"x": 1}, headers={**ANTHROPIC, "origin": OTHER})
    assert r.status_code == 400 and cors_headers(r) == {}


def test_cors_headers_on_a_stream(client: TestClient, engine: Engine) -> None:
    b = body(say("streamed"), stream=True)
    with client.stream(
        "POST", "/v1/messages", json=b, headers={**ANTHROPIC, "origin": ORIGIN}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert_cors(r)
        text = "".join(r.iter_text())
    assert [n for n, _ in sse_events(text)][-1] == "message_stop"
    b = {**b, "messages": [{"role": "user", "content": say("chat")}]}
    h = {**KEY, "origin": ORIGIN}
    with client.stream("POST", "/v1/chat/completions", json=b, headers=h) as r:
        assert r.status_code == 200
        assert_cors(r)
        assert "[DONE]" in "".join(r.iter_text())
    assert_at_rest(engine)


def test_cors_headers_on_an_unhandled_500(engine: Engine) -> None:
    with make_client(engine, cors_origins=(ORIGIN,)) as c:

        def boom() -> None:
            raise RuntimeError("kaboom")

        c.app.add_api_route("/v1/boom", boom, methods=["GET"])  # type: ignore[attr-defined]
        r = c.get("/v1/boom", headers={"origin": ORIGIN})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert_cors(r)


def test_any_origin(engine: Engine) -> None:
    with make_client(engine, api_token=TOKEN, cors_origins=("*",)) as c:
        for origin in (ORIGIN, OTHER, "null"):
            r = c.options(
                "/v1/chat/completions", headers=preflight(origin, headers="authorization")
            )
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "*"
            r = c.get("/v1/models", headers={"origin": origin})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/v1/models", headers=KEY)  # no Origin: not a browser, nothing to add
        assert r.status_code == 200 and cors_headers(r) == {}


# ------------------------------------------------------------------- the flag


def test_the_cors_origin_flag() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    _, cfg = build(p.parse_args([]), {})
    assert cfg.cors_origins == ()
    given = ["HTTP://LocalHost:5173/", "*", "http://localhost:5173"]  # the last is a repeat
    args = p.parse_args([x for o in given for x in ("--cors-origin", o)])
    _, cfg = build(args, {})
    assert cfg.cors_origins == ("http://localhost:5173", "*")
    for bad in ("localhost:5173", "http://x.test/app", "http://x.test?a=1", ""):
        with pytest.raises(SystemExit):
            p.parse_args(["--cors-origin", bad])


# ------------------------------------------------ what the official SDKs send

#: Names a page cannot set (the browser does) and so never appear in a preflight.
_BROWSER_SET = {"host", "content-length", "accept-encoding", "connection", "cookie"}


def _sdk_header_names() -> set[str]:
    """Every header name the installed anthropic / openai SDKs put on their requests."""
    names: set[str] = set()

    def record(request: httpx2.Request) -> httpx2.Response:
        names.update(k.lower() for k in request.headers)
        return httpx2.Response(404, json={"type": "error", "error": {"type": "x", "message": "x"}})

    base = "http://cairn.test"
    http = httpx2.Client(transport=httpx2.MockTransport(record))
    msgs: Any = [{"role": "user", "content": "hi"}]
    with (
        http,
        anthropic.Anthropic(api_key="k", base_url=base, http_client=http, max_retries=0) as a,
        openai.OpenAI(api_key="k", base_url=base + "/v1", http_client=http, max_retries=0) as o,
    ):
        calls: list[Callable[[], Any]] = [
            lambda: a.messages.create(model="m", max_tokens=1, messages=msgs),
            lambda: a.messages.stream(model="m", max_tokens=1, messages=msgs).__enter__(),
            lambda: a.messages.count_tokens(model="m", messages=msgs),
            lambda: a.beta.messages.create(model="m", max_tokens=1, messages=msgs, betas=["b"]),
            lambda: a.models.retrieve("m"),
            lambda: list(a.models.list()),
            lambda: o.chat.completions.create(model="m", messages=msgs),
            lambda: o.chat.completions.stream(model="m", messages=msgs).__enter__(),
            lambda: o.responses.create(model="m", input="hi"),
            lambda: o.models.retrieve("m"),
        ]
        for call in calls:
            with pytest.raises((anthropic.NotFoundError, openai.NotFoundError)):
                call()
    return names - _BROWSER_SET


def test_every_header_the_sdks_send_passes_the_preflight(client: TestClient) -> None:
    names = _sdk_header_names()
    assert {"anthropic-version", "authorization", "x-stainless-lang"} <= names
    # An unlisted name would fail the browser's preflight: keep CORS_ALLOW_HEADERS up to date.
    r = client.options("/v1/messages", headers=preflight(ORIGIN, headers=", ".join(sorted(names))))
    assert r.status_code == 200, (r.text, names - set(CORS_ALLOW_HEADERS))
    allowed = {x.strip().lower() for x in r.headers["access-control-allow-headers"].split(",")}
    assert names <= allowed
