"""Random scripted outputs through the real server: streamed == non-streamed, both dialects.

Each example picks what the scripted model says (optional reasoning, text,
tool calls), stop sequences and a token cap; the ``openai`` SDK's stream
accumulation must equal the non-streamed body, for Chat Completions and for
Responses. The example count is the hypothesis profile's, capped at 25 to keep
the suite short.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say
from test_openai_support import normalize, openai_env

TOOLS_CHAT = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("alpha", "beta")
]
TOOLS_RESP = [
    {"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("alpha", "beta")
]

words = st.lists(
    st.sampled_from(["sun", "moon", "star", "é", "日本", "{x}", "\n", " "]), max_size=6
).map(" ".join)
calls = st.builds(
    lambda name, arg: (
        "<tool_call>\n" + json.dumps({"name": name, "arguments": {"v": arg}}) + "\n</tool_call>"
    ),
    st.sampled_from(["alpha", "beta"]),
    st.sampled_from(["", "a b", "ü", 3]),
)
outputs = st.tuples(
    st.one_of(st.just(""), words.map(lambda w: f"<think>{w}</think>")),
    words,
    st.lists(calls, max_size=2).map("".join),
).map("".join)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


@settings(max_examples=min(settings().max_examples, 25))
@given(
    text=outputs,
    stop=st.lists(st.sampled_from(["moon", "star", "beta", "zzz"]), max_size=2),
    cap=st.sampled_from([None, 3, 8]),
    with_tools=st.booleans(),
)
def test_random_outputs_fold_in_both_dialects(
    env: dict[str, Any], text: str, stop: list[str], cap: int | None, with_tools: bool
) -> None:
    c: openai.OpenAI = env["client"]
    chat_kw: dict[str, Any] = {
        "model": "scripted",
        "temperature": 0,
        "messages": [{"role": "user", "content": say(text)}],
    }
    if stop:
        chat_kw["stop"] = stop
    if cap:
        chat_kw["max_tokens"] = cap
    if with_tools:
        chat_kw["tools"] = TOOLS_CHAT
    with c.chat.completions.stream(
        stream_options={"include_usage": True},
        extra_body={"cache_salt": uuid.uuid4().hex},
        **chat_kw,
    ) as s:
        try:
            streamed = s.get_final_completion()
        except openai.LengthFinishReasonError as e:
            streamed = e.completion
    plain = c.chat.completions.create(extra_body={"cache_salt": uuid.uuid4().hex}, **chat_kw)
    assert normalize(streamed) == normalize(plain)

    resp_kw: dict[str, Any] = {
        "model": "scripted",
        "temperature": 0,
        "input": say(text),
        "store": False,
    }
    if cap:
        resp_kw["max_output_tokens"] = cap
    if with_tools:
        resp_kw["tools"] = TOOLS_RESP
    with c.responses.stream(extra_body={"cache_salt": uuid.uuid4().hex}, **resp_kw) as rs:
        events = list(rs)
    terminal = [e for e in events if e.type in ("response.completed", "response.incomplete")]
    assert len(terminal) == 1 and events[-1] is terminal[0]
    plain_r = c.responses.create(extra_body={"cache_salt": uuid.uuid4().hex}, **resp_kw)
    assert normalize(terminal[0].response) == normalize(plain_r)
    # The two dialects said the same thing (no stop sequences in Responses).
    if not stop:
        visible = "".join(p.text for i in plain_r.output if i.type == "message" for p in i.content)
        assert (plain.choices[0].message.content or "") == visible


def test_engine_at_rest_afterwards(env: dict[str, Any]) -> None:
    assert_at_rest(env["engines"]["scripted"])
