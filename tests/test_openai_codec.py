"""The OpenAI encoders without a server: folds, SDK accumulation, wire invariants, mapping.

For random Event streams (text with whitespace, reasoning, tool calls with
good and bad arguments, token logprobs, every stop reason), the chunks /
events each codec emits are folded by our fold AND accumulated by the
``openai`` SDK's own stream state; the two must agree, and the stream must
obey the wire rules.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

import openai
import PIL.Image
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

import codec_strategies as strategies
from codec_strategies import dones, run, texts, tool_calls
from mlx_cairn.api.openai_responses import ResponseStore
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.openai_chat import ChatCodec, parse_chat_request
from mlx_cairn.protocol.openai_common import TextGate
from mlx_cairn.protocol.openai_responses import ResponseNotFound, parse_responses_request
from mlx_cairn.protocol.openai_responses_stream import ResponsesCodec
from mlx_cairn.types import (
    IMAGE_MARK,
    Done,
    Error,
    Event,
    Message,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
)
from test_openai_support import normalize

logprobs_st = st.floats(max_value=1e-6) | st.just(-math.inf) | st.just(math.nan)
token_logprobs = strategies.token_logprobs(
    logprobs_st, raw=st.sampled_from([(), (0xE2,), (0x61, 0x62)])
)
events = st.lists(
    st.one_of(
        st.builds(TextDelta, texts),
        st.builds(ReasoningDelta, texts),
        tool_calls,
        token_logprobs,
        token_logprobs,
    ),
    max_size=12,
)


# ------------------------------------------------------------------ chat


def check_logprob_entries(entries: list[Any], evs: list[Event]) -> None:
    """Entries are some of the TokenLogprobs, in order, each in the wire's bounds."""
    sent = [e for e in evs if isinstance(e, TokenLogprob)]
    pos = 0
    for entry in entries:
        while sent[pos].token != entry["token"]:  # IndexError: not a subsequence
            pos += 1
        pos += 1
        for lp in [entry["logprob"]] + [t["logprob"] for t in entry["top_logprobs"]]:
            assert -9999.0 <= lp <= 0.0
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)


@given(evs=events, done=dones, allow_tools=st.booleans(), logprobs=st.booleans())
def test_chat_fold_equals_sdk_accumulation(
    evs: list[Event], done: Done, allow_tools: bool, logprobs: bool
) -> None:
    codec = ChatCodec(
        model="m", input_tokens=7, include_usage=True, allow_tools=allow_tools, logprobs=logprobs
    )
    wire = run(codec, [*evs, done])
    body = codec.fold(wire)

    # Wire rules: no event names, [DONE] last, usage chunk just before it.
    assert all(name is None for name, _ in wire)
    assert wire[-1] == (None, "[DONE]")
    chunks = [p for _, p in wire[:-1]]
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["prompt_tokens"] == done.usage.input_tokens
    )
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    heads: dict[int, int] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] not in heads:
                heads[tc["index"]] = 1
                assert tc["id"].startswith("call_") and tc["function"]["name"]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
    assert sorted(heads) == list(range(len(heads)))

    # The SDK accumulates the very same chunks into the same completion.
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    try:
        sdk = state.get_final_completion()
    except openai.LengthFinishReasonError as e:
        sdk = e.completion
    mine = openai.types.chat.ChatCompletion.model_validate(body)
    assert normalize(sdk) == normalize(mine)

    # What the message says.
    msg = body["choices"][0]["message"]
    good = [
        e
        for e in evs
        if isinstance(e, ToolCall)
        and allow_tools
        and e.arguments in ('{"a": 1}', "{}", '{"s": "b\\n"}')
    ]
    assert [t["function"]["arguments"] for t in msg.get("tool_calls", [])] == [
        t.arguments for t in good
    ]
    reasoning = "".join(e.text for e in evs if isinstance(e, ReasoningDelta))
    assert msg.get("reasoning_content", "") == reasoning
    finish = body["choices"][0]["finish_reason"]
    expected = "length" if done.stop_reason == "max_tokens" else "tool_calls" if good else "stop"
    assert finish == expected
    if not good and not any(isinstance(e, ToolCall) for e in evs):
        visible = "".join(e.text for e in evs if isinstance(e, TextDelta))
        assert (msg["content"] or "").strip() == visible.strip()

    # Logprobs: an object exactly when asked; every TokenLogprob has one entry, in
    # order, riding on the first chunk sent after it (a text chunk always carries the
    # object, other chunks only when they carry entries).
    lp = body["choices"][0]["logprobs"]
    if not logprobs:
        assert lp is None
        assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])
        return
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    check_logprob_entries(lp["content"], evs)
    assert [e["token"] for e in lp["content"]] == [
        e.token for e in evs if isinstance(e, TokenLogprob)
    ]
    for c in chunks[:-1]:
        ch = c["choices"][0]
        if ch["delta"].get("content"):
            assert ch["logprobs"] is not None
        elif ch["logprobs"] is not None and not ch["finish_reason"]:
            assert ch["logprobs"]["content"], ch


def test_chat_error_chunk_and_no_done() -> None:
    codec = ChatCodec(model="m", input_tokens=1, include_usage=False, allow_tools=False)
    wire = run(codec, [TextDelta("hi"), Error("internal", "boom")])
    assert wire[-1] == (
        None,
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
    )
    with pytest.raises(ValueError, match="boom"):
        codec.fold(wire)


def test_text_gate_holds_only_leading_whitespace() -> None:
    g = TextGate()
    assert [g.push(t) for t in ("\n", " ", "a", " ", "\n")] == ["", "", "\n a", " ", "\n"]
    g.drop()
    assert g.push("\n\n") == "" and g.push("b") == "\n\nb"


# ------------------------------------------------------------- responses


_EVENT = TypeAdapter(ResponseStreamEvent)


@given(evs=events, done=dones, allow_tools=st.booleans())
def test_responses_fold_equals_terminal_and_sdk(
    evs: list[Event], done: Done, allow_tools: bool
) -> None:
    stored: list[dict[str, Any]] = []
    echo = parse_responses_request(
        {"model": "m", "input": "x"}, max_tokens_limit=9, lookup=lambda r: []
    ).echo
    codec = ResponsesCodec(
        model="m", input_tokens=7, allow_tools=allow_tools, echo=echo, on_finish=stored.append
    )
    wire = run(codec, [*evs, done])
    body = codec.fold(wire)
    terminal = wire[-1][1]["response"]
    assert body == terminal == stored[0]
    assert [p["sequence_number"] for _, p in wire] == list(range(len(wire)))
    assert wire[-1][0] == (
        "response.incomplete" if done.stop_reason == "max_tokens" else "response.completed"
    )
    # Items open and close strictly one after another.
    open_items: list[int] = []
    for name, p in wire:
        if name == "response.output_item.added":
            assert not open_items
            open_items.append(p["output_index"])
        elif name == "response.output_item.done":
            assert open_items == [p["output_index"]]
            open_items.clear()
        elif "output_index" in p:
            assert open_items == [p["output_index"]], name
    state: ResponseStreamState[Any] = ResponseStreamState(
        input_tools=openai.omit, text_format=openai.omit
    )
    for _, p in wire:
        state.handle_event(_EVENT.validate_python(p))
    # Logprobs: a message's deltas carry exactly what its final part lists.
    deltas: dict[str, list[Any]] = {}
    for name, p in wire:
        if name == "response.output_text.delta":
            deltas.setdefault(p["item_id"], []).extend(p["logprobs"])
    for item in body["output"]:
        if item["type"] == "message":
            part_lps = item["content"][0]["logprobs"]
            assert deltas.get(item["id"], []) == part_lps
            check_logprob_entries(part_lps, evs)
    if done.stop_reason != "max_tokens":
        sdk = state._completed_response
        assert sdk is not None
        assert normalize(sdk) == normalize(openai.types.responses.Response.model_validate(body))


def test_responses_failure_events() -> None:
    codec = ResponsesCodec(
        model="m",
        input_tokens=1,
        allow_tools=True,
        echo={},
        on_finish=lambda r: pytest.fail("stored"),
    )
    wire = run(codec, [TextDelta("hi"), Error("internal", "boom")])
    assert [n for n, _ in wire[-3:]] == ["response.output_item.done", "error", "response.failed"]
    assert wire[-1][1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    with pytest.raises(ValueError, match="boom"):
        codec.fold(wire)


# --------------------------------------------------------------- mapping

_PIXEL = io.BytesIO()
PIL.Image.new("RGB", (1, 1)).save(_PIXEL, "PNG")
_PIXEL_URL = "data:image/png;base64," + base64.b64encode(_PIXEL.getvalue()).decode()


def test_chat_mapping() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "dev"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": _PIXEL_URL}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "r",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "out"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g"}},
                {"type": "custom", "custom": {}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "stop": "x",
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown_field": 1,
        },
        max_tokens_limit=100,
    )
    m = req.chat.messages
    assert [x.role for x in m] == ["system", "user", "assistant", "tool"]
    assert m[1].content == "a" + IMAGE_MARK and len(m[1].images) == 1
    assert m[2].reasoning == "r" and m[2].tool_calls == [ToolCall("c1", "f", "{}")]
    assert m[3].tool_call_id == "c1" and m[3].name == "f"
    assert [t.name for t in req.chat.tools] == ["g"] and req.chat.tool_choice == {"name": "g"}
    assert req.chat.max_tokens == 5 and req.chat.stop == ["x"] and req.chat.sampling.seed == 3
    assert req.stream and req.include_usage and not req.open_ended
    open_req = parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}, max_tokens_limit=100
    )
    assert open_req.open_ended and open_req.chat.max_tokens == 100


def test_responses_mapping_and_lookup() -> None:
    prior = [Message("user", "earlier"), Message("assistant", "reply")]

    def lookup(rid: str) -> list[Message]:
        if rid != "resp_1":
            raise ResponseNotFound("gone", param="previous_response_id")
        return prior

    req = parse_responses_request(
        {
            "model": "m",
            "instructions": "be brief",
            "previous_response_id": "resp_1",
            "input": [
                {
                    "type": "reasoning",
                    "id": "rs",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "calling"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
                {"type": "function_call_output", "call_id": "c2", "output": "two"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "one"}],
                },
            ],
        },
        max_tokens_limit=50,
        lookup=lookup,
    )
    m = req.chat.messages
    assert m[0] == Message("system", "be brief") and m[1:3] == prior
    turn = m[3]
    assert (turn.role, turn.content, turn.reasoning) == ("assistant", "calling", "think")
    assert [t.id for t in turn.tool_calls] == ["c1", "c2"]
    assert [(x.role, x.tool_call_id, x.name, x.content) for x in m[4:]] == [
        ("tool", "c2", "g", "two"),
        ("tool", "c1", "f", "one"),
    ]
    assert req.history == m[1:]  # instructions are not part of the stored conversation
    with pytest.raises(ResponseNotFound):
        parse_responses_request(
            {"model": "m", "input": "x", "previous_response_id": "resp_2"},
            max_tokens_limit=50,
            lookup=lookup,
        )
    with pytest.raises(InvalidRequest, match="input"):
        parse_responses_request(
            {"model": "m", "input": [{"type": "message", "role": "user", "content": 3}]},
            max_tokens_limit=50,
            lookup=lookup,
        )


def test_response_store_limits() -> None:
    now = [0.0]
    store = ResponseStore(max_items=3, ttl_s=10, clock=lambda: now[0])
    for i in range(5):
        now[0] += 1
        store.put(f"r{i}", [Message("user", str(i))], {"id": f"r{i}"})
    assert len(store) == 3
    for gone in ("r0", "r1"):
        with pytest.raises(ResponseNotFound):
            store.get(gone)
    assert store.get("r4").messages == [Message("user", "4")]
    now[0] = 13.5  # r2 was stored at 3: 10.5 s old
    with pytest.raises(ResponseNotFound):
        store.get("r2")
    assert store.get("r3").body == {"id": "r3"}
    store.delete("r3")
    with pytest.raises(ResponseNotFound):
        store.delete("r3")
    with pytest.raises(ValueError):
        ResponseStore(max_items=0)
    assert json.dumps(store.get("r4").body) == '{"id": "r4"}'
