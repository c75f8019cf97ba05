"""Structured-output modes of the official SDKs against the server on the embedded model:
openai ``chat.completions.parse`` and ``responses.parse``, forced tool choice in both
OpenAI dialects, and Anthropic tools with ``tool_choice`` and ``output_config.format``.
Streamed and non-streamed answers are equal."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from live_server import registry_for, serve
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Person(BaseModel):
    name: str
    age: int


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def live(default_model) -> Iterator[dict[str, Any]]:
    engine = Engine(default_model, EngineConfig(max_batch=8, num_blocks=1024))
    try:
        with serve(registry_for({"smol": engine})) as srv:
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            an = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
            yield {"openai": oa, "anthropic": an, "engine": engine}
            oa.close()
            an.close()
        assert_at_rest(engine)
    finally:
        engine.close()


def test_chat_completions_parse(live):
    client: openai.OpenAI = live["openai"]
    for temperature in (0.0, 0.8):
        done = client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": "Ann is 30 years old. Give her name and age."}],
            response_format=Person,
            temperature=temperature,
            seed=4,
            max_tokens=60,
        )
        person = done.choices[0].message.parsed
        assert isinstance(person, Person), done
        assert done.choices[0].finish_reason == "stop"


def test_chat_json_object_and_stream_equals_create(live):
    client: openai.OpenAI = live["openai"]
    kw: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": 80,
    }
    # Each under a salt of its own: no cached prefix, the same computation twice.
    whole = client.chat.completions.create(**kw, extra_body={"cache_salt": uuid.uuid4().hex})
    text = whole.choices[0].message.content or ""
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            **kw, stream=True, extra_body={"cache_salt": uuid.uuid4().hex}
        )
        if c.choices
    )
    assert streamed == text
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_chat_forced_tool_choice(live):
    client: openai.OpenAI = live["openai"]
    for choice, want in (
        ("required", None),
        ({"type": "function", "function": {"name": "add"}}, "add"),
    ):
        out = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
            tools=OPENAI_TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
        )
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls", out
        calls = choice0.message.tool_calls or []
        assert len(calls) == 1
        fn = calls[0].function  # type: ignore[union-attr]
        assert want is None or fn.name == want
        schema = next(
            t["function"]["parameters"] for t in OPENAI_TOOLS if t["function"]["name"] == fn.name
        )
        jsonschema.validate(json.loads(fn.arguments), schema)


def test_responses_parse(live):
    client: openai.OpenAI = live["openai"]
    done = client.responses.parse(
        model="smol",
        input="Ann is 30 years old. Give her name and age.",
        text_format=Person,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(done.output_parsed, Person), done
    assert done.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_responses_forced_tool(live):
    client: openai.OpenAI = live["openai"]
    tools = [
        {"type": "function", "name": "get_weather", "description": "Weather for a city",
         "parameters": WEATHER_SCHEMA, "strict": True},
    ]  # fmt: skip
    out = client.responses.create(
        model="smol",
        input="Hello there",
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    calls = [o for o in out.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)  # type: ignore[union-attr]


def test_anthropic_forced_tools_stream_equals_create(live):
    client: anthropic.Anthropic = live["anthropic"]
    tools = [
        {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA},
        {"name": "add", "description": "Add two numbers", "input_schema": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"]}},
    ]  # fmt: skip
    for choice, want in (
        ({"type": "any", "disable_parallel_tool_use": True}, None),
        ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, "get_weather"),
    ):
        kw: dict[str, Any] = {
            "model": "smol",
            "max_tokens": 80,
            "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tools": tools,
            "tool_choice": choice,
        }
        # Each under a salt of its own: no cached prefix, the same computation twice.
        msg = client.messages.create(
            **kw, extra_body={"temperature": 0, "cache_salt": uuid.uuid4().hex}
        )
        with client.messages.stream(
            **kw, extra_body={"temperature": 0, "cache_salt": uuid.uuid4().hex}
        ) as s:
            streamed = s.get_final_message()
        assert msg.stop_reason == "tool_use" == streamed.stop_reason
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert len(uses) == 1
        assert [b.model_dump(exclude={"id"}) for b in msg.content] == [
            b.model_dump(exclude={"id"}) for b in streamed.content
        ]
        assert want is None or uses[0].name == want
        schema = next(t["input_schema"] for t in tools if t["name"] == uses[0].name)
        jsonschema.validate(uses[0].input, schema)


def test_anthropic_output_config_format(live):
    client: anthropic.Anthropic = live["anthropic"]
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}},
        "required": ["title"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="smol",
        max_tokens=60,
        messages=[
            {"role": "user", "content": "Give this chat a short title: we talked about tides."}
        ],
        extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
            "temperature": 0,
        },
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    jsonschema.validate(json.loads(text), schema)
