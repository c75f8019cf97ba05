"""mlx_cairn.sse: exact frames, bad input, and encode -> decode round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.sse import (
    SseDecoder,
    SseEvent,
    encode_comment,
    encode_event,
    encode_ping,
    iter_events,
)


def test_exact_frames() -> None:
    assert encode_event("message_stop", '{"type":"message_stop"}') == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert encode_event(None, "[DONE]") == b"data: [DONE]\n\n"
    assert encode_event("e", "") == b"event: e\ndata: \n\n"
    assert encode_event("e", b"a\r\nb\rc\n") == b"event: e\ndata: a\ndata: b\ndata: c\ndata: \n\n"
    assert encode_event("e", "x", id="42", retry=10) == b"event: e\nid: 42\nretry: 10\ndata: x\n\n"
    assert encode_comment() == b":\n\n"
    assert encode_comment("a\r\nb") == b": a\n: b\n\n"
    assert encode_ping() == b'event: ping\ndata: {"type": "ping"}\n\n'


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda: encode_event("", "x"), ValueError),
        (lambda: encode_event("a\nb", "x"), ValueError),
        (lambda: encode_event("a\r", "x"), ValueError),
        (lambda: encode_event("a", "x", id="1\n"), ValueError),
        (lambda: encode_event("a", "x", id="1\0"), ValueError),
        (lambda: encode_event("a", b"\xff"), ValueError),
        (lambda: encode_event("a", 5), TypeError),
        (lambda: encode_event(b"a", "x"), TypeError),
        (lambda: encode_event("a", "x", retry=-1), OverflowError),
        (lambda: SseDecoder().feed(5), TypeError),
        (lambda: SseDecoder().feed([1, 2]), TypeError),
    ],
)
def test_bad_input_is_a_clear_error(call: object, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        call()  # type: ignore[operator]


def test_decoder_rules() -> None:
    dec = SseDecoder()
    # BOM dropped once, CR LF split across chunks, comments and unknown fields ignored.
    got = dec.feed(b"\xef\xbb")
    got += dec.feed(b"\xbfevent: a\r")
    got += dec.feed(b"\ndata: 1\r\n: note\nfoo: bar\nid: 7\nretry: 9\r\n\r\n")
    assert got == [SseEvent("1", event="a", id="7", retry=9)]
    assert dec.last_event_id == "7"
    # Events without data are not dispatched; id persists; bad retry ignored.
    assert dec.feed("event: only\n\nretry: x1\ndata: é\n\n") == [SseEvent("é", id="7")]
    assert dec.feed(bytearray(b"data:  two spaces\n\n")) == [SseEvent(" two spaces", id="7")]
    assert dec.feed(memoryview(b"data: \xff\n\n")) == [SseEvent("\ufffd", id="7")]
    assert dec.feed(b"data: partial\n") == []
    assert dec.has_partial
    assert dec.finish() is True
    assert not dec.has_partial and dec.last_event_id is None
    assert dec.finish() is False


def test_decoder_limit() -> None:
    dec = SseDecoder(max_event_bytes=32)
    with pytest.raises(ValueError, match="32 bytes"):
        dec.feed(b"data: " + b"x" * 40)
    assert not dec.has_partial  # reset after the error
    assert dec.feed(b"data: ok\n\n") == [SseEvent("ok")]


def test_iter_events_and_repr() -> None:
    body = encode_event("a", "1") + encode_comment("c") + encode_event(None, "2") + b"data: 3"
    evs = list(iter_events([body[:5], body[5:]]))
    assert evs == [SseEvent("1", event="a"), SseEvent("2")]
    assert repr(evs[0]) == 'SseEvent(data="1", event="a")'


names = st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1)
datas = st.text(st.characters(codec="utf-8"))
ids = st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n\0"))


@given(
    frames=st.lists(
        st.one_of(
            st.tuples(names, datas, ids, st.none() | st.integers(0, 2**63)),
            datas.map(lambda c: ("comment", c)),
        ),
        max_size=8,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_round_trip_any_chunking(frames: list[tuple], cuts: list[int]) -> None:
    body, want, last_id = b"", [], None
    for f in frames:
        if f[0] == "comment" and len(f) == 2:
            body += encode_comment(f[1])
            continue
        name, data, id_, retry = f
        body += encode_event(name, data.encode(), id=id_, retry=retry)
        last_id = id_ if id_ is not None else last_id
        norm = data.replace("\r\n", "\n").replace("\r", "\n")
        want.append(SseEvent(norm, event=name, id=last_id, retry=retry))
    # Cut anywhere, including inside CR LF pairs and multi-byte characters.
    points = sorted({c % (len(body) + 1) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    dec = SseDecoder()
    got = [e for p in pieces for e in dec.feed(p)]
    assert got == want
    assert dec.finish() is False
