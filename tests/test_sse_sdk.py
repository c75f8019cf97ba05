"""Frames from mlx_cairn.sse decode with the official anthropic and openai SDKs."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import anthropic
import anthropic._streaming as a_stream
import httpx2
import openai
import openai._streaming as o_stream
import pytest
from anthropic.lib.streaming import MessageStream
from anthropic.types import RawMessageStreamEvent
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionChunk

from mlx_cairn.sse import SseDecoder, encode_comment, encode_event, encode_ping

URL = "http://127.0.0.1:9"


def chunked(body: bytes, rng: random.Random) -> Iterator[bytes]:
    i = 0
    while i < len(body):
        n = rng.randint(1, 9)
        yield body[i : i + n]
        i += n


def anthropic_frames(text: str) -> bytes:
    msg = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "smollm2",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 0},
    }
    events = [
        ("message_start", {"type": "message_start", "message": msg}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
    ]  # fmt: skip
    frames = [encode_event(n, json.dumps(d)) for n, d in events]
    frames += [encode_ping(), encode_comment("keep-alive")]
    for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
        delta = {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": piece}}  # fmt: skip
        # Pretty-printed JSON spans several lines: several `data:` lines.
        frames.append(encode_event("content_block_delta", json.dumps(delta, indent=2)))
    tail = [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"input_tokens": 12, "output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    frames += [encode_event(n, json.dumps(d)) for n, d in tail]
    return b"".join(frames)


@pytest.mark.parametrize("seed", range(5))
def test_anthropic_sdk_reads_a_message_stream(seed: int) -> None:
    text = "Hello,\nworld\r\n — ünïcödé 🙂"
    body = anthropic_frames(text)
    client = anthropic.Anthropic(api_key="x", base_url=URL, max_retries=0)
    resp = httpx2.Response(
        200,
        content=chunked(body, random.Random(seed)),
        request=httpx2.Request("POST", URL + "/v1/messages"),
    )
    raw = anthropic.Stream(cast_to=RawMessageStreamEvent, response=resp, client=client)
    final = MessageStream(raw, output_format=anthropic.NOT_GIVEN).get_final_message()
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 2)


def test_openai_sdk_reads_chat_chunks() -> None:
    pieces = ["Hel", "lo\n", "wor\r\nld", ""]
    frames = []
    for i, p in enumerate(pieces):
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "smollm2",
            "choices": [{"index": 0, "delta": {"content": p},
                         "finish_reason": "stop" if i == len(pieces) - 1 else None}],
        }  # fmt: skip
        frames.append(encode_event(None, json.dumps(chunk, indent=1)))
        frames.append(encode_comment("ping"))
    frames.append(encode_event(None, "[DONE]"))
    body = b"".join(frames)
    client = openai.OpenAI(api_key="x", base_url=URL, max_retries=0)
    resp = httpx2.Response(
        200,
        content=chunked(body, random.Random(0)),
        request=httpx2.Request("POST", URL + "/v1/chat/completions"),
    )
    out = list(openai.Stream(cast_to=ChatCompletionChunk, response=resp, client=client))
    assert "".join(c.choices[0].delta.content or "" for c in out) == "".join(pieces)
    assert out[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- properties

names = st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1)
datas = st.text(st.characters(codec="utf-8"))
ids = st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n\0"))
retries = st.none() | st.integers(0, 2**40)


def normalize(data: str) -> str:
    return data.replace("\r\n", "\n").replace("\r", "\n")


def sdk_events(decoder_cls: type, body: bytes, rng: random.Random) -> list[tuple]:
    dec = decoder_cls()
    return [(e.event, e.data, e.id, e.retry) for e in dec.iter_bytes(chunked(body, rng))]


@given(
    events=st.lists(st.tuples(names, datas, ids, retries), max_size=6),
    seed=st.integers(0, 2**32),
)
def test_sdk_decoders_agree_with_encoder(events: list[tuple], seed: int) -> None:
    body = b"".join(encode_event(n, d, id=i, retry=r) for n, d, i, r in events)
    want, last_id = [], None
    for n, d, i, r in events:
        last_id = i if i is not None else last_id
        want.append((n, normalize(d), last_id, r))
    rng = random.Random(seed)
    assert sdk_events(a_stream.SSEDecoder, body, rng) == want
    assert sdk_events(o_stream.SSEDecoder, body, rng) == want
    ours = SseDecoder()
    got = [e for c in chunked(body, rng) for e in ours.feed(c)]
    assert [(e.event, e.data, e.id, e.retry) for e in got] == want
    assert not ours.finish()


@given(
    frames=st.lists(
        st.one_of(
            st.tuples(st.just("event"), names, datas),
            st.tuples(st.just("comment"), datas),
            st.tuples(st.just("ping")),
        ),
        max_size=8,
    ),
    seed=st.integers(0, 2**32),
)
def test_sdk_decoders_skip_comments_and_see_pings(frames: list[tuple], seed: int) -> None:
    body, want = b"", []
    for f in frames:
        if f[0] == "event":
            body += encode_event(f[1], f[2])
            want.append((f[1], normalize(f[2])))
        elif f[0] == "comment":
            body += encode_comment(f[1])
        else:
            body += encode_ping()
            want.append(("ping", '{"type": "ping"}'))
    rng = random.Random(seed)
    for cls in (a_stream.SSEDecoder, o_stream.SSEDecoder):
        assert [(e, d) for e, d, _, _ in sdk_events(cls, body, rng)] == want
