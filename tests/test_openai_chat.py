"""OpenAI Chat Completions end to end, through the official ``openai`` SDK.

The real server, engine, template, tokenizer and text pipeline run the
scripted test model; ``say(...)`` in the prompt chooses what it answers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say
from test_openai_support import BEARER, TOKEN, WEATHER, call, normalize, openai_env, sse_data, user

CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def both(client: openai.OpenAI, **kw: Any) -> tuple[Any, Any]:
    """(streamed-and-accumulated, non-streamed) completions of one request.

    Each runs under a fresh ``cache_salt`` so neither sees the other's prefix.
    """
    with client.chat.completions.stream(
        stream_options={"include_usage": True}, extra_body={"cache_salt": uuid.uuid4().hex}, **kw
    ) as s:
        try:
            streamed = s.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the SDK refuses to parse a cut-off answer
            streamed = e.completion
    plain = client.chat.completions.create(extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    return streamed, plain


CASES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"messages": user(say("Hello there, friend."))}),
    ("default", {"messages": user("no directive at all")}),
    ("reasoning", {"messages": user(say("<think>Plan it.</think>The answer is 4."))}),
    (
        "system+developer",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Really brief."}]},
                {"role": "user", "content": [{"type": "text", "text": say("Brief.")}]},
            ]
        },
    ),
    ("stop string", {"messages": user(say("one two three four")), "stop": "three"}),
    ("stop list", {"messages": user(say("alpha beta gamma")), "stop": ["zeta", "beta"]}),
    ("length", {"messages": user(say("a b c d e f g h i j k l m n o p")), "max_tokens": 4}),
    (
        "max_completion_tokens",
        {"messages": user(say("a b c d e f g h")), "max_tokens": 50, "max_completion_tokens": 3},
    ),
    ("tool call", {"messages": user(say(call("get_weather", city="Paris"))), "tools": [WEATHER]}),
    (
        "text then two calls",
        {
            "messages": user(
                say("Checking.\n" + call("get_weather", city="Oslo") + "\n" + call("get_time"))
            ),
            "tools": [WEATHER, CLOCK],
            "tool_choice": "auto",
        },
    ),
    (
        "required",
        {
            "messages": user(say(call("get_time"))),
            "tools": [WEATHER, CLOCK],
            "tool_choice": "required",
        },
    ),
    (
        "named",
        {
            "messages": user(say(call("get_time"))),
            "tools": [WEATHER, CLOCK],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    ),
    (
        "tool_choice none",
        {
            "messages": user(say(call("get_weather", city="Rome"))),
            "tools": [WEATHER],
            "tool_choice": "none",
        },
    ),
    ("no tools offered", {"messages": user(say(call("get_weather", city="Rome")))}),
    (
        "tool result turn",
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": say("It is sunny.")},
            ],
            "tools": [WEATHER],
        },
    ),
    (
        "sampling fields",
        {"messages": user(say("seeded")), "top_p": 0.9, "seed": 7, "reasoning_effort": "none"},
    ),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_stream_folds_to_the_non_streamed_completion(
    env: dict[str, Any], case: dict[str, Any]
) -> None:
    streamed, plain = both(env["client"], model="scripted", temperature=0, **case)
    assert normalize(streamed) == normalize(plain)
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert (
        plain.usage.prompt_tokens > 0
        and plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    )
    for tc in plain.choices[0].message.tool_calls or []:
        assert tc.id.startswith("call_") and isinstance(json.loads(tc.function.arguments), dict)


def test_what_the_cases_produce(env: dict[str, Any]) -> None:
    c = env["client"]

    def one(**kw: Any) -> Any:
        return c.chat.completions.create(model="scripted", temperature=0, **kw).choices[0]

    ch = one(messages=user(say("<think>Plan it.</think>The answer is 4.")))
    assert ch.message.content == "The answer is 4." and ch.finish_reason == "stop"
    assert ch.message.reasoning_content == "Plan it."  # type: ignore[attr-defined]
    ch = one(messages=user(say("one two three four")), stop=["three"])
    assert ch.message.content == "one two " and ch.finish_reason == "stop"
    ch = one(messages=user(say("a b c d e f g h i j")), max_completion_tokens=3)
    assert ch.finish_reason == "length"
    ch = one(
        messages=user(
            say("Checking.\n" + call("get_weather", city="Oslo") + "\n" + call("get_time"))
        ),
        tools=[WEATHER, CLOCK],
    )
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking.\n"
    calls = ch.message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len({t.id for t in calls}) == 2
    ch = one(messages=user(say(call("get_weather", city="Rome"))), tools=[WEATHER])
    assert ch.message.content is None and ch.finish_reason == "tool_calls"
    # Without tools the call is plain text; nothing is lost.
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        ch = one(messages=user(say(call("get_weather", city="Rome"))), **kw)
        assert ch.finish_reason == "stop" and not ch.message.tool_calls
        assert "get_weather" in ch.message.content and "Rome" in ch.message.content


def test_raw_stream_shape(env: dict[str, Any]) -> None:
    text = "Sure.\n" + call("get_weather", city="Oslo") + call("get_time")
    body = {
        "model": "scripted",
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": user(say(text)),
        "tools": [WEATHER, CLOCK],
    }
    r = httpx.post(env["url"] + "/v1/chat/completions", json=body, headers=BEARER, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_data(r.text)
    assert all(name is None for name, _ in frames)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    seen: dict[int, list[dict[str, Any]]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            seen.setdefault(tc["index"], []).append(tc)
    assert sorted(seen) == [0, 1]
    for parts in seen.values():
        head, rest = parts[0], parts[1:]
        assert (
            head["id"].startswith("call_")
            and head["type"] == "function"
            and head["function"]["name"]
        )
        assert all(
            set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest
        )
        assert json.loads("".join(p["function"].get("arguments", "") for p in parts)) is not None
    # Without include_usage there is no usage chunk.
    body.pop("stream_options")
    chunks = [
        json.loads(d)
        for _, d in sse_data(
            httpx.post(
                env["url"] + "/v1/chat/completions", json=body, headers=BEARER, timeout=30
            ).text
        )[:-1]
    ]
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_prefix_hits_are_reported(env: dict[str, Any]) -> None:
    c = env["client"]
    system = "You are a careful assistant. " * 20
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": say("first")}]
    first = c.chat.completions.create(model="scripted", temperature=0, messages=msgs)
    msgs[1]["content"] = say("second")
    raw = c.chat.completions.with_raw_response.create(
        model="scripted", temperature=0, messages=msgs
    )
    second = raw.parse()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert (
        raw.headers["x-session-cache"] == "prefix_hit"
        and int(raw.headers["x-cached-tokens"]) == cached
    )
    with c.chat.completions.stream(
        model="scripted", temperature=0, messages=msgs, stream_options={"include_usage": True}
    ) as s:
        assert s.get_final_completion().usage.prompt_tokens_details.cached_tokens >= cached


def test_same_answer_as_the_anthropic_endpoint(env: dict[str, Any]) -> None:
    prompt = say("Same engine, same words.")
    oa = env["client"].chat.completions.create(
        model="scripted", temperature=0, messages=user(prompt)
    )
    an = httpx.post(
        env["url"] + "/v1/messages",
        headers={"x-api-key": TOKEN, "anthropic-version": "2023-06-01"},
        json={"model": "scripted", "max_tokens": 64, "temperature": 0, "messages": user(prompt)},
        timeout=30,
    ).json()
    text = "".join(b["text"] for b in an["content"] if b["type"] == "text")
    assert oa.choices[0].message.content == text == "Same engine, same words."
    assert oa.usage.completion_tokens == an["usage"]["output_tokens"]


def test_models_listing_shapes(env: dict[str, Any]) -> None:
    ids = [m.id for m in env["client"].models.list()]
    assert "scripted" in ids and "gpt-4o-mini" in ids
    raw = httpx.get(env["url"] + "/v1/models", headers=BEARER, timeout=10).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    anth = httpx.get(
        env["url"] + "/v1/models", headers={**BEARER, "anthropic-version": "2023-06-01"}, timeout=10
    ).json()
    assert anth["data"][0]["type"] == "model" and "has_more" in anth


def test_alias_serves_the_model(env: dict[str, Any]) -> None:
    r = env["client"].chat.completions.create(model="gpt-4o-mini", messages=user(say("via alias")))
    assert r.choices[0].message.content == "via alias" and r.model == "scripted"


def test_open_ended_request_runs_to_eos(env: dict[str, Any]) -> None:
    # No max_tokens: the room left (context or KV capacity, less the prompt) is the cap.
    c = env["client"]
    for model in ("scripted", "tight"):  # tight: a KV cache smaller than the context
        r = c.chat.completions.create(model=model, messages=user(say("short and done")))
        assert (
            r.choices[0].message.content == "short and done"
            and r.choices[0].finish_reason == "stop"
        )
        rr = c.responses.create(model=model, input=say("short and done"))
        assert rr.output_text == "short and done" and rr.status == "completed"
    with pytest.raises(openai.BadRequestError) as ctx:  # a prompt that leaves no room at all
        c.chat.completions.create(model="tight", messages=user("word " * 2100))
    assert ctx.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


@pytest.mark.slow
def test_default_model_free_text(default_model: Any) -> None:
    """The real SmolLM2: free text streams and folds to the same completion / response."""
    from live_server import registry_for, serve
    from mlx_cairn.engine import Engine, EngineConfig

    eng = Engine(default_model, EngineConfig(num_blocks=160, max_queue=4))
    try:
        with (
            serve(registry_for({"smol": eng})) as srv,
            openai.OpenAI(
                base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120
            ) as c,
        ):
            for prompt in ("What is the capital of France?", "Write one word about the sea."):
                streamed, plain = both(
                    c, model="smol", temperature=0, max_completion_tokens=12, messages=user(prompt)
                )
                assert normalize(streamed) == normalize(plain)
                assert plain.choices[0].message.content
            kw: dict[str, Any] = {"model": "smol", "temperature": 0, "max_output_tokens": 12}
            with c.responses.stream(
                input="Name a colour.", extra_body={"cache_salt": "a"}, **kw
            ) as s:
                events = list(s)
            final = [e for e in events if e.type in ("response.completed", "response.incomplete")]
            plain_r = c.responses.create(
                input="Name a colour.", extra_body={"cache_salt": "b"}, **kw
            )
            assert normalize(final[-1].response) == normalize(plain_r) and plain_r.output_text
        assert_at_rest(eng)
    finally:
        eng.close()
