"""Grammar-constrained decoding on the embedded SmolLM2: structured outputs always parse
and validate, forced tool choices always call the right tool with valid input."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.engine_checks import assert_at_rest, submit_together
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Message,
    OutputFormat,
    SamplingParams,
    TextDelta,
    Tool,
    ToolCall,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TIMEOUT = 300.0

#: Varied shapes: scalars, enums, const, nesting, arrays with bounds, $defs/$ref,
#: anyOf, optional fields, formats, additionalProperties.
SCHEMAS: list[tuple[str, dict]] = [
    ("A person named Ann, 30 years old.", {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("Is the sky blue?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"], "additionalProperties": False}),
    ("Pick a colour.", {
        "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"], "additionalProperties": False}),
    ("List three fruits.", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string"},
                                  "minItems": 3, "maxItems": 3}},
        "required": ["fruits"], "additionalProperties": False}),
    ("A point on a plane.", {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False}),
    ("A book with its author.", {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "author": {"type": "object",
                       "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                       "required": ["first", "last"], "additionalProperties": False}},
        "required": ["title", "author"], "additionalProperties": False}),
    ("Rate this film from 1 to 5.", {
        "type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["stars"], "additionalProperties": False}),
    ("Give a version.", {
        "type": "object", "properties": {"kind": {"const": "version"}, "value": {"type": "string"}},
        "required": ["kind", "value"], "additionalProperties": False}),
    ("A shopping list.", {
        "type": "object",
        "properties": {"items": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["name", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("A tree with two children.", {
        "$defs": {"node": {"type": "object",
                           "properties": {"label": {"type": "string"}},
                           "required": ["label"], "additionalProperties": False}},
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                    "maxItems": 2}},
        "required": ["root", "children"], "additionalProperties": False}),
    ("An id that is a number or a string.", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["id"], "additionalProperties": False}),
    ("Weather with an optional note.", {
        "type": "object",
        "properties": {"temp_c": {"type": "number"}, "note": {"type": "string"}},
        "required": ["temp_c"], "additionalProperties": False}),
    ("A date of an event.", {
        "type": "object", "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"], "additionalProperties": False}),
    ("An email contact.", {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email"}},
        "required": ["email"], "additionalProperties": False}),
    ("A nullable middle name.", {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"]}},
        "required": ["middle"], "additionalProperties": False}),
    ("Tags for a post.", {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}),
    ("A single number.", {"type": "integer"}),
    ("Yes or no.", {"enum": ["yes", "no"]}),
    ("A short code.", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    ("A matrix.", {
        "type": "array", "maxItems": 2,
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}),
    ("An HTTP status.", {
        "type": "object",
        "properties": {"code": {"type": "integer", "enum": [200, 404, 500]},
                       "ok": {"type": "boolean"}},
        "required": ["code", "ok"], "additionalProperties": False}),
    ("A title.", {
        "type": "object", "properties": {"title": {"type": "string", "maxLength": 40}},
        "required": ["title"], "additionalProperties": False}),
    ("A price.", {
        "type": "object",
        "properties": {"amount": {"type": "number", "minimum": 0},
                       "currency": {"enum": ["EUR", "USD"]}},
        "required": ["amount", "currency"], "additionalProperties": False}),
    ("A user and their roles.", {
        "type": "object",
        "properties": {"user": {"type": "string"},
                       "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                                 "maxItems": 3}},
        "required": ["user", "roles"], "additionalProperties": False}),
    ("A step list.", {
        "type": "object",
        "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 30}}},
        "required": ["steps"], "additionalProperties": False}),
    ("Either a cat or a dog.", {
        "anyOf": [
            {"type": "object", "properties": {"cat": {"type": "string"}},
             "required": ["cat"], "additionalProperties": False},
            {"type": "object", "properties": {"dog": {"type": "string"}},
             "required": ["dog"], "additionalProperties": False}]}),
    ("Coordinates as a tuple.", {
        "type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
        "items": False, "minItems": 2}),
    ("A config with defaults.", {
        "type": "object",
        "properties": {"debug": {"type": "boolean"}, "level": {"type": "integer", "maximum": 9}},
        "required": ["debug", "level"], "additionalProperties": False}),
    ("Any JSON object about a car.", {"type": "object"}),
    ("A summary sentence.", {
        "type": "object", "properties": {"summary": {"type": "string", "maxLength": 60}},
        "required": ["summary"], "additionalProperties": False}),
    ("Three scores.", {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "number"},
                                  "minItems": 3, "maxItems": 3}},
        "required": ["scores"], "additionalProperties": False}),
    ("An address.", {
        "type": "object",
        "properties": {"street": {"type": "string", "maxLength": 30},
                       "city": {"type": "string", "maxLength": 20},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}),
]  # fmt: skip

TOOLS = [
    Tool("get_weather", "Current weather for a city", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}),
    Tool("add", "Add two numbers", {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"], "additionalProperties": False}),
    Tool("search", "Search the web", {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 40},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"], "additionalProperties": False}),
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(default_model):
    e = Engine(default_model, EngineConfig(max_batch=64, num_blocks=4096))
    yield e
    e.close()


def answer(
    prompt: str, schema: dict | None, temperature: float, seed: int = 0, **kw
) -> ChatRequest:
    return ChatRequest(
        [Message("user", prompt + " Answer in JSON.")],
        max_tokens=kw.pop("max_tokens", 160),
        sampling=SamplingParams(temperature=temperature, seed=seed),
        output_format=OutputFormat(schema)
        if schema is not None or kw.pop("json_object", False)
        else None,
        **kw,
    )


def run_all(engine, requests):
    streams = submit_together(engine, requests)  # constrained rows batch with each other
    return [list(s.iter_sync(TIMEOUT)) for s in streams]


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


#: The schemas ``make test`` runs (the full set runs in bench/bench_constrained.py,
#: whose pass rates are in bench/RESULTS.md).
IN_TESTS = [0, 1, 2, 3, 5, 6, 9, 10, 15, 17, 20, 25]
TEMPERATURES = [0.0, 0.8]
#: (prompt, tool choice, the tool a named choice calls).
FORCED = [
    ("What is the weather in Paris?", "required", None),
    ("What is 2 plus 3?", {"name": "add"}, "add"),
    ("Find news about llamas.", {"name": "search"}, "search"),
    ("Hello!", {"name": "get_weather"}, "get_weather"),
    ("Tell me a joke.", "required", None),
]
STRICT = [Tool(t.name, t.description, t.parameters, strict=True) for t in TOOLS]
STORY = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def structured(temperature: float) -> list[ChatRequest]:
    cases = [SCHEMAS[i] for i in IN_TESTS]
    return [answer(p, s, temperature, seed=i) for i, (p, s) in enumerate(cases)]


def forced(temperature: float, parallel: bool) -> list[ChatRequest]:
    return [
        ChatRequest(
            [Message("user", prompt)],
            # Room for the few calls a required choice may make before it stops.
            max_tokens=240 if parallel else 120,
            sampling=SamplingParams(temperature=temperature, seed=3),
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
        )
        for prompt, choice, _ in FORCED
    ]


def strict_auto() -> ChatRequest:
    return ChatRequest(
        [Message("user", "Weather in Paris please.")],
        max_tokens=120,
        sampling=SamplingParams(temperature=0.0),
        tools=STRICT,
        tool_choice="auto",
    )


@pytest.fixture(scope="module")
def answers(engine):
    """Every generation the tests below check, submitted together: one batch, as a
    server under load runs them (a row's grammar is its own whatever is beside it).
    By key, the events of each of that key's requests."""
    groups = {
        **{("structured", t): structured(t) for t in TEMPERATURES},
        **{("forced", t, par): forced(t, par) for t in TEMPERATURES for par in (False, True)},
        ("json object",): [answer("Describe a car.", None, 0.0, json_object=True)],
        ("parallel",): [
            ChatRequest(
                [Message("user", "Weather in Paris and in Rome?")],
                max_tokens=160,
                sampling=SamplingParams(temperature=0.0),
                tools=TOOLS[:1],
                tool_choice="required",
            )
        ],
        ("schema or tools",): [
            answer(
                "A person named Ann, 30 years old.",
                SCHEMAS[0][1],
                0.0,
                tools=TOOLS,
                tool_choice="auto",
            )
        ],
        ("cut",): [answer("Tell a very long story.", STORY, 0.0, max_tokens=6)],
        ("strict auto",): [strict_auto()],
    }
    events = iter(run_all(engine, [r for reqs in groups.values() for r in reqs]))
    out = {key: [next(events) for _ in reqs] for key, reqs in groups.items()}
    assert_at_rest(engine)
    return out


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_structured_outputs_follow_their_schema(answers, temperature):
    """What the grammar guarantees: an answer that ends (end of turn) parses and
    validates; one cut by max_tokens is a prefix the grammar allowed, never text
    that breaks it. A small model can still loop inside a string until max_tokens."""
    assert len(SCHEMAS) >= 30
    cases = [SCHEMAS[i] for i in IN_TESTS]
    ended = 0
    for (prompt, schema), events in zip(cases, answers["structured", temperature], strict=True):
        done = events[-1]
        assert isinstance(done, Done), (prompt, done)
        text = text_of(events)
        if done.stop_reason == "max_tokens":
            assert text.startswith(("{", "[", '"')) or text[:1].isdigit() or text[:1] == "-", text
            continue
        assert done.stop_reason == "end_turn", (prompt, done, text)
        jsonschema.validate(json.loads(text), schema)
        ended += 1
    assert ended >= len(cases) - 2, f"only {ended} of {len(cases)} answers ended"


def test_json_object_is_an_object(answers):
    (events,) = answers["json object",]
    assert isinstance(json.loads(text_of(events)), dict)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_forced_tool_choice_calls_the_right_tool(answers, temperature, parallel):
    """A named choice is one call whatever ``parallel_tool_calls`` says; ``required``
    is one call without parallel calls, else one or more, never the same twice."""
    by_name = {t.name: t for t in TOOLS}
    for (prompt, _, want), events in zip(
        FORCED, answers["forced", temperature, parallel], strict=True
    ):
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert isinstance(events[-1], Done) and events[-1].stop_reason == "tool_use", (
            prompt,
            events,
        )
        if want is not None or not parallel:
            assert len(calls) == 1, calls
        keys = [(c.name, json.loads(c.arguments)) for c in calls]
        assert all(k not in keys[:i] for i, k in enumerate(keys)), keys
        for c in calls:
            assert want is None or c.name == want
            jsonschema.validate(json.loads(c.arguments), by_name[c.name].parameters)
        assert text_of(events).strip() == ""


def test_parallel_calls_are_allowed_when_asked(answers):
    (events,) = answers["parallel",]
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) > 1 and all(c.name == "get_weather" for c in calls)


def test_structured_output_with_tools_offered_is_a_call_or_an_answer(answers):
    (events,) = answers["schema or tools",]
    calls = [e for e in events if isinstance(e, ToolCall)]
    if calls:
        jsonschema.validate(
            json.loads(calls[0].arguments), {t.name: t for t in TOOLS}[calls[0].name].parameters
        )
    else:
        jsonschema.validate(json.loads(text_of(events)), SCHEMAS[0][1])


def test_max_tokens_inside_the_grammar_ends_as_max_tokens(answers):
    (events,) = answers["cut",]
    assert isinstance(events[-1], Done) and events[-1].stop_reason == "max_tokens"
    assert re.match(r'\{\s*"story":\s*"', text_of(events)), text_of(events)


def test_a_schema_that_cannot_compile_is_refused_before_any_work(engine):
    before = engine.stats().requests_total
    for schema, part in (
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}, "nowhere"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": 7}, "type must be"),
    ):
        with pytest.raises(InvalidRequest) as e:
            engine.prepare(answer("x", schema, 0.0))
        assert e.value.param == "response_format" and part in str(e.value), e.value
    # Not strict: what can be enforced is, the rest is left to the model.
    lenient = answer("x", {"type": "array", "uniqueItems": True}, 0.0)
    lenient.output_format.strict = False
    assert engine.prepare(lenient).grammar is not None
    with pytest.raises(InvalidRequest) as e:
        engine.prepare(
            ChatRequest([Message("user", "x")], tools=TOOLS, tool_choice={"name": "nope"})
        )
    assert e.value.param == "tool_choice"
    assert engine.stats().requests_total == before


def test_strict_tools_under_auto_constrain_a_call_once_it_opens(engine, answers, default_model):
    """Free text stays free; a call the model opens must match its strict schema."""
    from mlx_cairn import constrain

    prepared = engine.prepare(strict_auto())
    assert prepared.grammar is not None
    vocab = constrain.vocabulary(default_model)
    tok = default_model.tokenizer

    def allowed(text: str) -> bool:
        m = vocab.matcher(prepared.grammar)
        for t in tok.encode(text):
            import numpy as np

            if np.frombuffer(m.mask(), np.float32)[t] != 0.0:
                return False
            m.consume(t)
        return True

    assert allowed("Sure, I can help with that.")
    assert allowed(
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
    )
    assert not allowed('Let me check. <tool_call>\n{"name": "get_time"')
    assert not allowed('<tool_call>\n{"name": "add", "arguments": {"a": "one"')
    (events,) = answers["strict auto",]
    assert isinstance(events[-1], Done)
    for call in (e for e in events if isinstance(e, ToolCall)):
        jsonschema.validate(
            json.loads(call.arguments), {t.name: t for t in TOOLS}[call.name].parameters
        )
