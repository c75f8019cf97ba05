"""The Ollama API on tiny random-weight models: the same text as the OpenAI routes and as
mlx-lm at temperature 0, schema-constrained output, and keep_alive loading / unloading.

Every model here is built in-process (mlx-lm's own classes, random weights);
the ``ollama`` client talks to a real uvicorn server.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from fim_fixtures import fim_model, mlx_lm_generate
from live_server import registry_for, serve, wait_until
from mlx_cairn.api import ModelRegistry
from mlx_cairn.chat.fim import fim_prompt, fim_stop_ids
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.testing.tiny_models import tiny_model

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def live() -> Iterator[dict[str, Any]]:
    chat = Engine(tiny_model("qwen3"), EngineConfig(num_blocks=256, block_size=16))
    coder = Engine(fim_model("qwen"), EngineConfig(num_blocks=256, block_size=16))
    try:
        with serve(registry_for({"tiny": chat, "coder": coder})) as srv:
            o = ollama.Client(host=srv.url, timeout=120)
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            yield {"ollama": o, "openai": oa, "chat": chat, "coder": coder}
            o.close()
            oa.close()
        assert_at_rest(chat)
        assert_at_rest(coder)
    finally:
        chat.close()
        coder.close()


CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a cairn."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now?"},
    ],
]


@pytest.mark.parametrize("think", [None, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one turn", "three turns"])
def test_chat_says_what_the_openai_route_says(
    live: dict[str, Any], messages: list[dict[str, str]], think: bool | None
) -> None:
    o: ollama.Client = live["ollama"]
    oa: openai.OpenAI = live["openai"]
    r = o.chat(
        model="tiny", messages=messages, think=think, options={"temperature": 0, "num_predict": 12}
    )
    extra = {} if think is None else {"reasoning_effort": "none"}
    c = oa.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=12, **extra
    )
    msg = c.choices[0].message
    assert r.message.content == (msg.content or "")
    assert (r.message.thinking or "") == (getattr(msg, "reasoning_content", None) or "")
    assert r.eval_count == c.usage.completion_tokens
    assert r.prompt_eval_count == c.usage.prompt_tokens
    assert r.done_reason == {"length": "length", "stop": "stop"}[c.choices[0].finish_reason]
    if messages is CONVERSATIONS[0]:  # /api/generate templates a prompt as one user turn
        g = o.generate(
            model="tiny",
            prompt=messages[0]["content"],
            think=think,
            options={"temperature": 0, "num_predict": 12},
        )
        assert (g.response, g.thinking) == (r.message.content, r.message.thinking)


def test_fill_in_the_middle_equals_mlx_lm_and_the_completions_route(live: dict[str, Any]) -> None:
    o: ollama.Client = live["ollama"]
    r = o.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 10}
    )
    lm = live["coder"].loaded
    tok = lm.tokenizer
    stops = set(lm.eos_token_ids) | fim_stop_ids(tok)
    ids = mlx_lm_generate(lm, fim_prompt(tok, PREFIX, SUFFIX), 10, stops)
    assert r.eval_count == len(ids) and r.prompt_eval_count == len(fim_prompt(tok, PREFIX, SUFFIX))
    assert r.response == tok.decode([i for i in ids if i not in stops])
    legacy = live["openai"].completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, temperature=0, max_tokens=10
    )
    assert r.response == legacy.choices[0].text
    # raw: the prompt as it is, no template.
    raw = o.generate(
        model="coder", prompt=PREFIX, raw=True, options={"temperature": 0, "num_predict": 8}
    )
    ids = mlx_lm_generate(lm, tok.encode(PREFIX), 8, set(lm.eos_token_ids))
    assert raw.response == tok.decode([i for i in ids if i not in lm.eos_token_ids])
    # A model without fill-in-the-middle tokens says so.
    with pytest.raises(ollama.ResponseError) as e:
        o.generate(model="tiny", prompt=PREFIX, suffix=SUFFIX)
    assert e.value.status_code == 400 and e.value.error.startswith("suffix: ")
    assert "fill-in-the-middle" in e.value.error
    assert "insert" in (o.show("coder").capabilities or [])
    assert "insert" not in (o.show("tiny").capabilities or [])


def test_format_schema_is_enforced(live: dict[str, Any]) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    o: ollama.Client = live["ollama"]
    for stream in (False, True):
        kw: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "format": schema,
            "think": False,
            "options": {"temperature": 0.7, "seed": 3, "num_predict": 64},
        }
        if stream:
            text = "".join(p.message.content or "" for p in o.chat(stream=True, **kw))
        else:
            text = o.chat(**kw).message.content or ""
        jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------------ keep_alive


@pytest.fixture
def lazy() -> Iterator[dict[str, Any]]:
    """A server whose model loads on demand (a fresh engine per load)."""
    registry = ModelRegistry(
        ["lazy"],
        loader=lambda src: tiny_model("llama"),
        engine_factory=lambda lm: Engine(lm, EngineConfig(num_blocks=64, block_size=16)),
    )
    try:
        with serve(registry) as srv:
            client = ollama.Client(host=srv.url, timeout=120)
            yield {"ollama": client, "registry": registry}
            client.close()
    finally:
        registry.close()


def test_keep_alive_loads_and_unloads(lazy: dict[str, Any]) -> None:
    o: ollama.Client = lazy["ollama"]
    sm = lazy["registry"].resolve("lazy")
    assert o.ps().models == []
    # An empty request loads the model; a negative keep_alive keeps it.
    r = o.chat(model="lazy", messages=[], keep_alive=-1)
    assert r.done_reason == "load" and sm.state == "loaded"
    [entry] = o.ps().models
    assert entry.model == "lazy" and entry.expires_at.year > 2100
    # A duration: the model stays that long once idle.
    o.chat(model="lazy:latest", messages=[{"role": "user", "content": "hi"}], keep_alive="10m")
    [entry] = o.ps().models
    left = entry.expires_at - dt.datetime.now(dt.timezone.utc)
    assert dt.timedelta(minutes=9) < left <= dt.timedelta(minutes=10)
    # 0 after a request: unloaded once the answer is done.
    r = o.chat(
        model="lazy",
        messages=[{"role": "user", "content": "bye"}],
        keep_alive=0,
        options={"num_predict": 2, "temperature": 0},  # greedy: no end-of-turn draw
    )
    assert r.done and r.eval_count == 2
    wait_until(lambda: sm.state == "unloaded", "keep_alive 0 did not unload the model")
    assert o.ps().models == [] and sm.keep_alive is None  # it lasts until the unload
    # Ollama's own unload request: no prompt, keep_alive 0.
    o.generate(model="lazy")
    assert sm.state == "loaded"
    r = o.generate(model="lazy", keep_alive=0)
    assert r.done_reason == "unload" and sm.state == "unloaded"
    # A later load is not unloaded by an old keep_alive (the server has no idle limit).
    o.generate(model="lazy", prompt="again", options={"num_predict": 1})
    assert lazy["registry"].reap_idle() == [] and sm.state == "loaded"


@pytest.mark.slow
def test_the_embedded_model_says_the_same_in_both_apis(default_model: Any) -> None:
    """SmolLM2 at temperature 0: Ollama chat, streamed and not, and the OpenAI route agree."""
    engine = Engine(default_model, EngineConfig(num_blocks=128))
    messages = [{"role": "user", "content": "Name three colours."}]
    try:
        with serve(registry_for({"smol": engine})) as srv:
            o = ollama.Client(host=srv.url, timeout=300)
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            options = {"temperature": 0, "num_predict": 16}
            plain = o.chat(model="smol", messages=messages, options=options)
            parts = list(o.chat(model="smol", messages=messages, options=options, stream=True))
            c = oa.chat.completions.create(
                model="smol", messages=messages, temperature=0, max_tokens=16
            )
            o.close()
            oa.close()
        assert plain.message.content and plain.message.content == c.choices[0].message.content
        assert "".join(p.message.content or "" for p in parts) == plain.message.content
        assert_at_rest(engine)
    finally:
        engine.close()
