"""All validation happens before any work; a failure after submit always cancels.

Each case checks the engine afterwards: no request was submitted for a body
refused with a 400, and nothing is left running or holding blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from live_server import registry_for, serve
from mlx_cairn.api import respond as runner
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.protocol.codec import MAX_JSON_DEPTH
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

ROUTES = {
    "anthropic": (
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": say("hi")}]},
    ),
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": say("hi")}]},
    ),
    "responses": ("/v1/responses", {"model": "m", "max_output_tokens": 8, "input": say("hi")}),
    "ollama": (
        "/api/chat",
        {
            "model": "m",
            "stream": False,
            "options": {"num_predict": 8},
            "messages": [{"role": "user", "content": say("hi")}],
        },
    ),
}


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[str, Engine]]:
    engine = Engine(scripted_model("m"), EngineConfig(num_blocks=512, block_size=8))
    try:
        with serve(registry_for({"m": engine})) as srv:
            yield srv.url, engine
    finally:
        engine.close()


DEEP = "__deep__"


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth - 1):
        value = {"k": value}
    return value


def post_deep(url: str, body: dict[str, Any], depth: int) -> httpx.Response:
    """POST ``body`` with its ``DEEP`` placeholder replaced by ``depth`` nested objects
    (written by hand: JSON encoders refuse such depths)."""
    deep = '{"k":' * (depth - 1) + '"x"' + "}" * (depth - 1)
    raw = json.dumps(body).replace(json.dumps(DEEP), deep)
    return httpx.post(
        url, content=raw.encode(), headers={"content-type": "application/json"}, timeout=30
    )


def requests_total(engine: Engine) -> int:
    return int(engine.stats().requests_total)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "field", ["metadata", "unknown_field", "tool_choice_extra", "deep_in_messages"]
)
def test_deep_bodies_are_a_400_before_any_work(
    env: tuple[str, Engine], route: str, field: str
) -> None:
    url, engine = env
    path, base = ROUTES[route]
    body = dict(base)
    deep = DEEP
    if field == "metadata":
        body["metadata"] = {"a": deep}
    elif field == "unknown_field":
        body["x_unknown"] = deep
    elif field == "tool_choice_extra":
        body["tool_choice"] = {"type": "auto", "extra": deep}
    elif route == "responses":
        body["input"] = [{"role": "user", "content": say("hi"), "extra": deep}]
    else:
        body["messages"] = [{"role": "user", "content": say("hi"), "extra": deep}]
    before = requests_total(engine)
    r = post_deep(url + path, body, 1000)
    assert r.status_code == 400, r.text
    assert f"nested more than {MAX_JSON_DEPTH} levels" in r.text
    assert requests_total(engine) == before  # nothing was submitted
    assert_at_rest(engine)


@pytest.mark.parametrize("route", ROUTES)
def test_depth_at_the_limit_is_accepted(env: tuple[str, Engine], route: str) -> None:
    url, _ = env
    path, base = ROUTES[route]
    # The body object is level 1, "x_unknown" holds levels 2.. up to the limit.
    r = httpx.post(url + path, json=base | {"x_unknown": nested(MAX_JSON_DEPTH - 1)}, timeout=30)
    assert r.status_code == 200, r.text


def test_oversized_metadata_is_a_400(env: tuple[str, Engine]) -> None:
    url, engine = env
    path, base = ROUTES["responses"]
    before = requests_total(engine)
    for metadata in ({"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}, {"k": {"n": 1}}):
        r = httpx.post(url + path, json=base | {"metadata": metadata}, timeout=30)
        assert r.status_code == 400 and "metadata" in r.json()["error"]["message"], r.text
    assert requests_total(engine) == before


@pytest.mark.parametrize("route", ROUTES)
def test_an_exception_after_submit_cancels_the_generation(
    env: tuple[str, Engine], route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = env
    path, base = ROUTES[route]

    class Broken(runner.GenerationResponse):
        def __init__(self, *a: Any, **kw: Any) -> None:
            raise RuntimeError("a bug between submit and the response")

    monkeypatch.setattr(runner, "GenerationResponse", Broken)
    before = requests_total(engine)
    body = base | {"max_tokens": 400} if route != "responses" else base
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 500
    deadline = time.monotonic() + 30  # the stats snapshot follows the engine's step
    while requests_total(engine) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert requests_total(engine) == before + 1  # it was submitted ...
    stats = assert_at_rest(engine)  # ... and cancelled: nothing runs, no block is held
    assert stats.running == 0 and stats.waiting == 0
