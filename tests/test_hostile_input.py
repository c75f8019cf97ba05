"""Hostile request bodies against the real server: each a clear 4xx in the right envelope.

Every case runs against each generation route (Anthropic Messages, OpenAI Chat
Completions, OpenAI Responses) of a real uvicorn server on loopback, serving
the real engine with the scripted test model. After the barrage the engine is
at rest: nothing queued or running, no KV block referenced, and no rejected
request ever reached it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from live_server import ANTHROPIC_ERROR_TYPES, registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

TOKEN = "hostile-token"
MAX_BODY = 2 * 1024 * 1024
MAX_TOKENS_LIMIT = 100_000


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    #: (text, max_tokens, stop) -> body; None leaves the field out.
    body: Callable[[str, Any, Any], dict[str, Any]]
    headers: dict[str, str]

    def envelope(self, r: httpx.Response, status: int) -> str:
        """Assert ``r`` is a ``status`` error in this route's dialect; return its message."""
        assert r.status_code == status, (self.name, r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/json"), r.headers
        data = r.json()
        if self.name == "anthropic":
            assert data["type"] == "error", data
            err = data["error"]
            assert err["type"] in ANTHROPIC_ERROR_TYPES, data
        else:
            err = data["error"]
            assert set(err) >= {"message", "type", "param", "code"}, data
        assert isinstance(err["message"], str) and err["message"]
        return str(err["message"])


def _builder(
    prompt: Callable[[str], dict[str, Any]], max_key: str, stop_key: str
) -> Callable[[str, Any, Any], dict[str, Any]]:
    """A dialect's body for (text, max_tokens, stop): the cap and stop fields only when given."""

    def build(text: str, max_tokens: Any, stop: Any) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "scripted", **prompt(text)}
        if max_tokens is not None:
            b[max_key] = max_tokens
        if stop is not None:
            b[stop_key] = stop
        return b

    return build


def _messages(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


_anthropic = _builder(_messages, "max_tokens", "stop_sequences")
_chat = _builder(_messages, "max_tokens", "stop")
_responses = _builder(lambda text: {"input": text, "store": False}, "max_output_tokens", "stop")


ROUTES = [
    Route(
        "anthropic",
        "/v1/messages",
        _anthropic,
        {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"},
    ),
    Route("chat", "/v1/chat/completions", _chat, {"authorization": f"Bearer {TOKEN}"}),
    Route("responses", "/v1/responses", _responses, {"authorization": f"Bearer {TOKEN}"}),
]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=160, block_size=16, max_queue=8))
    config = ServerConfig(
        api_token=TOKEN, max_body_bytes=MAX_BODY, max_tokens_limit=MAX_TOKENS_LIMIT
    )
    with (
        serve(registry_for({"scripted": engine}), config) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as client,
    ):
        yield {"engine": engine, "client": client, "url": srv.url}
    engine.close()


def send(
    env: dict[str, Any], route: Route, body: Any = None, *, raw: bytes | None = None
) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {**route.headers, "content-type": "application/json"}
    return env["client"].post(route.path, content=content, headers=headers)


@pytest.fixture
def untouched(env: dict[str, Any]) -> Iterator[None]:
    """The test's requests must all be refused before the engine sees them; it ends at rest."""
    engine = env["engine"]
    before = engine.stats().requests_total
    yield
    st = assert_at_rest(engine)
    assert st.requests_total == before, "a rejected request reached the engine"
    assert st.queue_depth == 0 and st.running == 0


def nested_json(levels: int) -> str:
    return '{"a":[' * levels + "{}" + "]}" * levels


# ------------------------------------------------------------------ the cases


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize(
    "max_tokens",
    [MAX_TOKENS_LIMIT + 1, 2**31, 2**63 - 1, 2**64 - 1, 10**30, -1, 0, 1.5, True, "16"],
)
def test_huge_or_bad_max_tokens(env, untouched, route, max_tokens):
    route.envelope(send(env, route, route.body("hi", max_tokens, None)), 400)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_max_tokens_beyond_the_context(env, untouched, route):
    # Within the server's max_tokens limit but beyond the model's 2048-token context.
    msg = route.envelope(send(env, route, route.body("hi", 50_000, None)), 400)
    assert "context" in msg.lower()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context(env, untouched, route, stream):
    body = route.body("word " * 5000, 16, None) | {"stream": stream}
    r = send(env, route, body)
    msg = route.envelope(r, 400)  # before any SSE byte: a JSON error, not a stream
    # The words each dialect's clients act on (Claude Code compacts on the first,
    # litellm raises ContextWindowExceededError on the second).
    if route.name == "anthropic":
        assert re.match(r"prompt is too long: \d+ tokens > \d+ maximum$", msg), msg
    else:
        assert re.search(r"maximum context length is \d+ tokens", msg), msg
        assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe{}",
        b'{"model": "scripted", "messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 8}',
        b'{"model": "scripted", "input": "\xed\xa0\x80", "messages": "\xed\xa0\x80", "max_tokens": 8}',
        b'{"model": "scripted", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 8}',
        b"\xef\xbb\xbf{}",
    ],
    ids=["bom16", "bad-continuation", "utf8-surrogate", "lone-escape", "bom8"],
)
def test_invalid_utf8(env, untouched, route, raw):
    route.envelope(send(env, route, raw=raw), 400)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("raw", [b"", b"[]", b'"x"', b"1", b"null", b"{", b"NaN", b'{"a":1e400}'])
def test_not_a_json_object(env, untouched, route, raw):
    route.envelope(send(env, route, raw=raw), 400)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_nesting_deeper_than_the_parser_allows(env, untouched, route):
    route.envelope(send(env, route, raw=nested_json(5000).encode()), 400)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("levels", [150, 400])
def test_deep_nesting_inside_the_request(env, route, levels):
    """Deep values where the mappers re-encode JSON (tool inputs, schemas): 400 or 200, never 500."""
    deep = nested_json(levels)
    bodies = {
        "anthropic": {
            "model": "scripted",
            "max_tokens": 8,
            "metadata": "DEEP",
            "tools": [{"name": "f", "input_schema": "DEEP"}],
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "DEEP"}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                },
            ],
        },
        "chat": {
            "model": "scripted",
            "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "DEEP"}}],
            "response_format": "DEEP",
            "messages": [{"role": "user", "content": "go"}],
        },
        "responses": {
            "model": "scripted",
            "max_output_tokens": 8,
            "store": False,
            "metadata": "DEEP",
            "tools": [{"type": "function", "name": "f", "parameters": "DEEP"}],
            "input": "go",
        },
    }
    raw = json.dumps(bodies[route.name]).replace('"DEEP"', deep).encode()
    r = send(env, route, raw=raw)
    if r.status_code != 200:
        route.envelope(r, 400)
    assert_at_rest(env["engine"])


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_ten_thousand_stop_sequences(env, untouched, route):
    stops = [f"stop{i}" for i in range(10_000)]
    msg = route.envelope(send(env, route, route.body("hi", 16, stops)), 400)
    assert "stop" in msg.lower()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_one_megabyte_stop_sequence(env, untouched, route):
    stop = "s" * (1 << 20)
    stops = stop if route.name != "anthropic" else [stop]
    msg = route.envelope(send(env, route, route.body("hi", 16, stops)), 400)
    assert "stop" in msg.lower()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_oversized_body_is_413(env, untouched, route):
    body = route.body("x" * (MAX_BODY + 10), 16, None)
    route.envelope(send(env, route, body), 413)

    raw = json.dumps(body).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(raw), 64 * 1024):
            yield raw[i : i + 64 * 1024]

    headers = {**route.headers, "content-type": "application/json"}
    r = env["client"].post(route.path, content=chunks(), headers=headers)
    route.envelope(r, 413)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_the_server_still_serves_afterwards(env, route):
    r = send(env, route, route.body(say("still here"), 16, None))
    assert r.status_code == 200, r.text
    assert "still here" in r.text
    assert_at_rest(env["engine"])
