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

from mlx_cairn.engine.testing import assert_at_rest
from scripted_model import say
from test_openai_support import BEARER, TOKEN, normalize, openai_env, sse_data, wait_until

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


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


# ---------------------------------------------------------------------- errors


def assert_openai_error(
    r: httpx.Response, status: int, etype: str, code: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == etype and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def post(env: dict[str, Any], body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    raw = body if isinstance(body, str) else json.dumps(body)
    hdrs = {**BEARER, "content-type": "application/json", **(headers or {})}
    return httpx.post(env["url"] + "/v1/chat/completions", content=raw, headers=hdrs, timeout=30)


def ok_body(**kw: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": user(say("ok")), **kw}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ("[1, 2]", None),
        ({"messages": user("x")}, "model"),
        ({"model": "scripted"}, "messages"),
        (ok_body(messages=[]), "messages"),
        (ok_body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (
            ok_body(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
            "messages[0].content[0].type",
        ),
        (ok_body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (
            ok_body(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (ok_body(n=2), "n"),
        (ok_body(max_tokens=0), "max_tokens"),
        (ok_body(max_completion_tokens="5"), "max_completion_tokens"),
        (ok_body(temperature=2.5), "temperature"),
        (ok_body(top_p=0), "top_p"),
        (ok_body(seed=1.5), "seed"),
        (ok_body(stop=["ok", 3]), "stop[1]"),
        (ok_body(stream_options={"include_usage": True}), "stream_options"),
        (
            ok_body(
                tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
            ),
            "tool_choice.function.name",
        ),
        (ok_body(tool_choice="required"), "tool_choice"),
        (ok_body(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
        (ok_body(reasoning_effort="extreme"), "reasoning_effort"),
    ],
)
def test_validation_400(env: dict[str, Any], body: Any, param: str | None) -> None:
    eng = env["engines"]["scripted"]
    before = eng.stats()["requests_requests"]
    err = assert_openai_error(post(env, body), 400, "invalid_request_error")
    assert err["param"] == param
    if param:
        assert param in err["message"]
    assert eng.stats()["requests_requests"] == before  # rejected before any model work


def test_sdk_error_classes(env: dict[str, Any]) -> None:
    c = env["client"]
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="scripted", messages=user("x"), n=3)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=user("x"))
    assert nf.value.body["type"] == "not_found_error"  # type: ignore[index]
    wrong = openai.OpenAI(base_url=env["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as au:
        wrong.chat.completions.create(model="scripted", messages=user("x"))
    assert au.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.InternalServerError) as ise:
        c.chat.completions.create(model="broken", messages=user("x"))
    assert "failed to load" in ise.value.message and ise.value.body["type"] == "server_error"  # type: ignore[index]
    with (
        pytest.raises(openai.BadRequestError) as ctx,
        c.chat.completions.stream(
            model="scripted", messages=user("word " * 1500), max_tokens=7000
        ) as s,
    ):
        s.get_final_completion()
    assert ctx.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_auth_and_size_envelopes(env: dict[str, Any]) -> None:
    r = httpx.post(env["url"] + "/v1/chat/completions", json=ok_body(), timeout=10)
    assert_openai_error(r, 401, "authentication_error", "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(
        post(env, ok_body(), {"authorization": "Bearer nope"}), 401, "authentication_error"
    )
    big = ok_body(messages=user("x" * 70_000))
    assert_openai_error(post(env, big), 413, "invalid_request_error", "request_too_large")
    r = httpx.get(env["url"] + "/v1/nope", headers=BEARER, timeout=10)
    assert_openai_error(r, 404, "not_found_error")
    assert post(env, ok_body()).status_code == 200


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


def test_queue_full_is_429_with_retry_after(env: dict[str, Any]) -> None:
    import threading

    eng, blocker = env["engines"]["tight"], env["blockers"]["tight"]
    blocker.arm()
    results: list[httpx.Response] = []
    body = ok_body(model="tight", max_tokens=4)
    first = threading.Thread(target=lambda: results.append(post(env, body)))
    first.start()
    assert blocker.entered.wait(10)
    second = threading.Thread(target=lambda: results.append(post(env, body)))
    second.start()
    wait_until(lambda: eng.stats()["queue_depth"] >= 1, "the second request never queued")
    r = post(env, body)
    assert_openai_error(r, 429, "rate_limit_error", "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    blocker.release.set()
    first.join(10)
    second.join(10)
    assert [x.status_code for x in results] == [200, 200]
    assert_at_rest(eng)


def test_stream_disconnect_cancels_and_frees(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    before = eng.stats()["requests_cancelled"]
    blocker.arm(skip=3)  # a few tokens go out, then the engine is held mid-generation
    body = ok_body(messages=user(say("x " * 200)), max_tokens=300, stream=True)
    with httpx.stream(
        "POST", env["url"] + "/v1/chat/completions", json=body, headers=BEARER, timeout=30
    ) as r:
        for chunk in r.iter_text():
            if "chat.completion.chunk" in chunk:
                break
    assert blocker.entered.wait(10)
    wait_until(lambda: bool(eng._cancels), "the server did not cancel the generation")
    blocker.release.set()
    wait_until(
        lambda: eng.stats()["requests_cancelled"] >= before + 1, "the engine never saw the cancel"
    )
    assert_at_rest(eng)


def test_failure_mid_generation(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    body = ok_body(messages=user(say("x " * 50)), max_tokens=60, stream=True)
    blocker.arm(skip=4, fail=RuntimeError("the device fell over"))
    r = httpx.post(env["url"] + "/v1/chat/completions", json=body, headers=BEARER, timeout=30)
    frames = sse_data(r.text)
    assert "chat.completion.chunk" in frames[0][1]  # it did start
    last = json.loads(frames[-1][1])
    assert set(last) == {"error"} and last["error"]["type"] == "server_error"
    assert all(d != "[DONE]" for _, d in frames)
    # The same failure before a JSON body is sent: a 500 in the OpenAI envelope.
    blocker.arm(skip=4, fail=RuntimeError("the device fell over"))
    r = post(env, {**body, "stream": False})
    assert_openai_error(r, 500, "server_error")
    assert_at_rest(eng)


@pytest.mark.slow
def test_default_model_free_text(default_model: Any) -> None:
    """The real SmolLM2: free text streams and folds to the same completion / response."""
    from live_server import registry_for, serve
    from mlx_cairn.engine import Engine

    eng = Engine(default_model, num_blocks=160, max_queue=4)
    try:
        with serve(registry_for({"smol": eng})) as srv:
            c = openai.OpenAI(
                base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120
            )
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
            c.close()
        assert_at_rest(eng)
    finally:
        eng.close()
