"""Hostile credentials on every route, in every dialect (complements test_api_server's matrix).

tests/test_api_server.py checks the credential rules on one route. Here the
same refusals are checked on every route the app serves (generation routes of
all three dialects, shared routes, /metrics, /openapi.json, unknown paths),
with malformed header bytes, oversized and repeated headers, and bodies that
must not be read before the credential is judged. A refusal is always a 401
in the envelope of the dialect that owns the path, with one body per dialect
whatever the reason, and never reaches the engine.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from live_server import read_all, registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from scripted_model import say, scripted_model

TOKEN = "auth-token-0123456789abcdef"

ROUTES = [
    ("POST", "/v1/messages", "anthropic"),
    ("POST", "/v1/messages/count_tokens", "anthropic"),
    ("POST", "/v1/chat/completions", "openai"),
    ("POST", "/v1/responses", "openai"),
    ("GET", "/v1/responses/resp_abc", "openai"),
    ("DELETE", "/v1/responses/resp_abc", "openai"),
    ("GET", "/v1/models", "openai"),
    ("GET", "/metrics", "openai"),
    ("GET", "/openapi.json", "openai"),
    ("GET", "/no/such/route", "openai"),
]

BAD: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"x-api-key", b"")],
    [(b"x-api-key", TOKEN.upper().encode())],
    [(b"x-api-key", TOKEN[:-1].encode())],
    [(b"x-api-key", (TOKEN + TOKEN).encode())],
    [(b"x-api-key", b"\xff\xfe\xfd" + TOKEN.encode())],
    [(b"x-api-key", "é".encode("latin-1") * 8)],
    [(b"x-api-key", b""), (b"authorization", f"Bearer {TOKEN}".encode())],
    [(b"x-api-key", TOKEN.encode()), (b"x-api-key", b"other")],
    [(b"authorization", b"")],
    [(b"authorization", b"Bearer")],
    [(b"authorization", b"Bearer ")],
    [(b"authorization", f"Bearer {TOKEN} extra".encode())],
    [(b"authorization", f"Token {TOKEN}".encode())],
    [(b"authorization", f"Bearer\t{TOKEN}".encode())],
    [
        (b"authorization", f"Bearer {TOKEN}".encode()),
        (b"authorization", f"Bearer {TOKEN}".encode()),
    ],
]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=64, block_size=16))
    config = ServerConfig(api_token=TOKEN, max_body_bytes=64 * 1024)
    with serve(registry_for({"scripted": engine}), config) as srv:
        yield {"url": srv.url, "port": srv.port, "engine": engine}
    engine.close()


def raw_request(
    port: int, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request with exactly these header bytes (no client normalization)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"host: 127.0.0.1", b"connection: close"]
    lines += [k + b": " + v for k, v in headers]
    if body or method == "POST":
        lines += [b"content-type: application/json", f"content-length: {len(body)}".encode()]
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # The server may answer and close before taking the whole body.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        raw = read_all(s)
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), hdrs, rest


def assert_401(dialect: str, status: int, headers: dict[str, str], body: bytes) -> None:
    import json

    assert status == 401, (status, body[:200])
    assert headers.get("www-authenticate") == "Bearer"
    data = json.loads(body)
    if dialect == "anthropic":
        assert data == {
            "type": "error",
            "error": {"type": "authentication_error", "message": data["error"]["message"]},
        }
    else:
        assert (
            data["error"]["type"] == "authentication_error"
            and data["error"]["code"] == "invalid_api_key"
        )


@pytest.mark.parametrize(
    ("method", "path", "dialect"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES]
)
def test_every_route_refuses_every_bad_credential(env, method, path, dialect):
    before = env["engine"].stats().requests_total
    body = b'{"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}'
    bodies = set()
    for headers in BAD:
        status, hdrs, resp = raw_request(
            env["port"], method, path, headers, body if method == "POST" else b""
        )
        assert_401(dialect, status, hdrs, resp)
        bodies.add(resp)
    assert len(bodies) == 1, bodies  # one body per dialect, whatever failed
    assert env["engine"].stats().requests_total == before


def test_bytes_http_forbids_in_a_header_are_refused_before_the_app(env):
    before = env["engine"].stats().requests_total
    for value in (TOKEN.encode() + b"\x00", b"\x00" + TOKEN.encode(), TOKEN.encode() + b"\r"):
        status, _, _ = raw_request(env["port"], "GET", "/v1/models", [(b"x-api-key", value)])
        assert status in (400, 401), status
    assert env["engine"].stats().requests_total == before


def test_header_names_are_case_insensitive(env):
    for name in (b"X-Api-Key", b"X-API-KEY"):
        status, _, _ = raw_request(env["port"], "GET", "/v1/models", [(name, TOKEN.encode())])
        assert status == 200
    status, _, _ = raw_request(
        env["port"], "GET", "/v1/models", [(b"AUTHORIZATION", f"bEaReR {TOKEN}".encode())]
    )
    assert status == 200


def test_health_anonymous_vs_wrong_vs_right(env):
    anon = raw_request(env["port"], "GET", "/health", [])
    assert anon[0] == 200 and anon[2] == b'{"status":"ok"}'
    for headers in BAD[1:]:  # any credential that is present but wrong
        status, hdrs, body = raw_request(env["port"], "GET", "/health", headers)
        assert_401("openai", status, hdrs, body)
    status, _, body = raw_request(env["port"], "GET", "/health", [(b"x-api-key", TOKEN.encode())])
    assert status == 200 and b'"models"' in body and b'"version"' in body


def test_credentials_are_judged_before_the_body_is_read(env):
    # An over-limit body with a bad credential is a 401 (not a 413), answered at once.
    big = b"x" * (1024 * 1024)
    status, hdrs, body = raw_request(
        env["port"], "POST", "/v1/chat/completions", [(b"x-api-key", b"nope")], big
    )
    assert_401("openai", status, hdrs, body)
    # With the right one it is the 413.
    status, _, _ = raw_request(
        env["port"], "POST", "/v1/chat/completions", [(b"x-api-key", TOKEN.encode())], big
    )
    assert status == 413


def test_a_huge_credential_header_is_refused_cleanly(env):
    for size in (8 * 1024, 60 * 1024):
        headers = [(b"x-api-key", b"k" * size)]
        try:
            status, _, _ = raw_request(env["port"], "GET", "/v1/models", headers)
        except ConnectionError:
            continue  # the HTTP parser may drop an oversized head: refused either way
        assert status in (400, 401, 431), status
    # And the server is fine afterwards.
    r = httpx.post(
        env["url"] + "/v1/messages",
        json={
            "model": "scripted",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": say("fine")}],
        },
        headers={"x-api-key": TOKEN, "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "fine"
