"""Server-Sent Events frames: a Rust encoder and an incremental WHATWG decoder.

Encoding (every frame ends with a blank line)::

    from mlx_cairn.sse import encode_event, encode_comment, encode_ping, SseDecoder

    encode_event("message_start", '{"type": "message_start"}')
    # b'event: message_start\\ndata: {"type": "message_start"}\\n\\n'
    encode_event(None, "[DONE]")          # b'data: [DONE]\\n\\n' (OpenAI end marker)
    encode_event("x", "a\\nb")             # b'event: x\\ndata: a\\ndata: b\\n\\n'
    encode_event("x", "d", id="7", retry=3000)
    encode_comment("keep-alive")          # b': keep-alive\\n\\n' (ignored by clients)
    encode_ping()                         # the Anthropic ping event frame

- ``event`` is written whenever it is not None; the Anthropic SDK drops events
  without one. Names must be non-empty without CR/LF (ValueError otherwise).
- ``data`` (str, or bytes holding UTF-8) is split at CRLF, CR and LF into one
  ``data:`` line each; clients join them with LF, so CR and CRLF come back as LF.
- ``id`` must not contain CR, LF or NUL. Note: the Anthropic SDK's decoder emits
  an empty event at any blank line once an id has been seen, so do not combine
  ``id`` with comment frames on streams read by that SDK.

Decoding (bytes in any chunking; a CR/LF pair or a UTF-8 character may be split)::

    dec = SseDecoder()
    for chunk in response_chunks:
        for ev in dec.feed(chunk):        # list[SseEvent]
            handle(ev.event, ev.data)     # ev.event is None for the default type
    truncated = dec.finish()              # True if an incomplete event was dropped

The decoder follows the WHATWG rules: an event is dispatched at a blank line if
it had a ``data:`` line; ``id`` persists across events; ``retry`` needs digits
only; comments and unknown fields are ignored; a leading BOM is dropped; invalid
UTF-8 becomes U+FFFD. ``SseDecoder(max_event_bytes=n)`` raises ValueError (and
resets) once a line or an event's data passes ``n`` bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mlx_cairn._core import SseDecoder, SseEvent, encode_comment, encode_event, encode_ping

__all__ = [
    "SseDecoder",
    "SseEvent",
    "encode_comment",
    "encode_event",
    "encode_ping",
    "iter_events",
]


def iter_events(chunks: Iterable[bytes]) -> Iterator[SseEvent]:
    """Decode an iterable of byte chunks into events (an incomplete tail is dropped)."""
    dec = SseDecoder()
    for chunk in chunks:
        yield from dec.feed(chunk)
    dec.finish()
