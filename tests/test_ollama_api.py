"""The Ollama API end to end, through the official ``ollama`` Python client.

The real server, engine, template, tokenizer and text pipeline run the
scripted test model (tests/scripted_model.py): ``say(...)`` in the prompt
chooses what it answers. Streamed and non-streamed answers must agree, every
refusal must be Ollama's ``{"error": ...}`` and leave the engine untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from live_server import scripted_server
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say
from test_openai_support import WEATHER, call

TOKEN = "ollama-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
#: Fields that differ between two runs of one request.
VOLATILE = {
    "created_at",
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
    "id",
}


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with scripted_server(TOKEN, {"llama3.2": "scripted"}) as e:
        client = ollama.Client(host=e["url"], headers=AUTH, timeout=60)
        try:
            yield {**e, "client": client}
        finally:
            client.close()


def scrub(obj: Any) -> Any:
    """A dump without :data:`VOLATILE` fields (and the client's unset ``None`` fields)."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def accumulate(parts: list[Any], shape: str) -> dict[str, Any]:
    """A stream of client objects as one answer, the way chat UIs accumulate it."""
    final = scrub(parts[-1])
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    if shape == "chat":
        msg = {"role": "assistant", "content": "".join(p.message.content or "" for p in parts)}
        thinking = "".join(p.message.thinking or "" for p in parts)
        calls = [scrub(c) for p in parts for c in p.message.tool_calls or []]
        msg |= {"thinking": thinking} if thinking else {}
        msg |= {"tool_calls": calls} if calls else {}
        return final | {"message": msg}
    thinking = "".join(p.thinking or "" for p in parts)
    return (
        final
        | {"response": "".join(p.response or "" for p in parts)}
        | ({"thinking": thinking} if thinking else {})
    )


def both(client: ollama.Client, shape: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(streamed and accumulated, non-streamed) answers to one request."""
    send = client.chat if shape == "chat" else client.generate
    streamed = accumulate(list(send(stream=True, **kw)), shape)
    return streamed, scrub(send(stream=False, **kw))


CASES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"messages": [{"role": "user", "content": say("Hello there, friend.")}]}),
    ("reasoning", {"messages": [{"role": "user", "content": say("<think>Plan.</think>4.")}]}),
    (
        "system, options",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": say("one two three four")},
            ],
            "options": {"temperature": 0, "stop": ["three"], "seed": 7},
        },
    ),
    ("length", {"messages": [{"role": "user", "content": say("a b c d e f g h i j")}]}),
    (
        "tool call",
        {
            "messages": [
                {"role": "user", "content": say("Let me see." + call("get_weather", city="Oslo"))}
            ],
            "tools": [WEATHER],
        },
    ),
    ("json", {"messages": [{"role": "user", "content": say('{"a": [1, 2]}')}], "format": "json"}),
]


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_chat_streamed_equals_json(env: dict[str, Any], name: str, kw: dict[str, Any]) -> None:
    if name == "length":
        kw = {**kw, "options": {"num_predict": 3}}
    streamed, plain = both(env["client"], "chat", model="llama3.2", **kw)
    assert streamed == plain
    msg = plain["message"]
    assert plain["done"] is True and plain["model"] == "llama3.2"
    assert plain["prompt_eval_count"] > 0 and plain["eval_count"] > 0
    expect = {
        "text": ("Hello there, friend.", "stop"),
        "reasoning": ("4.", "stop"),
        "system, options": ("one two ", "stop"),
        "json": ('{"a": [1, 2]}', "stop"),
    }
    if name in expect:
        assert (msg["content"], plain["done_reason"]) == expect[name]
    if name == "reasoning":
        assert msg["thinking"] == "Plan."
    if name == "length":
        assert plain["done_reason"] == "length" and plain["eval_count"] == 3
    if name == "tool call":
        assert msg["content"] == "Let me see."
        [tc] = msg["tool_calls"]
        assert tc["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    if name == "json":
        assert json.loads(msg["content"]) == {"a": [1, 2]}


def test_tool_round_trip(env: dict[str, Any]) -> None:
    """A tool call and its result, sent back as Ollama clients send them (no ids)."""
    c: ollama.Client = env["client"]
    first = c.chat(
        model="scripted",
        messages=[{"role": "user", "content": say(call("get_weather", city="Rome"))}],
        tools=[WEATHER],
    )
    calls = first.message.tool_calls
    assert calls and calls[0].function.arguments == {"city": "Rome"}
    again = c.chat(
        model="scripted:latest",
        messages=[
            {"role": "user", "content": "weather in Rome?"},
            first.message,
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
            {"role": "user", "content": say("It is sunny.")},
        ],
        tools=[WEATHER],
    )
    assert again.message.content == "It is sunny." and again.model == "scripted:latest"


def test_generate(env: dict[str, Any]) -> None:
    c: ollama.Client = env["client"]
    streamed, plain = both(c, "generate", model="scripted", prompt=say("<think>x</think>gen"))
    assert streamed == plain
    assert (plain["response"], plain["thinking"], plain["done_reason"]) == ("gen", "x", "stop")
    r = c.generate(model="scripted", prompt=say("brief"), system="Answer briefly.", think=False)
    assert r.response == "brief"
    # No prompt: load the model (and with keep_alive 0 unload it; see test_ollama_models.py).
    r = c.generate(model="scripted")
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    r = c.chat(model="scripted", messages=[])
    assert (r.done_reason, r.message.content) == ("load", "")


words = st.lists(st.sampled_from(["sun", "moon", "é", "日本", "{x}", "\n", " "]), max_size=5).map(
    " ".join
)
outputs = st.tuples(
    st.one_of(st.just(""), words.map(lambda w: f"<think>{w}</think>")),
    words,
    st.lists(st.sampled_from(["alpha", "beta"]).map(lambda n: call(n, v=1)), max_size=2).map(
        "".join
    ),
).map("".join)


@settings(max_examples=min(settings().max_examples, 15))
@given(
    text=outputs,
    shape=st.sampled_from(["chat", "generate"]),
    cap=st.sampled_from([None, 3]),
    stop=st.lists(st.sampled_from(["moon", "beta", "zz"]), max_size=1),
)
def test_random_outputs_stream_and_fold_alike(
    env: dict[str, Any], text: str, shape: str, cap: int | None, stop: list[str]
) -> None:
    options: dict[str, Any] = {"temperature": 0, "stop": stop}
    if cap:
        options["num_predict"] = cap
    kw: dict[str, Any] = {"model": "scripted", "options": options}
    if shape == "chat":
        tools = [{"type": "function", "function": {"name": n}} for n in ("alpha", "beta")]
        kw |= {"messages": [{"role": "user", "content": say(text)}], "tools": tools}
    else:
        kw |= {"prompt": say(text)}
    streamed, plain = both(env["client"], shape, **kw)
    assert streamed == plain


def test_models_listing_and_details(env: dict[str, Any]) -> None:
    c: ollama.Client = env["client"]
    names = [m.model for m in c.list().models]
    assert {"scripted", "tight", "broken", "llama3.2"} <= set(names)
    c.chat(model="scripted", messages=[{"role": "user", "content": say("hi")}])
    show = c.show("llama3.2:latest")
    assert show.capabilities is not None and {"completion", "tools", "thinking"} <= set(
        show.capabilities
    )
    ctx = show.modelinfo[f"{show.modelinfo['general.architecture']}.context_length"]
    assert ctx == env["engines"]["scripted"].context_length
    assert "im_start" in (show.template or "") and f"num_ctx {ctx}" in (show.parameters or "")
    running = c.ps().models
    assert "scripted" in [m.model for m in running]
    assert all(m.context_length and m.expires_at for m in running)
    v = httpx.get(env["url"] + "/api/version", headers=AUTH).json()
    assert v["version"].count(".") == 2 and v["server"] == "mlx-cairn"
    r = httpx.get(env["url"] + "/", headers=AUTH)
    assert (r.status_code, r.text) == (200, "Ollama is running")
    assert httpx.head(env["url"] + "/").status_code == 200  # the probe needs no token


def test_pull_of_a_served_model_succeeds_and_management_is_501(env: dict[str, Any]) -> None:
    c: ollama.Client = env["client"]
    assert c.pull("llama3.2").status == "success"
    refusals = {
        "pull": lambda: c.pull("qwen3:8b"),
        "push": lambda: c.push("scripted"),
        "create": lambda: c.create(model="x", from_="scripted"),
        "copy": lambda: c.copy("scripted", "other"),
        "delete": lambda: c.delete("scripted"),
    }
    for name, send in refusals.items():
        with pytest.raises(ollama.ResponseError) as e:
            send()
        assert e.value.status_code == 501, name
        assert f"/api/{name} is not supported by this server" in e.value.error
    for method in ("HEAD", "POST"):
        r = httpx.request(method, env["url"] + "/api/blobs/sha256:abc", headers=AUTH)
        assert r.status_code == 501 and r.headers["x-should-retry"] == "false"


def test_refusals_are_ollama_errors_before_any_work(env: dict[str, Any]) -> None:
    c: ollama.Client = env["client"]
    engine = env["engines"]["scripted"]
    before = engine.stats().requests_total
    user = [{"role": "user", "content": say("hi")}]
    cases: list[tuple[int, str, Any]] = [
        (404, "model 'nope' not found", lambda: c.chat(model="nope", messages=user)),
        (404, "not found", lambda: c.show("nope")),
        (400, "images", lambda: c.chat(model="scripted", messages=[{**user[0], "images": ["aGk="]}])),
        (400, "images", lambda: c.generate(model="scripted", prompt="x", images=["aGk="])),
        (400, "options.temperature", lambda: c.chat(model="scripted", messages=user, options={"temperature": 9})),
        (400, "format", lambda: c.chat(model="scripted", messages=user, format={"type": "nonsense"})),
        (400, "template: not supported", lambda: c.generate(model="scripted", prompt="x", template="{{ .Prompt }}")),
        (400, "suffix", lambda: c.generate(model="scripted", prompt="def f(", suffix="pass")),
        (400, "tokens > 4 maximum", lambda: c.chat(model="scripted", messages=user, options={"num_ctx": 4})),
        (400, "messages[0].role", lambda: c.chat(model="scripted", messages=[{"role": "bot", "content": "x"}])),
    ]  # fmt: skip
    for status, words_, send in cases:
        with pytest.raises(ollama.ResponseError) as e:
            send()
        assert e.value.status_code == status and words_ in e.value.error, (words_, e.value)
    assert engine.stats().requests_total == before  # nothing reached the engine
    raw = [
        (httpx.post, "/api/chat", b"{not json", 400),
        (httpx.post, "/api/chat", b"[]", 400),
        (httpx.get, "/api/chat", None, 405),
        (httpx.post, "/api/nothing", b"{}", 404),
    ]
    for send, path, content, status in raw:
        kw = {"content": content} if content is not None else {}
        r = send(env["url"] + path, headers=AUTH, **kw)
        assert r.status_code == status and isinstance(r.json()["error"], str), (path, r.text)
    r = httpx.post(env["url"] + "/api/chat", json={"model": "scripted", "messages": user})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)  # the same gate
    assert_at_rest(engine)


def test_stream_is_ndjson_and_the_engine_rests(env: dict[str, Any]) -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": say("a b")}]}
    with httpx.stream("POST", env["url"] + "/api/chat", json=body, headers=AUTH) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines()]  # every line is one object
    assert lines[-1]["done"] and "".join(x["message"]["content"] for x in lines) == "a b"
    assert_at_rest(env["engines"]["scripted"])
