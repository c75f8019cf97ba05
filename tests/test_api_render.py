"""What routers ask workers for (issue 37, docs/routers.md): vLLM's render routes
(``POST /v1/chat/completions/render`` ...) answer the prompt ids the engine prefills
for the same body, bad input is a 400 in the dialect's envelope, and sglang's
``/model_info`` and ``/server_info`` describe the served model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from live_server import registry_for
from mlx_cairn.api import ServerConfig, create_app
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.types import ChatRequest, Message, RawPrompt
from scripted_model import scripted_model


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(
        scripted_model("scripted"), EngineConfig(num_blocks=64, block_size=16, max_queue=8)
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    app = create_app(registry_for({"scripted": engine}), ServerConfig())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


TURNS = [
    ("system", "You are terse."),
    ("user", "hello there"),
    ("assistant", "hi"),
    ("user", "and again"),
]
MESSAGES = [{"role": r, "content": c} for r, c in TURNS]
#: Defaults vllm-router adds to the body it sends to the render route.
ROUTER_FIELDS = {
    "no_stop_trim": False,
    "separate_reasoning": True,
    "skip_special_tokens": True,
    "continue_final_message": False,
}


def test_chat_render_gives_the_ids_a_generation_prefills(
    client: TestClient, engine: Engine
) -> None:
    body = {"model": "scripted", "messages": MESSAGES, "max_tokens": 3, **ROUTER_FIELDS}
    r = client.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "scripted"
    ids = r.json()["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids)
    want = engine.prepare(ChatRequest([Message(r, c) for r, c in TURNS], max_tokens=3))
    assert ids == list(want.prompt_ids)
    g = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert g.status_code == 200, g.text
    assert g.json()["usage"]["prompt_tokens"] == len(ids)
    # A longer conversation renders to ids that extend these (what a router matches on).
    longer = [*MESSAGES, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    r2 = client.post("/v1/chat/completions/render", json={**body, "messages": longer})
    assert r2.status_code == 200, r2.text
    assert r2.json()["token_ids"][: len(ids) - 3] == ids[: len(ids) - 3]
    assert engine.stats().requests_total == 1  # rendering generates nothing


def test_completions_render_one_or_several_prompts(client: TestClient, engine: Engine) -> None:
    r = client.post(
        "/v1/completions/render", json={"model": "scripted", "prompt": "abc def", "n": 2}
    )
    assert r.status_code == 200, r.text
    want = engine.prepare(ChatRequest([], raw=RawPrompt(text="abc def"), max_tokens=4)).prompt_ids
    assert r.json()["token_ids"] == list(want)
    r = client.post(
        "/v1/completions/render", json={"model": "scripted", "prompt": ["abc def", "ghi"]}
    )
    assert r.status_code == 200, r.text
    assert [len(x["token_ids"]) > 0 for x in r.json()] == [True, True]
    assert r.json()[0]["token_ids"] == list(want)
    g = client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "abc def", "max_tokens": 2}
    )
    assert g.json()["usage"]["prompt_tokens"] == len(want)


def test_messages_render_matches_the_anthropic_usage(client: TestClient) -> None:
    body = {
        "model": "scripted",
        "max_tokens": 3,
        "system": "You are terse.",
        "messages": MESSAGES[1:],
    }
    r = client.post("/v1/messages/render", json=body)
    assert r.status_code == 200, r.text
    n = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert len(r.json()["token_ids"]) == n


@pytest.mark.parametrize(
    ("path", "body", "envelope"),
    [
        ("/v1/chat/completions/render", {"model": "scripted", "messages": 3}, "openai"),
        ("/v1/chat/completions/render", {"model": "scripted", "messages": []}, "openai"),
        ("/v1/chat/completions/render", {"model": "nope", "messages": MESSAGES}, "openai"),
        ("/v1/completions/render", {"model": "scripted", "prompt": {"x": 1}}, "openai"),
        ("/v1/messages/render", {"model": "scripted", "messages": "hi"}, "anthropic"),
    ],
)
def test_render_refuses_bad_input_in_the_dialect_envelope(
    client: TestClient, path: str, body: dict[str, object], envelope: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    if envelope == "openai":
        assert err["message"] and "type" in err
    else:
        assert r.json()["type"] == "error" and err["type"].endswith("_error")
    assert client.post(path, content=b"{not json").status_code == 400


def test_sglang_worker_info(client: TestClient, engine: Engine) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == "scripted"
        assert info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["model_path"] == "scripted"
        assert info["page_size"] == engine.block_size
