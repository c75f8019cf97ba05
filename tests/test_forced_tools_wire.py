"""Forced tool choices through the official SDKs, parallel calls left at their default.

The embedded SmolLM2 would rather ramble: left alone it writes the same call
again and again. A named choice is exactly one call of that tool and the turn
ends (``tool_calls`` / ``tool_use``); ``required`` / ``any`` is at least one
call, after which the model may stop. In every dialect, at temperature 0 and
0.8, every answer is right when the requests batch and no markup reaches the
text; sent alone, the streamed answer (the SDK's own stream helper, which
parses the argument deltas) equals the JSON one. The batched requests of every
dialect and temperature are sent together, once (the ``batched`` fixture).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from live_server import registry_for, serve
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 40}},
        "required": ["query"],
    },
}
#: (prompt, tool named by the choice or None for required / any). No schema says
#: ``additionalProperties``: forced calls read it as false.
CASES = [
    ("What is the weather in Paris?", None),
    ("What is 2 plus 3?", "add"),
    ("Find news about llamas.", "search"),
    ("Hello!", "get_weather"),
    ("Tell me a joke.", None),
]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def live(default_model) -> Iterator[dict[str, Any]]:
    engine = Engine(default_model, EngineConfig(max_batch=32, num_blocks=2048))
    try:
        with serve(registry_for({"smol": engine})) as srv:
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            an = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
            yield {"openai": oa, "anthropic": an}
            oa.close()
            an.close()
        assert_at_rest(engine)
    finally:
        engine.close()


def check_calls(calls: list[tuple[str, str]], want: str | None) -> None:
    """Named: exactly one call of that tool; required: one or more. Arguments validate
    against the closed schema (no keys beyond the listed ones)."""
    assert calls, "no call"
    if want is not None:
        assert [n for n, _ in calls] == [want], calls
    for name, args in calls:
        closed = {**SCHEMAS[name], "additionalProperties": False}
        jsonschema.validate(json.loads(args), closed)


Case = tuple[str, str | None]
#: ``run(case, stream, cache_salt)``: one request in a dialect, the SDK's answer.
Run = Callable[[Case, bool, str], Any]


def chat_run(live: dict[str, Any], temperature: float) -> Run:
    client: openai.OpenAI = live["openai"]
    tools = [
        {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
        for n, s in SCHEMAS.items()
    ]

    def run(case: Case, stream: bool, salt: str) -> Any:
        prompt, want = case
        choice = "required" if want is None else {"type": "function", "function": {"name": want}}
        kw: dict[str, Any] = {
            "model": "smol",
            "messages": [{"role": "user", "content": prompt}],
            "tools": tools,
            "tool_choice": choice,
            "temperature": temperature,
            "seed": 3,
            "max_tokens": MAX_TOKENS,
            "extra_body": {"cache_salt": salt},
        }
        if not stream:
            return client.chat.completions.create(**kw)
        with client.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            return s.get_final_completion()

    return run


def responses_run(live: dict[str, Any], temperature: float) -> Run:
    client: openai.OpenAI = live["openai"]
    tools = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]

    def run(case: Case, stream: bool, salt: str) -> Any:
        prompt, want = case
        kw: dict[str, Any] = {
            "model": "smol",
            "input": prompt,
            "tools": tools,
            "tool_choice": "required" if want is None else {"type": "function", "name": want},
            "temperature": temperature,
            "max_output_tokens": MAX_TOKENS,
            "extra_body": {"seed": 3, "cache_salt": salt},
        }
        if not stream:
            return client.responses.create(**kw)
        with client.responses.stream(**kw) as s:
            for _ in s:
                pass
            return s.get_final_response()

    return run


def anthropic_run(live: dict[str, Any], temperature: float) -> Run:
    client: anthropic.Anthropic = live["anthropic"]
    tools = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]

    def run(case: Case, stream: bool, salt: str) -> Any:
        prompt, want = case
        kw: dict[str, Any] = {
            "model": "smol",
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": prompt}],
            "tools": tools,
            "tool_choice": {"type": "any"} if want is None else {"type": "tool", "name": want},
            "extra_body": {"temperature": temperature, "seed": 3, "cache_salt": salt},
        }
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    return run


DIALECTS: dict[str, Callable[[dict[str, Any], float], Run]] = {
    "chat": chat_run,
    "responses": responses_run,
    "anthropic": anthropic_run,
}
TEMPERATURES = [0.0, 0.8]
#: The case whose streamed and JSON answers are compared, by temperature: a
#: ``required`` choice (calls may follow one another) and a named tool.
PAIRED = {0.0: CASES[0], 0.8: CASES[2]}


@pytest.fixture(scope="module")
def batched(live) -> dict[tuple[str, float], list[tuple[Case, Any]]]:
    """Every case of every dialect and temperature at once (30 requests, streamed and
    not by turns), so they batch: every answer must be right. Batched, a row's logits
    depend on the rows beside it in each step (products of other shapes round
    differently), so a sampled answer may take another path: equality is not asked
    here (see :func:`pair`)."""
    salt = uuid.uuid4().hex
    runs = {(d, t): make(live, t) for d, make in DIALECTS.items() for t in TEMPERATURES}
    with ThreadPoolExecutor(len(runs) * len(CASES)) as pool:
        jobs = {
            key: [(c, pool.submit(run, c, i % 2 == 1, salt)) for i, c in enumerate(CASES)]
            for key, run in runs.items()
        }
        return {key: [(c, j.result()) for c, j in js] for key, js in jobs.items()}


def pair(run: Run, temperature: float) -> tuple[Case, Any, Any]:
    """:data:`PAIRED`'s case sent alone, JSON then streamed, each under a salt of its
    own (no cached prefix): the two come from the same computation and must be equal.
    Returns (case, JSON answer, streamed answer)."""
    case = PAIRED[temperature]
    return case, run(case, False, uuid.uuid4().hex), run(case, True, uuid.uuid4().hex)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_chat_completions(live, batched, temperature):
    case, whole, streamed = pair(chat_run(live, temperature), temperature)

    def calls(out: Any) -> list[tuple[str, str]]:
        return [(t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls]

    for (prompt, want), out in [*batched["chat", temperature], (case, whole), (case, streamed)]:
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", (prompt, out)
        assert not (c.message.content or "").strip(), out
        check_calls(calls(out), want)
    assert calls(streamed) == calls(whole)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_responses(live, batched, temperature):
    case, whole, streamed = pair(responses_run(live, temperature), temperature)

    def calls(out: Any) -> list[tuple[str, str]]:
        return [(o.name, o.arguments) for o in out.output if o.type == "function_call"]

    for (prompt, want), out in [
        *batched["responses", temperature],
        (case, whole),
        (case, streamed),
    ]:
        assert out.status == "completed", (prompt, out)
        assert not out.output_text.strip(), out
        check_calls(calls(out), want)
    assert calls(streamed) == calls(whole)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_anthropic(live, batched, temperature):
    case, whole, streamed = pair(anthropic_run(live, temperature), temperature)
    for (prompt, want), out in [
        *batched["anthropic", temperature],
        (case, whole),
        (case, streamed),
    ]:
        assert out.stop_reason == "tool_use", (prompt, out)
        assert all(b.type == "tool_use" for b in out.content), out
        check_calls([(b.name, json.dumps(b.input)) for b in out.content], want)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]


@pytest.mark.parametrize("max_tokens", [6, 14, 40])
def test_a_call_cut_by_max_tokens_leaves_no_markup(live, max_tokens):
    """Cut inside its call, the answer ends as cut off (``length`` / ``max_tokens``) with
    no text: the unfinished call's markup never reaches content, streamed or not."""
    oa: openai.OpenAI = live["openai"]
    an: anthropic.Anthropic = live["anthropic"]
    tools = [{"type": "function", "function": {"name": "search", "parameters": SCHEMAS["search"]}}]
    kw: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Find news about llamas."}],
        "tools": tools,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    akw: dict[str, Any] = {
        "model": "smol",
        "max_tokens": max_tokens,
        "messages": kw["messages"],
        "tools": [{"name": "search", "input_schema": SCHEMAS["search"]}],
        "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0},
    }

    def anthropic_streamed() -> Any:
        with an.messages.stream(**akw) as s:
            return s.get_final_message()

    with ThreadPoolExecutor(4) as pool:  # all four at once: they batch
        jobs = [
            pool.submit(oa.chat.completions.create, **kw),
            # The SDK's stream helper refuses a cut answer (LengthFinishReasonError): the raw chunks.
            pool.submit(lambda: [c for c in oa.chat.completions.create(**kw, stream=True)]),
            pool.submit(an.messages.create, **akw),
            pool.submit(anthropic_streamed),
        ]
        out, raw, msg, smsg = (j.result() for j in jobs)
    whole = out.choices[0]
    assert whole.finish_reason == "length", whole
    assert not whole.message.content and not whole.message.tool_calls, whole
    chunks = [c for c in raw if c.choices]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert not [c for c in chunks if c.choices[0].delta.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "length"
    for m in (msg, smsg):
        assert m.stop_reason == "max_tokens" and m.content == [], m


@pytest.mark.parametrize(
    "prompt",
    [
        "Reply only with emoji: 🎉🎉🎉",
        "Translate 'good morning' to Chinese: 早上好",
        "Use the tool to search for llamas.",
    ],
)
def test_logprobs_cover_every_generated_token(live, prompt):
    """One entry per generated token (all but the end of turn), including tokens that
    hold part of a UTF-8 character and tool-call markup; streamed as in JSON."""
    client: openai.OpenAI = live["openai"]
    tools = [{"type": "function", "function": {"name": "search", "parameters": SCHEMAS["search"]}}]
    for max_tokens in (5, 32):
        kw: dict[str, Any] = {
            "model": "smol",
            "messages": [{"role": "user", "content": prompt}],
            "tools": tools,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        # Each under a salt of its own: no cached prefix, the same computation twice.
        whole = client.chat.completions.create(**kw, extra_body={"cache_salt": uuid.uuid4().hex})
        c = whole.choices[0]
        ended = 0 if c.finish_reason == "length" else 1
        assert len(c.logprobs.content) == whole.usage.completion_tokens - ended, whole
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, extra_body={"cache_salt": uuid.uuid4().hex}
            )
        )
        entries = [
            e.token
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content
            for e in ch.choices[0].logprobs.content
        ]
        assert entries == [e.token for e in c.logprobs.content]
