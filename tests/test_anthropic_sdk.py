"""Through the official ``anthropic`` SDK: streamed-and-accumulated == non-streamed.

The scripted test model (tests/scripted_model.py) makes the model say exactly
what each case needs (reasoning, tool calls, stop sequences) while the
tokenizer, template, engine, Rust text pipeline and HTTP server are the real
ones. One test runs the real embedded SmolLM2 for free text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from live_server import registry_for, serve
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[anthropic.Anthropic, Engine]]:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=1024))
    try:
        with (
            serve(registry_for({"scripted": engine})) as srv,
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ):
            yield client, engine
    finally:
        engine.close()


def normalized(msg: Any) -> dict[str, Any]:
    """A Message as a dict without what legitimately differs between two runs."""
    d = msg.model_dump()
    d.pop("id")
    for block in d["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    usage = d["usage"]
    usage.pop("timings", None)  # wall-clock figures
    # The second run hits the prefix cache: the split differs, the prompt does not.
    usage["prompt_tokens"] = usage.pop("input_tokens") + usage.pop("cache_read_input_tokens")
    return d


def both(client: anthropic.Anthropic, **kw: Any) -> tuple[Any, Any]:
    # This SDK has no sampling parameters any more; the server still honours them.
    sampling = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if sampling:
        kw["extra_body"] = sampling
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    created = client.messages.create(**kw)
    assert normalized(streamed) == normalized(created)
    return streamed, created


def tool_call(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def canonical_call(name: str, args: dict[str, Any]) -> str:
    """A Hermes call exactly as the forced-choice grammar writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Please answer. {say(text)}"}]


CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("Hello world", {}, [("text", "Hello world")]),
    (
        "héllo wörld — ✓ 日本語 😀",
        {"temperature": 0.7, "top_p": 0.9, "top_k": 5},
        [("text", "héllo wörld — ✓ 日本語 😀")],
    ),
    (
        "<think>plan it</think>Answer",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        [("thinking", "plan it"), ("text", "Answer")],
    ),
    ("<think>plan it</think>Answer", {"thinking": {"type": "disabled"}}, None),
    (
        "Sure." + tool_call("get_weather", {"city": "NYC"}),
        {"tools": [WEATHER]},
        [("text", "Sure."), ("tool_use", {"city": "NYC"})],
    ),
    (
        # A forced choice is constrained to the family's canonical syntax: the
        # script says it that way (one call per tag, newline-separated).
        canonical_call("get_weather", {"city": "A"})
        + "\n"
        + canonical_call("get_weather", {"city": "B"}),
        {"tools": [WEATHER], "tool_choice": {"type": "any"}},
        [("tool_use", {"city": "A"}), ("tool_use", {"city": "B"})],
    ),
    ("Sure." + tool_call("get_weather", {"city": "NYC"}), {}, None),  # no tools: text only
    ("Hello STOP world", {"stop_sequences": ["STOP", "zzz"]}, [("text", "Hello ")]),
    (
        "Hi END " + tool_call("get_weather", {"city": "X"}),
        {"stop_sequences": ["END"], "tools": [WEATHER]},
        [("text", "Hi ")],
    ),
    ("one two three four five six seven eight", {"max_tokens": 4}, None),
]


@pytest.mark.parametrize(("script", "opts", "expected"), CASES)
def test_stream_equals_create(
    server: Any, script: str, opts: dict[str, Any], expected: Any
) -> None:
    client, _ = server
    kw = {"model": "scripted", "max_tokens": 200, "temperature": 0, "messages": ask(script), **opts}
    msg, _ = both(client, **kw)
    blocks = [
        (b.type, b.text if b.type == "text" else b.thinking if b.type == "thinking" else b.input)
        for b in msg.content
    ]
    if expected is not None:
        assert blocks == expected
    types = [b.type for b in msg.content]
    if "tools" not in opts:
        assert "tool_use" not in types
    if "thinking" not in types:
        assert all(t != "thinking" for t in types)
    if "stop_sequences" in opts:
        assert msg.stop_reason == "stop_sequence"
        assert msg.stop_sequence in opts["stop_sequences"]
    elif "tool_use" in types:
        assert msg.stop_reason == "tool_use"
    elif opts.get("max_tokens") == 4:
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    else:
        assert msg.stop_reason == "end_turn"


def test_thinking_off_keeps_reasoning_out_of_sight(server: Any) -> None:
    client, _ = server
    msg = client.messages.create(
        model="scripted", max_tokens=64, messages=ask("<think>secret</think>Answer")
    )
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text.endswith("Answer")  # type: ignore[union-attr]


def test_count_tokens_equals_usage(server: Any) -> None:
    client, _ = server
    for kw in (
        {"messages": ask("x")},
        {"messages": ask("y"), "system": "Be brief.", "tools": [WEATHER]},
        {"messages": ask("z"), "thinking": {"type": "enabled", "budget_tokens": 2000}},
    ):
        n = client.messages.count_tokens(model="scripted", **kw).input_tokens
        for _ in range(2):  # cold, then served partly from the prefix cache
            u = client.messages.create(model="scripted", max_tokens=16, **kw).usage
            assert u.input_tokens > 0
            assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        assert u.cache_read_input_tokens > 0


def test_prefix_reuse_is_reported(server: Any) -> None:
    client, engine = server
    system = "You are a meticulous assistant who double-checks every answer. " * 20
    kw = {"model": "scripted", "max_tokens": 16, "system": system}
    first = client.messages.with_raw_response.create(messages=ask("first"), **kw)
    second = client.messages.with_raw_response.create(messages=ask("second"), **kw)
    assert first.headers["x-session-cache"] == "fresh"
    assert second.headers["x-session-cache"] == "prefix_hit"
    msg = second.parse()
    assert msg.usage.cache_read_input_tokens > 0
    assert int(second.headers["x-cached-tokens"]) == msg.usage.cache_read_input_tokens
    # Anthropic's split: input_tokens is what was not read from the cache.
    total = client.messages.count_tokens(model="scripted", messages=ask("second"), system=system)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == total.input_tokens
    assert 0 < msg.usage.input_tokens < msg.usage.cache_read_input_tokens
    assert_at_rest(engine)


def test_cache_salt_separates_prefixes(server: Any) -> None:
    """``cache_salt`` (an extra field): a different salt reads nothing from the cache."""
    client, engine = server
    system = "You answer in one short sentence and never more than that. " * 20
    kw = {"model": "scripted", "max_tokens": 8, "system": system, "messages": ask("salted")}

    def read(salt: str) -> int:
        msg = client.messages.create(extra_body={"cache_salt": salt}, **kw)
        return msg.usage.cache_read_input_tokens

    assert read("tenant-a") == 0
    assert read("tenant-b") == 0
    assert read("tenant-a") > 0
    with pytest.raises(anthropic.BadRequestError, match="cache_salt"):
        client.messages.create(extra_body={"cache_salt": ""}, **kw)
    assert_at_rest(engine)


# ------------------------------------------------------------------ property

SAFE = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "Zs", "P"], exclude_characters="<>"),
    min_size=1,
    max_size=12,
)


@st.composite
def scripts(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    parts: list[str] = []
    thinking = draw(st.booleans())
    if draw(st.booleans()):
        parts.append("<think>" + draw(SAFE) + "</think>")
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 3)) == 0:
            args = draw(
                st.dictionaries(
                    st.sampled_from(["a", "city", "n"]),
                    st.one_of(st.integers(-9, 99), SAFE),
                    max_size=2,
                )
            )
            parts.append(tool_call("get_weather", args))
        else:
            parts.append(draw(SAFE))
    text = "".join(parts)
    opts: dict[str, Any] = {}
    if draw(st.booleans()):
        opts["tools"] = [WEATHER]
    if thinking:
        opts["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    if draw(st.booleans()):
        i = draw(st.integers(0, len(text) - 1))
        stop = text[i : i + draw(st.integers(1, 3))]
        if "<" not in stop and ">" not in stop and stop.strip():
            opts["stop_sequences"] = [stop]
    opts["max_tokens"] = draw(st.sampled_from([3, 40, 300]))
    return text, opts


@given(scripts())
def test_random_scripts_stream_equals_create(server: Any, case: tuple[str, dict[str, Any]]) -> None:
    client, _ = server
    text, opts = case
    msg, _ = both(client, model="scripted", temperature=0, messages=ask(text), **opts)
    types = [b.type for b in msg.content]
    if "tools" not in opts:
        assert "tool_use" not in types
    if "thinking" not in opts:
        assert "thinking" not in types
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    if msg.stop_reason == "stop_sequence":
        assert msg.stop_sequence == opts["stop_sequences"][0]


# ------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_default_model_free_text() -> None:
    from mlx_cairn.models import load

    engine = Engine(load(None), EngineConfig(kv_cache_gb=0.25))
    try:
        with (
            serve(registry_for({"SmolLM2-135M-Instruct": engine})) as srv,
            anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ):
            kw = {
                "model": "SmolLM2-135M-Instruct",
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
            msg, _ = both(client, **kw)
            assert msg.content and msg.content[0].text.strip()  # type: ignore[union-attr]
            n = client.messages.count_tokens(
                model=kw["model"], messages=kw["messages"]
            ).input_tokens
            assert n == msg.usage.input_tokens
        assert_at_rest(engine)
    finally:
        engine.close()
