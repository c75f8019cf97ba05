"""Multi-turn prefix reuse and usage as the Anthropic API defines it, through the official SDK.

The bar: at temperature 0, turn N+1's ``cache_read_input_tokens`` covers turn
N's prompt and answer, down to the last full KV block (the final sampled token
is never fed to the model, so it has no KV of its own).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from live_server import registry_for, serve, sse_events, wait_until
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

BLOCK = 16
SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 4
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def covered(prompt: int, output: int) -> int:
    """Tokens of the previous turn the next one can read from the cache."""
    return (prompt + output - 1) // BLOCK * BLOCK


def prompt_tokens(usage: Any) -> int:
    return int(
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )


def converse(
    client: anthropic.Anthropic, model: str, turns: list[Any], **kw: Any
) -> list[tuple[Any, Any]]:
    """Run ``turns`` (user contents) as one conversation; (message, count_tokens) per turn."""
    messages: list[dict[str, Any]] = []
    out = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        req = {"model": model, "system": SYSTEM, "messages": messages, **kw}
        count = client.messages.count_tokens(**{k: v for k, v in req.items() if k != "max_tokens"})
        msg = client.messages.create(**req)
        out.append((msg, count.input_tokens))
        messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
        if msg.stop_reason == "tool_use":
            tool = next(b for b in msg.content if b.type == "tool_use")
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool.id, "content": "sunny, 21 C"}
                    ],
                }
            )
    return out


def assert_each_turn_reuses_the_last(turns: list[tuple[Any, Any]]) -> None:
    for (prev, _), (msg, count) in itertools.pairwise(turns):
        assert prompt_tokens(msg.usage) == count  # the three fields add up to count_tokens
        p, o = prompt_tokens(prev.usage), prev.usage.output_tokens
        assert msg.usage.cache_read_input_tokens >= covered(p, o), (p, o, msg.usage)
        assert msg.usage.cache_read_input_tokens >= 0.95 * (p + o) - BLOCK
        assert msg.usage.input_tokens == count - msg.usage.cache_read_input_tokens


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[anthropic.Anthropic, str]]:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=2048, block_size=BLOCK))
    try:
        with (
            serve(registry_for({"scripted": engine})) as srv,
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ):
            yield client, srv.url
        assert_at_rest(engine)
    finally:
        engine.close()


def test_qwen3_style_conversation_with_a_tool_call_reuses_every_turn(scripted: Any) -> None:
    """Qwen3-style template (Hermes tool calls): the answer and the tool call of
    each turn are re-rendered to exactly the ids that were generated."""
    client, _ = scripted
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    turns = converse(
        client,
        "scripted",
        [
            say("Let me look that up for you, one moment please."),
            say(call),
            say("It is sunny in Paris today, about twenty-one degrees."),
            say("Anything else? I am happy to help with more questions."),
        ],
        max_tokens=200,
        tools=[WEATHER],
        # Reasoning left to the model (a Qwen3-2507-style answer without a think
        # block); with reasoning off the template prefills an empty think block
        # that it drops from history (see the README).
        thinking={"type": "adaptive"},
    )
    assert turns[1][0].stop_reason == "tool_use"
    assert_each_turn_reuses_the_last(turns)


def test_message_start_carries_the_real_cache_hit(scripted: Any) -> None:
    client, url = scripted
    body = {
        "model": "scripted",
        "max_tokens": 32,
        "system": "A system prompt no other test sends. " * 8,
        "messages": [{"role": "user", "content": say("first answer")}],
    }
    cold = client.messages.create(**body)
    assert cold.usage.cache_read_input_tokens == 0
    r = httpx.post(url + "/v1/messages", json=body | {"stream": True}, timeout=30)
    events = sse_events(r.text)
    start = events[0][1]["message"]["usage"]
    final = next(p for n, p in events if n == "message_delta")["usage"]
    assert start["cache_read_input_tokens"] > 0
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]
    assert (
        start["input_tokens"]
        == final["input_tokens"]
        == prompt_tokens(cold.usage) - (start["cache_read_input_tokens"])
    )
    with client.messages.stream(**body) as s:  # the SDK's accumulator agrees
        msg = s.get_final_message()
    assert prompt_tokens(msg.usage) == prompt_tokens(cold.usage)
    assert json.loads(msg.model_dump_json())["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.slow
def test_default_model_conversation_reuses_every_turn(default_model: Any) -> None:
    """The embedded SmolLM2 at temperature 0: each answer is in the cache for the next turn."""
    engine = Engine(default_model, EngineConfig(kv_cache_gb=0.25, block_size=BLOCK))
    try:
        with (
            serve(registry_for({"smol": engine})) as srv,
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ):
            turns = converse(
                client,
                "smol",
                ["Write two sentences about the sea.", "And two about rivers?", "Thanks!"],
                max_tokens=40,
                extra_body={"temperature": 0},
            )
        assert all(m.usage.output_tokens > 0 for m, _ in turns)
        assert_each_turn_reuses_the_last(turns)
        assert_at_rest(engine)
    finally:
        engine.close()


def test_pings_keep_a_queued_stream_alive_until_message_start() -> None:
    """message_start waits for admission; pings come first and the SDK accepts them."""
    engine = Engine(scripted_model(), EngineConfig(num_blocks=512, block_size=BLOCK, max_batch=1))
    engine._fault_hook = lambda: time.sleep(0.01)  # a slow model: ~100 steps per second
    try:
        with (
            serve(registry_for({"scripted": engine}), ServerConfig(ping_interval=0.02)) as srv,
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ):
            busy = threading.Thread(
                target=client.messages.create,
                kwargs={
                    "model": "scripted",
                    "max_tokens": 400,
                    "messages": [{"role": "user", "content": say("word " * 60)}],
                },
            )
            busy.start()
            wait_until(lambda: engine.stats().running == 1, "the busy request never ran", 30)
            body = {
                "model": "scripted",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": say("queued")}],
            }
            r = httpx.post(srv.url + "/v1/messages", json=body | {"stream": True}, timeout=60)
            names = [n for n, _ in sse_events(r.text)]
            first = names.index("message_start")
            assert first > 0 and set(names[:first]) == {"ping"}
            with client.messages.stream(**body) as s:
                assert s.get_final_text() == "queued"
            busy.join(60)
        assert_at_rest(engine)
    finally:
        engine.close()
