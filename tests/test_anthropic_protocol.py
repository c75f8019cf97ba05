"""Anthropic request mapping and the stream codec, without a model or a server."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.anthropic import (
    TITLE_MAX_TOKENS,
    parse_count_tokens_request,
    parse_messages_request,
)
from mlx_cairn.protocol.anthropic_stream import AnthropicCodec, fold_events
from mlx_cairn.protocol.codec import encode
from mlx_cairn.types import (
    Admitted,
    Done,
    Error,
    ReasoningDelta,
    TextDelta,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)

#: Claude Code request bodies (tests/fixtures/claude-code/README.md).
FIXTURES = Path(__file__).parent / "fixtures" / "claude-code"


def base(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(kw)
    return body


def parse(body: Any) -> Any:
    return parse_messages_request(body, max_tokens_limit=1000)


# ------------------------------------------------------------------ validation

BAD = [
    ([1, 2], "JSON object"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, "model"),
    (base(model=""), "model"),
    ({"model": "m", "max_tokens": 1}, "messages"),
    (base(messages=[]), "messages"),
    (base(messages="hi"), "messages"),
    (base(messages=["hi"]), "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (base(max_tokens="12"), "max_tokens"),
    (base(max_tokens=1.5), "max_tokens"),
    (base(max_tokens=True), "max_tokens"),
    (base(max_tokens=0), "max_tokens"),
    (base(max_tokens=1001), "max_tokens"),
    (base(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (base(messages=[{"role": "user"}]), "messages[0].content"),
    (base(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (base(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages[0].content[0].type"),
    (
        base(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (base(messages=[{"role": "user", "content": ["x"]}]), "messages[0].content[0]"),
    (
        base(messages=[{"role": "user", "content": [{"type": "weird"}]}]),
        "messages[0].content[0].type",
    ),
    (
        base(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
        "messages[0].content[0].tool_use_id",
    ),
    (
        base(
            messages=[
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}],
                }
            ]
        ),
        "messages[0].content[0].input",
    ),
    (
        base(
            messages=[
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t",
                            "name": "f",
                            "input": {"a": json.loads("[" * 300 + "]" * 300)},
                        }
                    ],
                }
            ]
        ),
        "messages[0].content[0].input",
    ),
    (base(system=5), "system"),
    (base(system=[{"type": "image"}]), "system[0].type"),
    (base(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (base(tools=[{"input_schema": {}}]), "tools[0].name"),
    (base(tool_choice={"type": "maybe"}), "tool_choice.type"),
    (base(thinking={"type": "on"}), "thinking.type"),
    (base(thinking={"type": "enabled", "budget_tokens": "x"}), "thinking.budget_tokens"),
    (base(temperature=3), "temperature"),
    (base(top_p=0), "top_p"),
    (base(top_k=-1), "top_k"),
    (base(stop_sequences="x"), "stop_sequences"),
    (base(stop_sequences=[""]), "stop_sequences[0]"),
    (base(stop_sequences=["x"] * 65), "stop_sequences"),
    (base(stream="yes"), "stream"),
    (base(cache_salt=""), "cache_salt"),
    (base(cache_salt=7), "cache_salt"),
]


@pytest.mark.parametrize(("body", "field"), BAD)
def test_invalid_bodies_name_the_field(body: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse(body)
    assert field in str(ei.value)
    if field != "JSON object":
        assert str(ei.value).startswith(field)


def test_unknown_fields_are_ignored() -> None:
    r = parse(base(metadata={"user_id": "u"}, context_management={"edits": []}, whatever=[1]))
    assert r.chat.messages[-1].content == "hi"


def test_system_blocks_and_billing_header() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
        {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "x-anthropic-billing-header: kept, not the first"},
    ]
    r = parse(base(system=system))
    sysmsg = r.chat.messages[0]
    assert sysmsg.role == "system"
    assert sysmsg.content == "You are helpful.\nx-anthropic-billing-header: kept, not the first"
    assert parse(base(system="plain")).chat.messages[0].content == "plain"


def test_tool_results_follow_the_tool_use_order() -> None:
    body = json.loads((FIXTURES / "tool_followup.json").read_text())
    r = parse_messages_request(body, max_tokens_limit=100_000)
    roles = [m.role for m in r.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    asst = r.chat.messages[2]
    assert asst.reasoning == "I should read the README and the Makefile."
    assert asst.content == "Let me look at both files."
    assert [tc.id for tc in asst.tool_calls] == ["toolu_01A", "toolu_01B"]
    assert json.loads(asst.tool_calls[0].arguments) == {"file_path": "README.md"}
    a, b = r.chat.messages[3], r.chat.messages[4]
    assert (a.tool_call_id, a.name, a.is_error) == ("toolu_01A", "Read", False)
    assert a.content == "     1\t# demo\n     2\tA small demo project.\n"
    assert (b.tool_call_id, b.is_error) == ("toolu_01B", True)
    assert "billing" not in r.chat.messages[0].content
    assert r.stream and r.show_thinking and r.chat.reasoning is True
    assert [t.name for t in r.chat.tools] == ["Bash", "Read", "Glob"]


def test_tool_results_with_text_and_unknown_ids() -> None:
    msgs = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                {"type": "tool_use", "id": "b", "name": "g", "input": {"x": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "here you go"},
                {"type": "tool_result", "tool_use_id": "zzz", "content": "?"},
                {
                    "type": "tool_result",
                    "tool_use_id": "b",
                    "content": [{"type": "text", "text": "B"}],
                },
                {"type": "tool_result", "tool_use_id": "a", "content": "A"},
                {"type": "document", "source": {"type": "text", "data": ""}},
            ],
        },
    ]
    r = parse(base(messages=msgs))
    got = [(m.role, m.tool_call_id, m.content) for m in r.chat.messages[2:]]
    assert got == [
        ("tool", "a", "A"),
        ("tool", "b", "B"),
        ("tool", "zzz", "?"),
        ("user", None, "here you go\n[document omitted: not read by this server]"),
    ]
    assert r.chat.messages[2].name == "f" and r.chat.messages[3].name == "g"


def test_options_mapping() -> None:
    r = parse(
        base(
            temperature=0,
            top_p=0.5,
            top_k=7,
            stop_sequences=["###", "END"],
            tools=[
                {"name": "f", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            tool_choice={"type": "tool", "name": "f"},
            thinking={"type": "disabled"},
        )
    )
    c = r.chat
    assert (c.sampling.temperature, c.sampling.top_p, c.sampling.top_k) == (0.0, 0.5, 7)
    assert c.stop == ["###", "END"]
    assert [t.name for t in c.tools] == ["f"]  # server-side tools are skipped
    assert c.tool_choice == {"name": "f"}
    assert c.reasoning is False and not r.show_thinking
    assert (
        parse(
            base(tool_choice={"type": "any"}, tools=[{"name": "f", "input_schema": {}}])
        ).chat.tool_choice
        == "required"
    )
    assert parse(base()).chat.reasoning is False  # Anthropic: thinking is off unless asked
    assert c.cache_salt is None and parse(base(cache_salt="t1")).chat.cache_salt == "t1"


def test_title_request_gets_a_small_cap_and_no_reasoning() -> None:
    body = json.loads((FIXTURES / "title.json").read_text())
    body["thinking"] = {"type": "enabled", "budget_tokens": 2000}
    r = parse_messages_request(body, max_tokens_limit=100_000)
    assert r.is_title and r.chat.max_tokens == TITLE_MAX_TOKENS
    assert r.chat.reasoning is False and not r.show_thinking
    assert [m.role for m in r.chat.messages] == ["system", "user"]
    assert not r.chat.messages[0].content.startswith("x-anthropic-billing-header")


def test_count_tokens_needs_no_max_tokens() -> None:
    body = json.loads((FIXTURES / "count_tokens.json").read_text())
    r = parse_count_tokens_request(body)
    assert r.chat.messages[-1].role == "tool"
    full = copy.deepcopy(body) | {"max_tokens": 100}
    assert parse_messages_request(full, max_tokens_limit=1000).chat.messages == r.chat.messages


@pytest.mark.parametrize("name", ["agent_turn", "tool_followup", "title", "quota_probe"])
def test_claude_code_fixtures_parse(name: str) -> None:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    r = parse_messages_request(body, max_tokens_limit=100_000)
    assert r.chat.messages


# ----------------------------------------------------------------------- codec


def codec(show_thinking: bool = True, allow_tools: bool = True) -> AnthropicCodec:
    return AnthropicCodec(
        model="m",
        input_tokens=7,
        show_thinking=show_thinking,
        allow_tools=allow_tools,
        message_id="msg_x",
    )


def run(c: AnthropicCodec, events: list[Any]) -> list[Any]:
    wire = c.open()
    for ev in events:
        wire += c.feed(ev)
    return wire


DONE = Done("end_turn", usage=Usage(7, 3, 4), timings=Timings(1.0, 2.0, 3.0, 4.0))


def test_event_order_and_usage() -> None:
    c = codec()
    assert c.open() == []  # message_start waits for admission
    wire = run(
        c,
        [
            Admitted(7, 4),
            ReasoningDelta("r"),
            TextDelta("hi"),
            ToolCall("call_1", "f", '{"a": 1}'),
            DONE,
        ],
    )
    names = [n for n, _ in wire]
    assert names == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    indices = [p["index"] for n, p in wire if n.startswith("content_block")]
    assert indices == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Anthropic usage: input_tokens excludes cache reads; the three add up to the prompt.
    start_usage = wire[0][1]["message"]["usage"]
    assert start_usage == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 0,
    }
    delta = wire[-2][1]
    assert delta["usage"]["input_tokens"] == 3
    assert delta["usage"]["cache_creation_input_tokens"] == 0
    assert delta["usage"]["cache_read_input_tokens"] == 4
    assert delta["usage"]["output_tokens"] == 3
    assert delta["usage"]["timings"] == {
        "queue_ms": 1.0, "ttft_ms": 2.0, "prefill_tokens_per_s": 3.0, "decode_tokens_per_s": 4.0
    }  # fmt: skip
    tool_block = wire[7][1]["content_block"]
    assert tool_block["id"].startswith("toolu_") and tool_block["input"] == {}
    msg = fold_events(wire)
    assert msg["content"][2]["input"] == {"a": 1}
    assert msg["stop_reason"] == "end_turn"


def test_whitespace_before_a_tool_call_opens_no_text_block() -> None:
    wire = run(codec(), [TextDelta("\n"), TextDelta("  "), ToolCall("t", "f", "{}"), DONE])
    msg = fold_events(wire)
    assert [b["type"] for b in msg["content"]] == ["tool_use"]
    wire = run(codec(), [TextDelta("\n"), TextDelta(" x"), DONE])
    assert fold_events(wire)["content"] == [{"type": "text", "text": "\n x"}]


def test_hidden_thinking_and_tools_as_text() -> None:
    msg = fold_events(
        run(codec(show_thinking=False), [ReasoningDelta("secret"), TextDelta("a"), DONE])
    )
    assert msg["content"] == [{"type": "text", "text": "a"}]
    msg = fold_events(run(codec(allow_tools=False), [ToolCall("t", "f", '{"x": 1}'), DONE]))
    assert msg["content"][0]["type"] == "text"
    assert json.loads(msg["content"][0]["text"]) == {"name": "f", "arguments": {"x": 1}}


def test_error_ends_the_stream_without_message_stop() -> None:
    wire = run(codec(), [TextDelta("a"), Error("internal", "boom")])
    assert wire[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    assert "message_stop" not in [n for n, _ in wire]
    with pytest.raises(ValueError, match="boom"):
        fold_events(wire)


# The SDK's own decoder + accumulator over our SSE bytes equals our fold.

text_st = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
event_st = st.one_of(
    text_st.map(TextDelta),
    text_st.map(ReasoningDelta),
    st.builds(
        lambda name, args: ToolCall("call_x", name or "f", json.dumps(args)),
        st.text(st.characters(min_codepoint=97, max_codepoint=122), max_size=5),
        st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), text_st), max_size=3),
    ),
)


def sdk_accumulate(raw: bytes) -> dict[str, Any]:
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    chunks = iter([raw[i : i + 7] for i in range(0, len(raw), 7)])
    for sse in SSEDecoder().iter_bytes(chunks):
        snapshot = accumulate_event(
            event=sse.json(), current_snapshot=snapshot, json_bufs=json_bufs
        )
    assert snapshot is not None
    return snapshot.to_dict()


@given(
    st.lists(event_st, max_size=12),
    st.booleans(),
    st.sampled_from(["end_turn", "max_tokens", "stop_sequence", "tool_use"]),
)
def test_sdk_accumulated_stream_equals_fold(events: list[Any], show: bool, reason: str) -> None:
    done = Done(
        reason, matched_stop="S" if reason == "stop_sequence" else None, usage=Usage(7, 5, 2)
    )  # type: ignore[arg-type]
    c = codec(show_thinking=show)
    wire = run(c, [*events, done])
    raw = b"".join(encode(w) for w in wire)
    folded = fold_events(wire)
    streamed = sdk_accumulate(raw)
    folded["usage"].pop("timings")  # only in the final usage, which the SDK copies by field
    assert streamed.pop("stop_details", None) is None
    assert streamed == folded


@given(st.lists(event_st, max_size=10), st.lists(st.booleans(), max_size=14), st.booleans())
def test_token_logprobs_change_no_frame(events: list[Any], marks: list[bool], show: bool) -> None:
    """The Messages API has no logprobs: TokenLogprob events, wherever they come
    (even before Admitted), leave every frame as it was."""
    evs = [dataclasses.replace(e, id="toolu_x") if isinstance(e, ToolCall) else e for e in events]
    plain = [Admitted(7, 2), *evs, DONE]
    mixed: list[Any] = []
    for i, ev in enumerate(plain):
        if i < len(marks) and marks[i]:
            mixed.append(TokenLogprob("t", 5, -0.25, (0x74,)))
        mixed.append(ev)
    if marks and marks[-1]:
        mixed.insert(-1, TokenLogprob("<eos>", 6, -0.01))
    assert run(codec(show_thinking=show), mixed) == run(codec(show_thinking=show), plain)


def test_unserializable_tool_arguments_come_back_as_text() -> None:
    deep = "[" * 400 + "]" * 400
    for args in ("not json", "[1, 2]", '{"a": ' + deep + "}"):
        msg = fold_events(run(codec(), [ToolCall("t", "f", args), DONE]))
        assert [b["type"] for b in msg["content"]] == ["text"]
        assert json.loads(msg["content"][0]["text"])["name"] == "f"


# ------------------------------------------------------- what current clients send

CACHE = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}


def test_system_turns_anywhere_stay_in_place() -> None:
    r = parse(
        base(
            system=[{"type": "text", "text": "lead", **CACHE}],
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "env", **CACHE}]},
                {"role": "assistant", "content": "b"},
                {"role": "system", "content": "late"},
                {"role": "user", "content": "c"},
            ],
        )
    )
    got = [(m.role, m.content) for m in r.chat.messages]
    assert got == [
        ("system", "lead"),
        ("user", "a"),
        ("system", "env"),
        ("assistant", "b"),
        ("system", "late"),
        ("user", "c"),
    ]
    with pytest.raises(InvalidRequest, match=r"messages\[1\].content\[0\].type"):
        parse(
            base(
                messages=[
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": [{"type": "image"}]},
                ]
            )
        )


def test_fields_claude_code_sends_are_accepted() -> None:
    """Cache markers on every block, tool flags, metadata, context management, effort."""
    tool = {
        "name": "Read",
        "description": "read a file",
        "input_schema": {"type": "object"},
        "strict": True,
        "defer_loading": True,
        "eager_input_streaming": True,
        **CACHE,
    }
    r = parse(
        base(
            system=[{"type": "text", "text": "s", **CACHE}],
            tools=[tool, {"type": "web_search_20250305", "name": "web_search"}],
            metadata={"user_id": "u"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={"effort": "max"},
            thinking={"type": "adaptive", "display": "updates"},
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "q", **CACHE}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "t", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search"},
                        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}, **CACHE},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "file body", **CACHE},
                                {"type": "tool_reference", "tool_name": "Grep"},
                                {
                                    "type": "search_result",
                                    "title": "T",
                                    "source": "S",
                                    "content": [{"type": "text", "text": "found"}],
                                },
                            ],
                            **CACHE,
                        },
                        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1"},
                    ],
                },
            ],
        )
    )
    assert [t.name for t in r.chat.tools] == ["Read"]
    assert (r.chat.reasoning, r.chat.reasoning_budget, r.show_thinking) == (True, None, True)
    tool_msg = next(m for m in r.chat.messages if m.role == "tool")
    assert tool_msg.content == "file body\n[tool available: Grep]\nT\nS\nfound"
    assert r.chat.messages[2].reasoning == "t"
