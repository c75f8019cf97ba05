"""Engine Events through the Rust TextPipeline: stops, reasoning, tool calls, stop reasons."""

from __future__ import annotations

import json

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    Tool,
    ToolCall,
)
from scripted_model import say, scripted_model

TIMEOUT = 60.0
WEATHER = Tool("get_weather", "Weather of a city", {"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def engine():
    with closing_at_rest(Engine(scripted_model(), EngineConfig(num_blocks=512, block_size=8))) as e:
        yield e


def run(engine: Engine, text: str, **kw) -> tuple[list, Done]:
    kw.setdefault("max_tokens", 200)
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    req = ChatRequest(messages=[Message("user", say(text))], **kw)
    events = list(engine.generate_sync(req, timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return events[:-1], events[-1]


def text_of(events: list, kind: type = TextDelta) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_plain_text_end_turn(engine):
    events, done = run(engine, "Hello there, world!")
    assert text_of(events) == "Hello there, world!"
    assert done.stop_reason == "end_turn" and done.matched_stop is None
    assert done.usage.output_tokens > 0


def test_stop_sequence_cuts_the_text(engine):
    events, done = run(engine, "one two THREE four five", stop=["nope", "THREE"])
    assert text_of(events) == "one two "
    assert done.stop_reason == "stop_sequence" and done.matched_stop == "THREE"


def test_max_tokens(engine):
    events, done = run(engine, "a b c d e f g h i j k l m n o p", max_tokens=3)
    assert done.stop_reason == "max_tokens"
    assert done.usage.output_tokens == 3
    assert text_of(events)  # some text came out


def test_tool_call_with_tools(engine):
    body = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    events, done = run(engine, "Let me check." + body, tools=[WEATHER])
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")
    assert text_of(events) == "Let me check."
    assert done.stop_reason == "tool_use"


def test_tool_call_text_without_tools_stays_text(engine):
    body = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    events, done = run(engine, body)
    assert not [e for e in events if isinstance(e, ToolCall)]
    assert text_of(events) == body
    assert done.stop_reason == "end_turn"


def test_reasoning_is_split(engine):
    events, done = run(engine, "<think>plan it</think>Answer.", reasoning=True)
    assert text_of(events, ReasoningDelta) == "plan it"
    assert text_of(events) == "Answer."
    assert done.stop_reason == "end_turn"
