"""GET /metrics: Prometheus text that parses, behind the auth gate, counting what happened."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

TOKEN = "metrics-secret-token"
AUTH = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def server():
    engine = Engine(scripted_model(), EngineConfig(num_blocks=96, block_size=8))
    registry = registry_for({"scripted": engine})
    with serve(registry, ServerConfig(api_token=TOKEN)) as srv:
        srv.engine = engine
        yield srv
    engine.close()


def msg(text: str, *, stream: bool = False, system: str | None = None, **kw) -> dict:
    body = {
        "model": "scripted",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        **kw,
    }
    if system is not None:
        body["system"] = system
    return body


def test_metrics_is_behind_the_gate(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        anon = c.get("/metrics")
        wrong = c.get("/metrics", headers={"x-api-key": "nope"})
        ok = c.get("/metrics", headers=AUTH)
    for r in (anon, wrong):
        assert r.status_code == 401
        assert "error" in r.json()
    assert ok.status_code == 200
    assert ok.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_metrics_count_requests_generations_and_blocks(server):
    long_system = "You are a careful assistant. " * 12
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        before = c.get("/metrics").text
        r1 = c.post("/v1/messages", json=msg(say("alpha beta gamma"), system=long_system))
        r2 = c.post("/v1/messages", json=msg(say("delta"), system=long_system, stream=True))
        r3 = c.post("/v1/messages", json={"model": "scripted", "messages": []})
        r4 = c.post("/v1/messages", json=msg("x") | {"model": "no-such-model"})
        r5 = c.get("/no/such/path/" + "x" * 50)
        r6 = c.request("BREW", "/v1/messages")
        assert_at_rest(server.engine)
        after = c.get("/metrics").text
    assert (r1.status_code, r2.status_code, r3.status_code, r4.status_code) == (200, 200, 400, 404)
    assert r5.status_code == 404
    assert "event: message_stop" in r2.text

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return samples(after).get(key, 0.0) - samples(before).get(key, 0.0)

    route = "/v1/messages"
    assert delta("cairn_http_requests_total", route=route, method="POST", status="200") == 2
    assert delta("cairn_http_requests_total", route=route, method="POST", status="400") == 1
    assert delta("cairn_http_requests_total", route=route, method="POST", status="404") == 1
    # Unknown paths share one label: a hostile URL cannot grow the label set.
    assert delta("cairn_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert not any("x" * 50 in str(k) for k in samples(after))
    assert r6.status_code >= 400
    assert not any("BREW" in str(k) for k in samples(after))
    assert delta("cairn_generations_total", model="scripted", outcome="end_turn") == 2
    assert delta("cairn_time_to_first_token_seconds_count", model="scripted") == 2
    assert delta("cairn_time_per_output_token_seconds_count", model="scripted") == 2

    out1 = r1.json()["usage"]["output_tokens"]
    st = server.engine.stats()
    assert value(after, "cairn_generated_tokens_total", model="scripted") == st.generated_tokens
    assert delta("cairn_generated_tokens_total", model="scripted") >= out1 + 1
    # The second request shared the long system prompt: real prefix hits are visible.
    assert delta("cairn_prefix_cache_hit_tokens_total", model="scripted") > 0
    assert value(after, "cairn_model_loaded", model="scripted") == 1
    assert value(after, "cairn_queue_depth", model="scripted") == 0
    assert value(after, "cairn_running_sequences", model="scripted") == 0
    free = value(after, "cairn_kv_blocks", model="scripted", state="free")
    in_use = value(after, "cairn_kv_blocks", model="scripted", state="in_use")
    cached = value(after, "cairn_kv_blocks", model="scripted", state="cached")
    total = value(after, "cairn_kv_blocks_total", model="scripted")
    assert in_use == 0 and free == total and 0 < cached <= total


def test_metrics_of_a_model_that_failed_to_load(server):
    from mlx_cairn.api import ModelRegistry

    def loader(source):
        raise RuntimeError("weights are corrupt")

    registry = ModelRegistry(["broken"], loader=loader)
    with (
        serve(registry, ServerConfig(api_token=TOKEN)) as srv,
        httpx.Client(base_url=srv.url, timeout=30, headers=AUTH) as c,
    ):
        r = c.post("/v1/messages", json=msg("hi") | {"model": "broken"})
        text = c.get("/metrics").text
    assert r.status_code == 500
    assert value(text, "cairn_model_loaded", model="broken") == 0
    assert ("cairn_queue_depth", (("model", "broken"),)) not in samples(text)
