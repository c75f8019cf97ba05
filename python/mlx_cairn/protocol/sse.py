"""The one place the dialect encoders get SSE frames from.

``frame(event, payload)`` and ``comment(text)`` return the bytes of one SSE
frame. They use the Rust framer (:mod:`mlx_cairn.sse`) when it is built, and
a small private fallback with the same semantics until then: an ``event:``
line when a name is given, one ``data:`` line per line of the payload, a blank
line at the end.
"""

from __future__ import annotations

from typing import Any

import orjson

try:  # the Rust framer (rust/sse)
    from mlx_cairn.sse import encode_comment, encode_event
except ImportError:  # pragma: no cover - the fallback goes away once the framer lands

    def encode_event(event: str | None, data: str) -> bytes:
        """Fallback frame encoder (same contract as the Rust framer)."""
        head = f"event: {event}\n" if event is not None else ""
        body = "".join(f"data: {line}\n" for line in data.replace("\r\n", "\n").split("\n"))
        return (head + body + "\n").encode()

    def encode_comment(text: str) -> bytes:
        """Fallback comment frame (ignored by every SSE client)."""
        return ("".join(f": {line}\n" for line in text.split("\n")) + "\n").encode()


def frame(event: str | None, payload: Any) -> bytes:
    """One SSE frame; ``payload`` is JSON-encoded unless it is already a str."""
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    out = encode_event(event, data)
    return out if isinstance(out, bytes) else out.encode()


def comment(text: str) -> bytes:
    """One SSE comment frame (a keep-alive that clients ignore)."""
    out = encode_comment(text)
    return out if isinstance(out, bytes) else out.encode()
