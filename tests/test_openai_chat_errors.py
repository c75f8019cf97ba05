"""OpenAI Chat Completions errors and failure handling, through the ``openai`` SDK and raw HTTP.

Every error is checked for its status and the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``; 400s happen before any
model work; queue-full, disconnects and mid-generation failures run on the
real engine (scripted test model) held or failed by a fault hook.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from live_server import settle_cancel, tight_queue_full
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say
from test_openai_support import BEARER, openai_env, sse_data, user

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


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
    before = eng.stats().requests_total
    err = assert_openai_error(post(env, body), 400, "invalid_request_error")
    assert err["param"] == param
    if param:
        assert param in err["message"]
    assert eng.stats().requests_total == before  # rejected before any model work


def test_sdk_error_classes(env: dict[str, Any]) -> None:
    c = env["client"]
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="scripted", messages=user("x"), n=3)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=user("x"))
    assert nf.value.body["type"] == "not_found_error"  # type: ignore[index]
    with (
        openai.OpenAI(base_url=env["url"] + "/v1", api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError) as au,
    ):
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


#: litellm's test for a context overflow (ContextWindowExceededError), with the limit.
LITELLM_OVERFLOW = re.compile(r"maximum context length is (\d+) tokens")


def langchain_overflow(e: Exception) -> bool:
    """langchain's test for a context overflow: the text of the SDK's exception only
    (openai 3.x no longer prints the body there, just the message)."""
    return "context_length_exceeded" in str(e) or "prompt is too long" in str(e)


@pytest.mark.parametrize(
    ("caps", "stream", "named"),
    [
        ({"max_tokens": 7000}, False, "max_tokens"),
        ({"max_completion_tokens": 7000}, False, "max_completion_tokens"),
        ({"max_completion_tokens": 7000}, True, "max_completion_tokens"),
        ({"max_tokens": 16, "max_completion_tokens": 7000}, False, "max_completion_tokens"),
    ],
    ids=["max_tokens", "max_completion_tokens", "stream", "both"],
)
def test_context_overflow_in_the_words_clients_match(
    env: dict[str, Any], caps: dict[str, int], stream: bool, named: str
) -> None:
    eng = env["engines"]["scripted"]
    before = eng.stats().requests_total
    c = env["client"]
    with pytest.raises(openai.BadRequestError) as ctx:
        c.chat.completions.create(
            model="scripted", messages=user("word " * 1500), stream=stream, **caps
        )
    e = ctx.value
    assert e.code == "context_length_exceeded" and e.param == named, e.body
    assert langchain_overflow(e), str(e)
    m = LITELLM_OVERFLOW.search(str(e))
    assert m is not None and int(m.group(1)) == 8192, str(e)
    assert f"for {named})" in str(e) and f"lower {named} to at most" in str(e), str(e)
    if named == "max_completion_tokens":  # the field it sent, not one it did not
        assert "max_tokens" not in str(e).replace("max_completion_tokens", ""), str(e)
    assert eng.stats().requests_total == before  # refused before any model work


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_alone_over_the_context_is_named_by_its_messages(
    env: dict[str, Any], stream: bool
) -> None:
    c = env["client"]
    with pytest.raises(openai.BadRequestError) as ctx:
        c.chat.completions.create(
            model="scripted", messages=user("word " * 6000), stream=stream, max_completion_tokens=8
        )
    e = ctx.value
    assert e.code == "context_length_exceeded" and e.param == "messages", e.body
    assert langchain_overflow(e) and "prompt is too long" in str(e), str(e)
    assert LITELLM_OVERFLOW.search(str(e)), str(e)
    # The same conversation in the Anthropic dialect keeps the words Claude Code compacts on.
    r = httpx.post(
        env["url"] + "/v1/messages",
        json={
            "model": "scripted",
            "max_tokens": 8,
            "messages": user("word " * 6000),
        },
        headers={**BEARER, "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    msg = r.json()["error"]["message"]
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 8192 maximum", msg), msg


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


def test_queue_full_is_429_with_retry_after(env: dict[str, Any]) -> None:
    body = ok_body(model="tight", max_tokens=4)
    with tight_queue_full(env, lambda: post(env, body)):
        r = post(env, body)
        assert_openai_error(r, 429, "rate_limit_error", "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1


def test_stream_disconnect_cancels_and_frees(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    before = eng.stats().requests_cancelled
    # A token goes out, then the engine is held before it looks at its inbox again
    # (right after that step's read-back queues the next step), so the client's
    # hang-up can only be seen while it is held. A hold at a later push would race
    # the hang-up: the engine checks for cancels between any two pushes.
    pushed = threading.Event()

    def on_push(phase: str, seq: Any) -> None:
        if phase == "push":
            pushed.set()

    release = eng._runner.release

    def held_release() -> None:
        release()
        if pushed.is_set() and not blocker.entered.is_set():
            blocker.entered.set()
            blocker.release.wait(30)

    blocker.entered.clear()
    blocker.release.clear()
    eng._row_fault_hook = on_push
    eng._runner.release = held_release
    try:
        body = ok_body(messages=user(say("x " * 200)), max_tokens=300, stream=True)
        with httpx.stream(
            "POST", env["url"] + "/v1/chat/completions", json=body, headers=BEARER, timeout=30
        ) as r:
            for chunk in r.iter_text():
                if "chat.completion.chunk" in chunk:
                    break
        assert blocker.entered.wait(10)
        settle_cancel(eng, blocker, before)
    finally:
        eng._row_fault_hook = None
        del eng._runner.release


def test_non_stream_disconnect_cancels_too(env: dict[str, Any]) -> None:
    eng, blocker = env["engines"]["scripted"], env["blockers"]["scripted"]
    before = eng.stats().requests_cancelled
    blocker.arm(skip=3)
    host, port = env["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    payload = json.dumps(ok_body(messages=user(say("y " * 200)), max_tokens=300))
    conn.request(
        "POST", "/v1/chat/completions", payload, {**BEARER, "content-type": "application/json"}
    )
    assert blocker.entered.wait(10)
    conn.close()
    settle_cancel(eng, blocker, before)


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
