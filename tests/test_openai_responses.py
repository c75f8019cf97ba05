"""OpenAI Responses end to end, through the official ``openai`` SDK.

Same server set-up as the Chat Completions tests: the real engine running
the scripted test model (``say(...)`` picks its answer).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mlx_cairn.api.openai_responses import ResponseStore
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say
from test_openai_support import BEARER, call, normalize, openai_env, sse_data

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def salt() -> dict[str, Any]:
    return {"cache_salt": uuid.uuid4().hex}


CASES: list[tuple[str, dict[str, Any]]] = [
    ("string input", {"input": say("Hello from the responses API.")}),
    ("instructions", {"input": say("ok then"), "instructions": "Answer briefly."}),
    ("reasoning", {"input": say("<think>Two plus two.</think>It is 4.")}),
    (
        "message items",
        {
            "input": [
                {"role": "developer", "content": "Be kind."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": say("kind")}],
                },
            ]
        },
    ),
    ("tool call", {"input": say(call("get_weather", city="Lima")), "tools": [WEATHER]}),
    (
        "text and calls",
        {
            "input": say("Let me look.\n" + call("get_weather", city="Oslo") + call("get_time")),
            "tools": [WEATHER, CLOCK],
        },
    ),
    (
        "function call output",
        {
            "input": [
                {"role": "user", "content": "weather in Lima?"},
                {
                    "type": "function_call",
                    "call_id": "call_9",
                    "name": "get_weather",
                    "arguments": '{"city":"Lima"}',
                },
                {"type": "function_call_output", "call_id": "call_9", "output": "foggy"},
                {"role": "user", "content": say("It is foggy in Lima.")},
            ],
            "tools": [WEATHER],
        },
    ),
    ("tool_choice none", {"input": say(call("get_time")), "tools": [CLOCK], "tool_choice": "none"}),
    (
        "named",
        {
            "input": say(call("get_time")),
            "tools": [WEATHER, CLOCK],
            "tool_choice": {"type": "function", "name": "get_time"},
        },
    ),
    ("store false", {"input": say("forget me"), "store": False, "top_p": 0.5}),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_stream_folds_to_the_non_streamed_response(
    env: dict[str, Any], case: dict[str, Any]
) -> None:
    c = env["client"]
    with c.responses.stream(model="scripted", temperature=0, extra_body=salt(), **case) as s:
        streamed = s.get_final_response()
    plain = c.responses.create(model="scripted", temperature=0, extra_body=salt(), **case)
    assert normalize(streamed) == normalize(plain)
    assert plain.status == "completed" and plain.id.startswith("resp_")
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    for item in plain.output:
        if item.type == "function_call":
            assert item.call_id.startswith("call_") and isinstance(json.loads(item.arguments), dict)


def test_what_the_cases_produce(env: dict[str, Any]) -> None:
    c = env["client"]
    r = c.responses.create(model="scripted", input=say("<think>Two plus two.</think>It is 4."))
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two plus two." and r.output_text == "It is 4."
    r = c.responses.create(
        model="scripted",
        input=say("Let me look.\n" + call("get_weather", city="Oslo") + call("get_time")),
        tools=[WEATHER, CLOCK],
    )
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"]
    assert [(i.name, json.loads(i.arguments)) for i in r.output[1:]] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    r = c.responses.create(
        model="scripted", input=say(call("get_time")), tools=[CLOCK], tool_choice="none"
    )
    assert [i.type for i in r.output] == ["message"] and "get_time" in r.output_text


def test_event_order_and_sequence_numbers(env: dict[str, Any]) -> None:
    text = "<think>hmm</think>Sure.\n" + call("get_weather", city="Oslo")
    body = {"model": "scripted", "input": say(text), "tools": [WEATHER], "stream": True, **salt()}
    r = httpx.post(env["url"] + "/v1/responses", json=body, headers=BEARER, timeout=30)
    frames = [(n, json.loads(d)) for n, d in sse_data(r.text)]
    assert [p["sequence_number"] for _, p in frames] == list(range(len(frames)))
    assert all(n == p["type"] for n, p in frames)
    names = [n for n, _ in frames]

    def squash(ns: list[str | None]) -> list[str | None]:
        return [n for i, n in enumerate(ns) if i == 0 or n != ns[i - 1]]

    assert squash(names) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = frames[-1][1]["response"]
    assert done["status"] == "completed" and [i["type"] for i in done["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    args = "".join(p["delta"] for n, p in frames if n == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Oslo"} == json.loads(done["output"][2]["arguments"])


def test_max_output_tokens_is_incomplete(env: dict[str, Any]) -> None:
    body = {
        "model": "scripted",
        "input": say("a b c d e f g h i j k"),
        "max_output_tokens": 3,
        **salt(),
    }
    plain = httpx.post(env["url"] + "/v1/responses", json=body, headers=BEARER, timeout=30).json()
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert plain["usage"]["output_tokens"] == 3 and plain["output"][0]["status"] == "incomplete"
    r = httpx.post(
        env["url"] + "/v1/responses",
        json={**body, "stream": True, **salt()},
        headers=BEARER,
        timeout=30,
    )
    frames = [(n, json.loads(d)) for n, d in sse_data(r.text)]
    assert frames[-1][0] == "response.incomplete"
    assert normalize(frames[-1][1]["response"]) == normalize(plain)


def test_three_turns_through_previous_response_id(env: dict[str, Any]) -> None:
    c = env["client"]
    instructions = "You are a patient tutor who explains things step by step. " * 6
    kw: dict[str, Any] = {
        "model": "scripted",
        "instructions": instructions,
        "temperature": 0,
        "extra_body": salt(),
    }
    first = c.responses.create(input=say("Turn one."), **kw)
    second = c.responses.create(input=say("Turn two."), previous_response_id=first.id, **kw)
    with c.responses.stream(input=say("Turn three."), previous_response_id=second.id, **kw) as s:
        third = s.get_final_response()
    assert [r.output_text for r in (first, second, third)] == [
        "Turn one.",
        "Turn two.",
        "Turn three.",
    ]
    assert first.usage.input_tokens_details.cached_tokens == 0
    for prev, cur in ((first, second), (second, third)):
        # The whole earlier conversation is in the prompt, and its prefix came from the cache.
        assert cur.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens
        assert cur.usage.input_tokens_details.cached_tokens > 0
    assert (
        third.usage.input_tokens_details.cached_tokens
        > second.usage.input_tokens_details.cached_tokens
    )
    assert third.previous_response_id == second.id


def test_tool_round_trip_through_previous_response_id(env: dict[str, Any]) -> None:
    c = env["client"]
    first = c.responses.create(
        model="scripted", input=say(call("get_weather", city="Lima")), tools=[WEATHER]
    )
    fc = first.output[0]
    assert fc.type == "function_call"
    out = c.responses.create(
        model="scripted",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[
            {
                "type": "function_call_output",
                "call_id": fc.call_id,
                "output": "foggy " + say("Foggy in Lima."),
            }
        ],
    )
    assert out.output_text == "Foggy in Lima."


def test_stored_responses_and_404s(env: dict[str, Any]) -> None:
    c = env["client"]
    kept = c.responses.create(model="scripted", input=say("keep me"))
    assert c.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    gone = c.responses.create(model="scripted", input=say("not stored"), store=False)
    for rid in (gone.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as nf:
            c.responses.create(model="scripted", input="x", previous_response_id=rid)
        assert nf.value.body == {  # type: ignore[comparison-overlap]
            "message": nf.value.body["message"],  # type: ignore[index]
            "type": "not_found_error",
            "param": "previous_response_id",
            "code": None,
        }
        assert rid in nf.value.message
    c.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept.id)


def test_expired_and_evicted_responses_are_404(env: dict[str, Any]) -> None:
    app, c = env["app"], env["client"]
    now = [1000.0]
    stores = app.state.cairn.dialect_state
    saved = stores.get("openai_responses")
    stores["openai_responses"] = ResponseStore(max_items=2, ttl_s=60, clock=lambda: now[0])
    try:
        a = c.responses.create(model="scripted", input=say("a"))
        now[0] += 59
        assert (
            c.responses.create(model="scripted", input="x", previous_response_id=a.id).status
            == "completed"
        )
        now[0] += 2  # a is now 61 s old
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="scripted", input="x", previous_response_id=a.id)
        ids = [c.responses.create(model="scripted", input=say(str(i))).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):  # the oldest of three went at max_items=2
            c.responses.retrieve(ids[0])
        assert c.responses.retrieve(ids[2]).id == ids[2]
        assert len(stores["openai_responses"]) == 2
    finally:
        stores["openai_responses"] = saved


# ---------------------------------------------------------------------- errors


def post(env: dict[str, Any], body: Any) -> httpx.Response:
    raw = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        env["url"] + "/v1/responses",
        content=raw,
        headers={**BEARER, "content-type": "application/json"},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("nope", None),
        ({"input": "x"}, "model"),
        ({"model": "scripted"}, "input"),
        ({"model": "scripted", "input": []}, "input"),
        ({"model": "scripted", "input": 5}, "input"),
        ({"model": "scripted", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": "scripted", "input": [{"role": "boss", "content": "x"}]}, "input[0].role"),
        (
            {
                "model": "scripted",
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}
                ],
            },
            "input[0].arguments",
        ),
        (
            {"model": "scripted", "input": [{"type": "function_call_output", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"model": "scripted", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "scripted", "input": "x", "temperature": -1}, "temperature"),
        ({"model": "scripted", "input": "x", "instructions": 5}, "instructions"),
        ({"model": "scripted", "input": "x", "store": "yes"}, "store"),
        (
            {
                "model": "scripted",
                "input": "x",
                "tools": [CLOCK],
                "tool_choice": {"type": "function", "name": "x"},
            },
            "tool_choice.name",
        ),
        ({"model": "scripted", "input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"model": "scripted", "input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ],
)
def test_validation_400(env: dict[str, Any], body: Any, param: str | None) -> None:
    r = post(env, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_other_error_statuses(env: dict[str, Any]) -> None:
    c = env["client"]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="x")
    with pytest.raises(openai.InternalServerError):
        c.responses.create(model="broken", input="x")
    with pytest.raises(openai.BadRequestError) as ctx:
        c.responses.create(model="scripted", input="word " * 1500, max_output_tokens=7000)
    e = ctx.value
    assert e.code == "context_length_exceeded" and e.param == "max_output_tokens", e.body
    # What langchain (the SDK exception's text) and litellm match on.
    assert "context_length_exceeded" in str(e) and "prompt is too long" in str(e), str(e)
    assert "maximum context length is 8192 tokens" in str(e), str(e)
    assert "lower max_output_tokens to at most" in str(e), str(e)
    with pytest.raises(openai.BadRequestError) as ctx:
        c.responses.create(model="scripted", input="word " * 6000, max_output_tokens=8)
    e = ctx.value
    assert e.code == "context_length_exceeded" and e.param == "input", e.body
    assert "prompt is too long" in str(e) and "maximum context length is 8192" in str(e), str(e)
    with (
        openai.OpenAI(base_url=env["url"] + "/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.responses.create(model="scripted", input="x")
    r = post(env, {"model": "scripted", "input": "x" * 70_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_failure_mid_stream_ends_with_response_failed(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    blocker.arm(skip=4, fail=RuntimeError("the device fell over"))
    body = {"model": "scripted", "input": say("x " * 50), "stream": True, "max_output_tokens": 60}
    r = httpx.post(env["url"] + "/v1/responses", json=body, headers=BEARER, timeout=30)
    names = [n for n, _ in sse_data(r.text)]
    assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
    assert "response.completed" not in names
    failed = json.loads(sse_data(r.text)[-1][1])["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert_at_rest(eng)
