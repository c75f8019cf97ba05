"""Logprobs on the wire: TokenLogprob events -> Chat chunks / Responses events, and the folds.

Hand-built Event streams check the encoding rule
(:class:`mlx_cairn.protocol.openai_common.LogprobHold`): every generated token
(the engine sends none for the end of turn) has one entry, on the chunk that
goes out after it; Chat carries them on text, reasoning, tool-call and finish
chunks alike, Responses on answer text only; the JSON body is the fold of the
chunks, so streaming and non-streaming agree. Anthropic has no
logprobs: its frames are the same with or without TokenLogprob events.

The end-to-end tests at the bottom run the real server (scripted model)
through the ``openai`` SDK; they need the engine to emit TokenLogprob events.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from codec_strategies import run
from mlx_cairn.protocol.anthropic_stream import AnthropicCodec
from mlx_cairn.protocol.openai_chat import ChatCodec
from mlx_cairn.protocol.openai_common import VERY_UNLIKELY, logprob_entry
from mlx_cairn.protocol.openai_responses import parse_responses_request
from mlx_cairn.protocol.openai_responses_stream import ResponsesCodec
from mlx_cairn.types import (
    Admitted,
    Done,
    Error,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from scripted_model import say
from test_openai_support import TOKEN, call, normalize, openai_env, user

DONE = Done("end_turn", usage=Usage(5, 4, 0))


def tl(token: str, lp: float = -0.5, top: tuple[TopLogprob, ...] = (), raw: bytes = b"") -> Any:
    return TokenLogprob(token, 1, lp, tuple(raw), top)


def chat_codec(logprobs: bool = True, allow_tools: bool = True) -> ChatCodec:
    return ChatCodec(
        model="m", input_tokens=5, include_usage=True, allow_tools=allow_tools, logprobs=logprobs
    )


def tokens(entries: list[dict[str, Any]] | None) -> list[str]:
    return [e["token"] for e in entries or []]


def chat_content_logprobs(evs: list[Event], **kw: Any) -> tuple[list[Any], dict[str, Any]]:
    """(chunks with a choice, folded completion) of ``evs`` + DONE."""
    codec = chat_codec(**kw)
    wire = run(codec, [*evs, DONE])
    chunks = [p for _, p in wire if isinstance(p, dict) and p.get("choices")]
    return chunks, codec.fold(wire)


# ------------------------------------------------------------------ entries


def test_entry_shape_clamps_and_sorts() -> None:
    ev = TokenLogprob(
        "é",
        7,
        1e-7,  # float rounding past 0: sent as 0
        (),
        (
            TopLogprob("b", 2, -3.0),
            TopLogprob("a", 1, -0.1, (0x61,)),
            TopLogprob("z", 3, -math.inf),
            TopLogprob("n", 4, math.nan),
        ),
    )
    e = logprob_entry(ev)
    assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
    assert e["token"] == "é" and e["logprob"] == 0.0 and e["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in e["top_logprobs"]] == ["a", "b", "z", "n"]
    assert [t["logprob"] for t in e["top_logprobs"]] == [-0.1, -3.0, VERY_UNLIKELY, VERY_UNLIKELY]
    assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
    # A byte-fallback token: the engine's bytes win over the U+FFFD it shows.
    assert logprob_entry(TokenLogprob("\ufffd", 9, -1.0, (0xE2, 0x82)))["bytes"] == [0xE2, 0x82]


# --------------------------------------------------------------------- chat


def test_chat_text_chunks_carry_their_tokens() -> None:
    evs = [tl("Hel"), tl("lo"), TextDelta("Hello"), tl(" w"), TextDelta(" w")]
    chunks, body = chat_content_logprobs(evs)
    texts = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [tokens(c["choices"][0]["logprobs"]["content"]) for c in texts] == [
        ["Hel", "lo"],
        [" w"],
    ]
    assert all(c["choices"][0]["logprobs"]["refusal"] is None for c in texts)
    # The finish chunk carries nothing: text chunks already did.
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["logprobs"] is None
    lp = body["choices"][0]["logprobs"]
    assert tokens(lp["content"]) == ["Hel", "lo", " w"] and lp["refusal"] is None
    assert body["choices"][0]["message"]["content"] == "Hello w"


def test_chat_every_token_has_one_entry() -> None:
    evs = [
        tl("<think>"),
        tl("plan"),
        ReasoningDelta("plan"),
        tl("</think>"),
        tl("\n\n"),
        tl("Hi"),
        TextDelta("Hi"),
        tl("<tool_call>"),
        tl('{"name": "f"}'),
        ToolCall("call_1", "f", "{}"),
        tl(" "),
        TextDelta(" "),  # whitespace before the end: dropped by the text gate
    ]
    chunks, body = chat_content_logprobs(evs)
    every = [e.token for e in evs if isinstance(e, TokenLogprob)]
    assert tokens(body["choices"][0]["logprobs"]["content"]) == every
    assert body["choices"][0]["message"]["content"] == "Hi"
    carried = [tokens((c["choices"][0]["logprobs"] or {}).get("content")) for c in chunks]
    assert [t for t in carried if t] == [
        ["<think>", "plan"],  # the reasoning chunk
        ["</think>", "\n\n", "Hi"],  # the text chunk
        ["<tool_call>", '{"name": "f"}'],  # the call's first chunk
        [" "],  # the finish chunk: whitespace the gate dropped
    ]


def test_chat_tool_only_answer_carries_the_call_tokens() -> None:
    chunks, body = chat_content_logprobs([tl("<tool_call>"), ToolCall("call_1", "f", "{}")])
    assert chunks[-1]["choices"][0]["logprobs"] is None
    assert tokens(body["choices"][0]["logprobs"]["content"]) == ["<tool_call>"]
    _, body = chat_content_logprobs([])  # an empty answer: an empty logprobs object
    assert body["choices"][0]["logprobs"] == {"content": [], "refusal": None}


def test_chat_tool_call_sent_as_text_keeps_its_tokens() -> None:
    evs = [tl("<tool_call>"), tl("{...}"), ToolCall("call_1", "f", "{}")]
    _, body = chat_content_logprobs(evs, allow_tools=False)
    assert tokens(body["choices"][0]["logprobs"]["content"]) == ["<tool_call>", "{...}"]


def test_chat_held_whitespace_rides_with_the_text_it_precedes() -> None:
    evs = [tl(" "), TextDelta(" "), tl("\n"), TextDelta("\n"), tl("x"), TextDelta("x")]
    chunks, _ = chat_content_logprobs(evs)
    texts = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["delta"]["content"] for c in texts] == [" \nx"]
    assert tokens(texts[0]["choices"][0]["logprobs"]["content"]) == [" ", "\n", "x"]


def test_chat_a_token_split_across_deltas_rides_on_the_first() -> None:
    # The stop-sequence scanner held part of one token's text: its bytes end no delta.
    evs = [tl("ab"), TextDelta("a"), TextDelta("b"), tl("c"), TextDelta("c")]
    chunks, body = chat_content_logprobs(evs)
    texts = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [tokens(c["logprobs"]["content"]) for c in texts] == [["ab"], [], ["c"]]
    assert tokens(body["choices"][0]["logprobs"]["content"]) == ["ab", "c"]


def test_chat_multibyte_character_over_two_tokens() -> None:
    evs = [tl("\ufffd", raw=b"\xe2\x82"), tl("\ufffd", raw=b"\xac"), TextDelta("€")]
    _, body = chat_content_logprobs(evs)
    content = body["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == "€"


def test_chat_without_logprobs_ignores_the_events() -> None:
    evs: list[Event] = [tl("a"), TextDelta("a"), tl("b"), ReasoningDelta("b")]
    plain = [e for e in evs if not isinstance(e, TokenLogprob)]
    a, b = chat_codec(logprobs=False), chat_codec(logprobs=False)
    b.id, b.created = a.id, a.created
    wa, wb = run(a, [*evs, DONE]), run(b, [*plain, DONE])
    assert wa == wb
    assert a.fold(wa)["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["logprobs"] is None for _, c in wa[:-2])


def test_chat_error_after_logprobs() -> None:
    codec = chat_codec()
    wire = run(codec, [tl("a"), TextDelta("a"), Error("internal", "boom")])
    assert "error" in wire[-1][1]
    with pytest.raises(ValueError, match="boom"):
        codec.fold(wire)


# ---------------------------------------------------------------- responses


def responses_codec() -> ResponsesCodec:
    echo = parse_responses_request(
        {"model": "m", "input": "x"}, max_tokens_limit=9, lookup=lambda r: []
    ).echo
    return ResponsesCodec(model="m", input_tokens=5, allow_tools=True, echo=echo)


def message_logprobs(wire: list[Any]) -> list[dict[str, Any]]:
    """Per message item: its delta logprobs joined, its .done logprobs, its final part's."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in wire:
        if name == "response.output_text.delta":
            out.setdefault(p["item_id"], {"deltas": []})["deltas"] += p["logprobs"]
        elif name == "response.output_text.done":
            out.setdefault(p["item_id"], {"deltas": []})["done"] = p["logprobs"]
        elif name == "response.content_part.done" and p["part"]["type"] == "output_text":
            out[p["item_id"]]["part"] = p["part"]["logprobs"]
        elif name == "response.output_item.done" and p["item"]["type"] == "message":
            out[p["item"]["id"]]["item"] = p["item"]["content"][0]["logprobs"]
    return list(out.values())


def test_responses_deltas_parts_and_items_agree() -> None:
    evs = [
        tl("A"),
        TextDelta("A"),
        tl("<think>"),
        tl("r"),
        ReasoningDelta("r"),
        tl("</think>"),
        tl("B"),
        tl("C"),
        TextDelta("BC"),
        tl("<tool_call>"),
        ToolCall("call_1", "f", "{}"),
        tl("D"),
        TextDelta("D"),
        tl("."),  # held at the end (a stop sequence): no text to ride on
    ]
    codec = responses_codec()
    wire = run(codec, [*evs, DONE])
    body = codec.fold(wire)
    per_item = message_logprobs(wire)
    # Reasoning and the call have no place for entries; the closing tag rides on B.
    assert [tokens(m["deltas"]) for m in per_item] == [["A"], ["</think>", "B", "C"], ["D"]]
    for m in per_item:
        assert m["deltas"] == m["done"] == m["part"] == m["item"]
    messages = [o for o in body["output"] if o["type"] == "message"]
    assert [tokens(o["content"][0]["logprobs"]) for o in messages] == [
        ["A"],
        ["</think>", "B", "C"],
        ["D"],
    ]
    assert body == wire[-1][1]["response"]
    # The SDK reads the same events and the same final response.
    openai.types.responses.Response.model_validate(body)


def test_responses_without_logprob_events_send_empty_lists() -> None:
    codec = responses_codec()
    wire = run(codec, [TextDelta("hi"), DONE])
    (m,) = message_logprobs(wire)
    assert m == {"deltas": [], "done": [], "part": [], "item": []}


# ------------------------------------------------- engine-like text streams

pieces = st.text(alphabet=st.sampled_from(list("ab \n.é😀")), min_size=1, max_size=4)
#: Groups of tokens whose text the engine sends as one delta (a held-back stop
#: prefix, a partial character), each maybe after a markup token.
groups = st.lists(st.tuples(st.lists(pieces, min_size=1, max_size=3), st.booleans()), max_size=8)


def engine_like(spec: list[tuple[list[str], bool]]) -> tuple[list[Event], list[str], str]:
    """(events, every token in order, the answer text) of ``spec``."""
    evs: list[Event] = [tl("<m>")]  # e.g. the end of a reasoning block's tag
    text = ""
    for toks, markup in spec:
        if markup:
            evs.append(tl("<m>"))
        evs += [tl(t) for t in toks]
        evs.append(TextDelta("".join(toks)))
        text += "".join(toks)
    every = [e.token for e in evs if isinstance(e, TokenLogprob)]
    return evs, every, text if text.strip() else ""


@given(groups)
@example([(["a"], False)])
@example([([" "], True), (["\n", "x"], True), (["y"], True)])
def test_logprobs_cover_every_token(spec: list[tuple[list[str], bool]]) -> None:
    evs, every, text = engine_like(spec)
    _, body = chat_content_logprobs(evs)
    content = body["choices"][0]["logprobs"]["content"]
    assert (body["choices"][0]["message"]["content"] or "") == text
    assert tokens(content) == every

    # Responses: the tokens up to the answer's last delta ride on its text.
    codec = responses_codec()
    resp = codec.fold(run(codec, [*evs, DONE]))
    parts = [o["content"][0] for o in resp["output"] if o["type"] == "message"]
    assert [p["text"] for p in parts] == ([text] if text else [])
    if text:
        (part,) = parts
        last = max(i for i, t in enumerate(every) if t.strip() and t != "<m>")
        assert tokens(part["logprobs"]) == every[: len(part["logprobs"])]
        assert len(part["logprobs"]) > last


# ---------------------------------------------------------------- anthropic


def test_anthropic_frames_do_not_change_with_logprob_events() -> None:
    evs: list[Event] = [
        tl("x"),
        Admitted(5, 0),
        tl("a"),
        TextDelta("a"),
        tl("t"),
        ReasoningDelta("t"),
        tl("c"),
        ToolCall("toolu_1", "f", '{"a": 1}'),
        tl("e"),
        DONE,
    ]
    plain = [e for e in evs if not isinstance(e, TokenLogprob)]

    def codec() -> AnthropicCodec:
        return AnthropicCodec(model="m", input_tokens=5, show_thinking=True, message_id="msg_1")

    wa, wb = run(codec(), evs), run(codec(), plain)
    assert wa == wb
    assert wa[0][0] == "message_start"  # a TokenLogprob before Admitted opens nothing


# ------------------------------------------------- end to end (needs the engine)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def chat_both(client: openai.OpenAI, **kw: Any) -> tuple[Any, Any, list[Any]]:
    """(SDK-accumulated stream, non-streamed completion, the raw chunks) of one request."""
    with client.chat.completions.stream(
        stream_options={"include_usage": True}, extra_body={"cache_salt": uuid.uuid4().hex}, **kw
    ) as s:
        chunks = [ev.chunk for ev in s if ev.type == "chunk"]
        streamed = s.get_final_completion()
    plain = client.chat.completions.create(extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    return streamed, plain, chunks


def check_entries(content: list[Any], k: int) -> None:
    """Shape and order of logprobs entries (openai SDK objects)."""
    for e in content:
        assert e.logprob <= 0 and isinstance(e.bytes, list)
        assert len(e.top_logprobs) == k
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        if k:
            # The scripted model is greedy and certain: the chosen token is the top one.
            assert e.top_logprobs[0].token == e.token
            assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
            assert e.logprob == pytest.approx(0.0, abs=1e-4)


def same_logprobs(a: list[Any], b: list[Any]) -> None:
    assert [(e.token, e.bytes) for e in a] == [(e.token, e.bytes) for e in b]
    assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-5)


@pytest.mark.parametrize("k", [0, 3])
def test_chat_logprobs_end_to_end(env: dict[str, Any], k: int) -> None:
    text = "Hello there, world!"
    streamed, plain, chunks = chat_both(
        env["client"],
        model="scripted",
        messages=user(say(text)),
        temperature=0,
        logprobs=True,
        top_logprobs=k,
    )
    for completion in (streamed, plain):
        choice = completion.choices[0]
        assert choice.message.content == text
        content = choice.logprobs.content
        assert content, "no logprobs: the engine emits no TokenLogprob events yet"
        check_entries(content, k)
        assert "".join(e.token for e in content) == text
        assert b"".join(bytes(e.bytes) for e in content).decode() == text
    same_logprobs(streamed.choices[0].logprobs.content, plain.choices[0].logprobs.content)
    assert normalize(streamed) == normalize(plain)
    # Each chunk carries the logprobs of exactly the text it carries.
    for c in chunks:
        ch = c.choices[0] if c.choices else None
        if ch is not None and ch.delta.content:
            assert "".join(e.token for e in ch.logprobs.content) == ch.delta.content


def test_chat_logprobs_cover_reasoning_and_tool_calls(env: dict[str, Any]) -> None:
    """Every generated token has an entry: reasoning and tool-call markup too."""
    client = env["client"]
    streamed, plain, _ = chat_both(
        client,
        model="scripted",
        messages=user(say("<think>Plan it.</think>The answer is 4.")),
        reasoning_effort="high",
        logprobs=True,
        top_logprobs=1,
    )
    for completion in (streamed, plain):
        content = completion.choices[0].logprobs.content
        assert completion.choices[0].message.content == "The answer is 4."
        joined = b"".join(bytes(e.bytes) for e in content).decode()
        assert joined == "<think>Plan it.</think>The answer is 4."
        assert len(content) == completion.usage.completion_tokens - 1  # all but the end
        check_entries(content, 1)
    same_logprobs(streamed.choices[0].logprobs.content, plain.choices[0].logprobs.content)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    streamed, plain, _ = chat_both(
        client,
        model="scripted",
        messages=user(say(call("get_weather", city="Paris"))),
        tools=[weather],
        logprobs=True,
    )
    for completion in (streamed, plain):
        assert completion.choices[0].finish_reason == "tool_calls"
        content = completion.choices[0].logprobs.content
        assert len(content) == completion.usage.completion_tokens - 1
        assert b"".join(bytes(e.bytes) for e in content).decode().startswith("<tool_call>")
    same_logprobs(streamed.choices[0].logprobs.content, plain.choices[0].logprobs.content)


def test_chat_without_logprobs_has_none(env: dict[str, Any]) -> None:
    streamed, plain, chunks = chat_both(env["client"], model="scripted", messages=user(say("hi")))
    assert streamed.choices[0].logprobs is None and plain.choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


def test_responses_logprobs_end_to_end(env: dict[str, Any]) -> None:
    client: openai.OpenAI = env["client"]
    text = "Stream me, please."
    kw: dict[str, Any] = {
        "model": "scripted",
        "input": say(text),
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "temperature": 0,
        "store": False,
    }
    plain = client.responses.create(**kw)
    deltas: list[Any] = []
    with client.responses.stream(**kw) as s:
        for ev in s:
            if ev.type == "response.output_text.delta":
                deltas += ev.logprobs
        streamed = s.get_final_response()
    assert plain.top_logprobs == 2
    for resp in (plain, streamed):
        (part,) = resp.output[0].content
        assert part.text == text
        assert part.logprobs, "no logprobs: the engine emits no TokenLogprob events yet"
        check_entries(part.logprobs, 2)
        assert b"".join(bytes(e.bytes) for e in part.logprobs).decode() == text
    same_logprobs(plain.output[0].content[0].logprobs, streamed.output[0].content[0].logprobs)
    assert [(d.token, d.logprob) for d in deltas] == [
        (e.token, e.logprob) for e in streamed.output[0].content[0].logprobs
    ]
    # Without include: no logprobs (as OpenAI), even with top_logprobs.
    bare = client.responses.create(**{**kw, "include": None})
    assert bare.output[0].content[0].logprobs == []


def test_logit_bias_out_of_vocabulary_is_a_400(env: dict[str, Any]) -> None:
    client: openai.OpenAI = env["client"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="scripted", messages=user(say("hi")), logit_bias={str(2**31 - 1): 1}
        )
    assert ei.value.param == "logit_bias"  # type: ignore[attr-defined]


def test_processor_fields_run_in_every_dialect(env: dict[str, Any]) -> None:
    """In-range settings reach the engine and run; the scripted model is certain
    enough (logits +-50) that none of them changes its answer."""
    fields: dict[str, Any] = {
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"0": -1},
        "min_p": 0.05,
        "top_k": 5,
        "seed": 1,
    }
    client: openai.OpenAI = env["client"]
    text = "Same answer twice."
    out = client.chat.completions.create(
        model="scripted", messages=user(say(text)), extra_body=fields
    )
    assert out.choices[0].message.content == text
    resp = client.responses.create(model="scripted", input=say(text), extra_body=fields)
    assert resp.output_text == text
    with anthropic.Anthropic(base_url=env["url"], api_key=TOKEN, max_retries=0) as ac:
        msg = ac.messages.create(
            model="scripted", max_tokens=64, messages=user(say(text)), extra_body=fields
        )
    assert [b.text for b in msg.content if b.type == "text"] == [text]
