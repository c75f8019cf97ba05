"""Claude Code's request shapes (tests/fixtures/claude-code) against the real server.

The scripted test model (tests/scripted_model.py) runs through the real engine;
the fixtures are sent as Claude Code sends them (``?beta=true``, its headers).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from live_server import registry_for, serve, sse_events
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.protocol.anthropic import TITLE_MAX_TOKENS
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

TOKEN = "claude-code-token"
FIXTURES = Path(__file__).parent / "fixtures" / "claude-code"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """One scripted engine behind a Claude Code-style configuration (``--default-model
    --clamp-max-tokens``) and behind a strict one (no default, no clamping)."""
    engine = Engine(scripted_model(), EngineConfig(num_blocks=1024))
    out: dict[str, str] = {}
    try:
        with (
            serve(
                registry_for({"scripted": engine}, default_model=""),
                ServerConfig(api_token=TOKEN, clamp_max_tokens=True),
            ) as cc,
            serve(registry_for({"scripted": engine}), ServerConfig(api_token=TOKEN)) as strict,
        ):
            out["cc"], out["strict"] = cc.url, strict.url
            yield out
        assert_at_rest(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def cc_server(servers: dict[str, str]) -> str:
    return servers["cc"]


@pytest.fixture(scope="module")
def long_server() -> Iterator[str]:
    """Claude Code's settings over a context that holds its whole prompt (the tiny
    tokenizer spends ~1.2 tokens per character of its redacted filler)."""
    engine = Engine(scripted_model(context_length=131072), EngineConfig(num_blocks=12000))
    try:
        with serve(
            registry_for({"scripted": engine}, default_model=""),
            ServerConfig(api_token=TOKEN, clamp_max_tokens=True),
        ) as srv:
            yield srv.url
        assert_at_rest(engine)
    finally:
        engine.close()


CC_HEADERS = {
    "x-api-key": TOKEN,
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
}


ALL_FIXTURES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def usage_sum(usage: dict[str, Any]) -> int:
    """What Claude Code's context meter adds up."""
    return int(
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_claude_code_fixtures_are_served(long_server: str, name: str, stream: bool) -> None:
    """Every request shape Claude Code sends: 200, and count_tokens == the usage sum."""
    body = fixture(name)
    body.setdefault("max_tokens", 64)  # the count_tokens captures carry none
    body["stream"] = stream
    ct = httpx.post(
        long_server + "/v1/messages/count_tokens?beta=true",
        json=body,
        headers=CC_HEADERS,
        timeout=120,
    )
    assert ct.status_code == 200, ct.text
    r = httpx.post(
        long_server + "/v1/messages?beta=true", json=body, headers=CC_HEADERS, timeout=120
    )
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        names = [n for n, _ in events]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        start = events[0][1]["message"]["usage"]
        final = next(p for n, p in events if n == "message_delta")["usage"]
        assert usage_sum(start) == usage_sum(final) == ct.json()["input_tokens"]
        assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]
    else:
        assert r.json()["type"] == "message"
        assert usage_sum(r.json()["usage"]) == ct.json()["input_tokens"]


def test_system_turns_stay_in_place(long_server: str) -> None:
    """Claude Code's environment block (a system turn after the first user turn)
    is rendered where it was sent, not hoisted into the leading system prompt."""
    body = fixture("cc-2.1.332-system-turn-12-tools")
    env_text = body["messages"][1]["content"][0]["text"]
    from mlx_cairn.protocol.anthropic import parse_messages_request

    chat = parse_messages_request(body, max_tokens_limit=200000).chat
    assert [m.role for m in chat.messages] == ["system", "user", "system"]
    assert chat.messages[2].content == env_text
    text = scripted_model().prompt(chat).text
    user_at = text.index("Say hello")
    assert text.index(env_text) > user_at
    assert text.rindex("<|im_start|>system") > user_at


def test_claude_code_count_tokens_matches_usage(cc_server: str) -> None:
    ct = httpx.post(
        cc_server + "/v1/messages/count_tokens?beta=true",
        json=fixture("count_tokens"),
        headers=CC_HEADERS,
        timeout=30,
    )
    assert ct.status_code == 200
    full = fixture("count_tokens") | {"max_tokens": 64}
    for _ in range(2):  # cold, then mostly from the prefix cache
        r = httpx.post(
            cc_server + "/v1/messages?beta=true", json=full, headers=CC_HEADERS, timeout=30
        )
        assert usage_sum(r.json()["usage"]) == ct.json()["input_tokens"]
    assert r.json()["usage"]["cache_read_input_tokens"] > 0


def test_without_clamping_claude_code_max_tokens_is_a_context_400(servers: dict[str, str]) -> None:
    b = fixture("agent_turn") | {"model": "scripted"}
    r = httpx.post(
        servers["strict"] + "/v1/messages?beta=true", json=b, headers=CC_HEADERS, timeout=30
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "context" in err["message"] and "--clamp-max-tokens" in err["message"]
    # and claude-* names need --default-model or an alias there
    r = httpx.post(
        servers["strict"] + "/v1/messages",
        json=fixture("quota_probe"),
        headers=CC_HEADERS,
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_title_requests_are_capped(cc_server: str) -> None:
    b = fixture("title")
    b["messages"][0]["content"] = say("word " * 100)
    r = httpx.post(cc_server + "/v1/messages", json=b, headers=CC_HEADERS, timeout=30).json()
    assert r["stop_reason"] == "max_tokens"
    assert r["usage"]["output_tokens"] == TITLE_MAX_TOKENS


def test_billing_header_nonce_does_not_break_prefix_reuse(cc_server: str) -> None:
    a = fixture("agent_turn")
    b = fixture("agent_turn")
    b["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=ffffffffffff;"
    )
    a["stream"] = b["stream"] = False
    a["max_tokens"] = b["max_tokens"] = 8
    httpx.post(cc_server + "/v1/messages", json=a, headers=CC_HEADERS, timeout=30)
    r = httpx.post(cc_server + "/v1/messages", json=b, headers=CC_HEADERS, timeout=30)
    assert r.headers["x-session-cache"] == "prefix_hit"
    assert r.json()["usage"]["cache_read_input_tokens"] > 200


def test_agent_turn_with_thinking_and_a_tool_call(cc_server: str) -> None:
    b = fixture("agent_turn")
    script = (
        "<think>Read the README first.</think>\n\n"
        '<tool_call>{"name": "Read", "arguments": {"file_path": "README.md"}}</tool_call>'
    )
    b["messages"][0]["content"][1]["text"] = say(script)
    r = httpx.post(cc_server + "/v1/messages?beta=true", json=b, headers=CC_HEADERS, timeout=30)
    events = sse_events(r.text)
    starts = [p["content_block"] for n, p in events if n == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "tool_use"]  # no whitespace text block
    assert starts[1]["name"] == "Read" and starts[1]["id"].startswith("toolu_")
    deltas = [p["delta"] for n, p in events if n == "content_block_delta"]
    thinking = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    assert thinking == "Read the README first."
    tool_json = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert len(tool_json) == 1 and json.loads(tool_json[0]) == {"file_path": "README.md"}
    final = next(p for n, p in events if n == "message_delta")
    assert final["delta"]["stop_reason"] == "tool_use"
