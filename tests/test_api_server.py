"""The HTTP layer end to end: auth, limits, errors, queueing, pings, disconnects.

A real uvicorn server on a free loopback port serves the real engine running
the scripted test model (tests/scripted_model.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from live_server import scripted_server, settle_cancel, sse_events, tight_queue_full
from mlx_cairn.api import ModelRegistry, ServerConfig, create_app
from mlx_cairn.cli.serve import ServeError, add_arguments, build
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say

TOKEN = "s3cret-token"
AUTH = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}
FIXTURES = Path(__file__).parent / "fixtures" / "claude-code"


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with scripted_server(TOKEN, {"claude-haiku-*": "scripted"}) as e:
        yield e


def post(
    env: dict[str, Any],
    body: Any,
    path: str = "/v1/messages",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    h = dict(AUTH if headers is None else headers)
    return httpx.post(env["url"] + path, json=body, headers=h, timeout=30)


def body(text: str = "hi", **kw: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": text}],
        **kw,
    }


def assert_envelope(r: httpx.Response, status: int, etype: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == etype, data
    return str(data["error"]["message"])


# ------------------------------------------------------------------------ auth


def test_auth_matrix(env: dict[str, Any]) -> None:
    url = env["url"] + "/v1/models"

    def get(headers: list[tuple[str, str]]) -> httpx.Response:
        # anthropic-version: /v1/models is shared, the OpenAI shape is the default
        hdrs = [*headers, ("anthropic-version", "2023-06-01")]
        return httpx.get(url, headers=httpx.Headers(hdrs), timeout=10)

    ok = [
        [("x-api-key", TOKEN)],
        [("authorization", f"Bearer {TOKEN}")],
        [("authorization", f"bearer {TOKEN}")],
        [("authorization", f"BEARER  {TOKEN}")],
        [("x-api-key", TOKEN), ("authorization", "Bearer wrong")],  # x-api-key is read first
    ]
    denied = [
        [],
        [("x-api-key", "")],
        [("x-api-key", "wrong")],
        [("x-api-key", TOKEN[:-1])],
        [("x-api-key", TOKEN + "x")],
        [("authorization", f"Basic {TOKEN}")],
        [("authorization", TOKEN)],
        [("authorization", "Bearer")],
        [("x-api-key", "wrong"), ("authorization", f"Bearer {TOKEN}")],
        [("x-api-key", TOKEN), ("x-api-key", TOKEN)],
        [("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")],
    ]
    for h in ok:
        assert get(h).status_code == 200, h
    bodies = set()
    for h in denied:
        r = get(h)
        assert_envelope(r, 401, "authentication_error")
        assert r.headers["www-authenticate"] == "Bearer"
        bodies.add(r.content)
    assert len(bodies) == 1  # the body never says which check failed


def test_health_carve_out(env: dict[str, Any]) -> None:
    url = env["url"] + "/health"
    anon = httpx.get(url, timeout=10)
    assert anon.status_code == 200 and anon.json() == {"status": "ok"}
    assert httpx.get(url, headers={"x-api-key": "nope"}, timeout=10).status_code == 401
    full = httpx.get(url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    models = {m["name"]: m for m in full["models"]}
    post(env, body())  # make sure the scripted model is loaded
    full = httpx.get(url, headers={"x-api-key": TOKEN}, timeout=10).json()
    models = {m["name"]: m for m in full["models"]}
    stats = models["scripted"]["stats"]
    for key in ("queue_depth", "running", "blocks_free", "blocks_cached", "blocks_in_use"):
        assert key in stats


def test_every_route_is_behind_the_gate(env: dict[str, Any]) -> None:
    app = env["app"]
    app.add_api_route("/v1/added-later", lambda: {"secret": 1}, methods=["GET"])
    url = env["url"] + "/v1/added-later"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"x-api-key": TOKEN}, timeout=10).json() == {"secret": 1}
    assert httpx.get(env["url"] + "/nope", timeout=10).status_code == 401
    r = httpx.get(env["url"] + "/nope", headers=AUTH, timeout=10)
    assert_envelope(r, 404, "not_found_error")


def test_sdk_auth_modes(env: dict[str, Any]) -> None:
    # Clients are closed explicitly: a leaked keep-alive socket is a ResourceWarning
    # (an error under our pytest settings) in whichever test runs when it is collected.
    for kwargs in ({"api_key": TOKEN}, {"auth_token": TOKEN, "api_key": None}):
        with anthropic.Anthropic(base_url=env["url"], max_retries=0, **kwargs) as client:
            msg = client.messages.create(
                model="scripted", max_tokens=8, messages=[{"role": "user", "content": say("yo")}]
            )
        assert msg.content[0].text == "yo"  # type: ignore[union-attr]
    with (
        anthropic.Anthropic(base_url=env["url"], max_retries=0, api_key="wrong") as bad,
        pytest.raises(anthropic.AuthenticationError),
    ):
        bad.messages.create(
            model="scripted", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )


def test_start_up_refusals(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ServeError, match="empty"):
        build(p.parse_args(["--api-key-file", str(empty)]), {})
    with pytest.raises(ServeError, match="empty"):
        build(p.parse_args([]), {"CAIRN_API_KEY": ""})
    with pytest.raises(ServeError, match="without a token"):
        build(p.parse_args(["--host", "0.0.0.0"]), {})
    build(p.parse_args(["--host", "0.0.0.0", "--allow-no-auth"]), {})
    build(p.parse_args(["--host", "0.0.0.0"]), {"CAIRN_API_KEY": "k"})
    _, cfg = build(p.parse_args(["--host", "::1"]), {})
    assert cfg.api_token is None
    with pytest.raises(ValueError, match="empty"):
        create_app(ModelRegistry(["x"]), ServerConfig(api_token=""))


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ("[1]", "JSON object"),
        ("{not json", "not valid JSON"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "scripted", "max_tokens": 4}, "messages"),
        ({"model": "scripted", "max_tokens": 4, "messages": []}, "messages"),
        ({"model": "scripted", "max_tokens": 4, "messages": [3]}, "messages[0]"),
        ({"model": "scripted", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "model": "scripted",
                "max_tokens": "4",
                "messages": [{"role": "user", "content": "x"}],
            },
            "max_tokens",
        ),
        (
            {"model": "scripted", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        (
            {
                "model": "scripted",
                "max_tokens": 10**9,
                "messages": [{"role": "user", "content": "x"}],
            },
            "max_tokens",
        ),
        (
            {"model": "scripted", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            {
                "model": "scripted",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text"}]}],
            },
            "messages[0].content[0].text",
        ),
    ],
)
def test_validation_400(env: dict[str, Any], payload: Any, field: str) -> None:
    raw = payload if isinstance(payload, str) else json.dumps(payload)
    before = env["engines"]["scripted"].stats().requests_total
    r = httpx.post(
        env["url"] + "/v1/messages?beta=true",
        content=raw,
        headers={**AUTH, "content-type": "application/json"},
        timeout=10,
    )
    assert field in assert_envelope(r, 400, "invalid_request_error")
    assert env["engines"]["scripted"].stats().requests_total == before  # no model work


def test_model_errors(env: dict[str, Any]) -> None:
    assert "nope" in assert_envelope(post(env, body(model="nope")), 404, "not_found_error")
    assert_envelope(post(env, body(model="claude-sonnet-4-5")), 404, "not_found_error")
    assert post(env, body(model="claude-haiku-4-5-20251001")).status_code == 200  # glob alias
    msg = assert_envelope(post(env, body(model="broken")), 500, "api_error")
    assert "failed to load" in msg
    assert post(env, body()).status_code == 200  # the others keep serving
    r = post(
        env,
        {"model": "broken", "messages": [{"role": "user", "content": "x"}]},
        "/v1/messages/count_tokens",
    )
    assert_envelope(r, 500, "api_error")


def test_body_limit(env: dict[str, Any]) -> None:
    big = body("x" * 70_000)
    assert_envelope(post(env, big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:
        raw = json.dumps(big).encode()
        for i in range(0, len(raw), 8192):
            yield raw[i : i + 8192]

    r = httpx.post(
        env["url"] + "/v1/messages",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=10,
    )
    assert_envelope(r, 413, "request_too_large")
    assert post(env, body()).status_code == 200


def test_context_overflow_is_400_before_any_stream_byte(env: dict[str, Any]) -> None:
    b = body("word " * 1500, stream=True, max_tokens=7000)
    r = post(env, b)
    assert "context" in assert_envelope(r, 400, "invalid_request_error")
    with (
        anthropic.Anthropic(base_url=env["url"], api_key=TOKEN, max_retries=0) as client,
        pytest.raises(anthropic.BadRequestError),
        client.messages.stream(
            model="scripted",
            max_tokens=7000,
            messages=[{"role": "user", "content": "word " * 1500}],
        ) as s,
    ):
        s.get_final_message()


def test_queue_full_is_429_with_retry_after(env: dict[str, Any]) -> None:
    with tight_queue_full(env, lambda: post(env, body(model="tight"))):
        r = post(env, body(model="tight"))
        assert_envelope(r, 429, "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1


# ------------------------------------------------------- streams and headers


def test_pings_while_waiting_then_the_full_order(env: dict[str, Any]) -> None:
    blocker = env["blockers"]["scripted"]
    blocker.arm()
    seen = ""
    with httpx.stream(
        "POST",
        env["url"] + "/v1/messages",
        json=body(say("pong"), stream=True),
        headers=AUTH,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-session-cache"] == "streaming"
        for chunk in r.iter_text():
            seen += chunk
            # A ping while the step is held (after message_start): then let it go.
            if "event: ping" in seen.partition("event: message_start")[2]:
                blocker.release.set()
    names = [n for n, _ in sse_events(seen)]
    # Pings may also come first, while the request waits to be admitted.
    start = names.index("message_start")
    assert set(names[:start]) <= {"ping"} and names[start + 1] == "ping"
    names = [
        n
        for i, n in enumerate(names)
        if n != "ping" and not (n == names[i - 1] == "content_block_delta")
    ]
    assert names == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    # uvicorn's HTTP/1.1 has no trailers: the cache figures end the stream as a comment.
    assert seen.rstrip("\n").split("\n")[-1].startswith(": x-session-cache=")


def test_stream_disconnect_frees_everything(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    before = eng.stats().requests_cancelled
    blocker.arm()
    with httpx.stream(
        "POST",
        env["url"] + "/v1/messages",
        json=body(say("x" * 200), stream=True, max_tokens=300),
        headers=AUTH,
        timeout=30,
    ) as r:
        for chunk in r.iter_text():
            if "message_start" in chunk:
                break
    assert blocker.entered.wait(10)
    st = settle_cancel(eng, blocker, before)
    assert st.requests_cancelled == before + 1


def test_non_stream_disconnect_cancels_too(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    before = eng.stats().requests_cancelled
    blocker.arm()
    host, port = env["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    payload = json.dumps(body(say("y" * 200), max_tokens=300))
    conn.request("POST", "/v1/messages", payload, {**AUTH, "content-type": "application/json"})
    assert blocker.entered.wait(10)
    conn.close()
    st = settle_cancel(eng, blocker, before)
    assert st.requests_cancelled == before + 1


def test_json_cache_headers(env: dict[str, Any]) -> None:
    system = "You are a careful assistant. " * 40
    b = body(say("fine"), system=system)
    r1 = post(env, b)
    r2 = post(env, b)
    assert r1.status_code == r2.status_code == 200
    assert r2.headers["x-session-cache"] == "prefix_hit"
    cached = int(r2.headers["x-cached-tokens"])
    assert cached > 0 and r2.json()["usage"]["cache_read_input_tokens"] == cached
    assert r1.json()["content"] == r2.json()["content"]


class _FailOnce:
    """Fault hook: lets ``skip`` steps through, then fails one step."""

    def __init__(self, skip: int) -> None:
        self.left = skip

    def __call__(self) -> None:
        self.left -= 1
        if self.left == -1:
            raise RuntimeError("injected failure")


def test_failure_mid_stream_ends_with_an_error_event(env: dict[str, Any]) -> None:
    eng = env["engines"]["scripted"]
    saved = eng._fault_hook
    try:
        eng._fault_hook = _FailOnce(skip=3)  # prefill + a couple of tokens, then fail
        r = post(env, body(say("a b c d e f g h i j k l m n o p"), stream=True, max_tokens=100))
        events = sse_events(r.text)
        names = [n for n, _ in events if n != "ping"]
        assert names[0] == "message_start" and "content_block_delta" in names
        assert names[-1] == "error" and "message_stop" not in names
        assert events[-1][1]["error"]["type"] == "api_error"

        eng._fault_hook = _FailOnce(skip=0)
        r = post(env, body(say("x y z"), max_tokens=100))
        assert "injected failure" in assert_envelope(r, 500, "api_error")
    finally:
        eng._fault_hook = saved
    assert post(env, body()).status_code == 200  # the next request is fine
    assert_at_rest(eng)


def test_models_listing_shapes(env: dict[str, Any]) -> None:
    with anthropic.Anthropic(base_url=env["url"], api_key=TOKEN, max_retries=0) as client:
        ids = [m.id for m in client.models.list()]
    assert "scripted" in ids and "tight" in ids


def test_stream_trailers_where_the_server_supports_them(env: dict[str, Any]) -> None:
    from starlette.testclient import TestClient  # offers the http.response.trailers extension

    system = "Trailers carry the cache figures of a stream. " * 30
    b = body(say("ok then"), system=system, stream=True)
    with TestClient(env["app"]) as client:
        first = client.post("/v1/messages", json=b, headers=AUTH)
        second = client.post("/v1/messages", json=b, headers=AUTH)
    assert first.headers["x-session-cache"] == "streaming"
    assert first.headers["trailer"] == "X-Session-Cache, X-Cached-Tokens"
    t1 = dict(first.extensions["http.response.trailers"])
    t2 = dict(second.extensions["http.response.trailers"])
    assert t1[b"x-session-cache"] == b"fresh" and t1[b"x-cached-tokens"] == b"0"
    assert t2[b"x-session-cache"] == b"prefix_hit" and int(t2[b"x-cached-tokens"]) > 0
    delta = next(p for n, p in sse_events(second.text) if n == "message_delta")
    assert delta["usage"]["cache_read_input_tokens"] == int(t2[b"x-cached-tokens"])
    assert not second.text.rstrip("\n").split("\n")[-1].startswith(":")  # no comment fallback


def test_count_tokens_does_not_wait_behind_generations(env: dict[str, Any]) -> None:
    blocker = env["blockers"]["scripted"]
    blocker.arm()
    worker = threading.Thread(target=lambda: post(env, body(say("slow"))))
    worker.start()
    try:
        assert blocker.entered.wait(10)  # the engine thread is busy with a step
        ct = {"model": "scripted", "messages": [{"role": "user", "content": "how long?"}]}
        r = post(env, ct, "/v1/messages/count_tokens")
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    finally:
        blocker.release.set()
        worker.join(10)
