"""The one place the dialect encoders get SSE frames from (the Rust framer).

``frame(event, payload)`` and ``comment(text)`` return the bytes of one SSE
frame: an ``event:`` line when a name is given, one ``data:`` line per line of
the payload, a blank line at the end (:mod:`mlx_cairn.sse`).
``json_bytes(obj)`` is the compact JSON both frames and JSON bodies use.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from mlx_cairn.sse import encode_comment, encode_event


def frame(event: str | None, payload: Any) -> bytes:
    """One SSE frame; ``payload`` is JSON-encoded unless it is already a str."""
    return encode_event(event, payload if isinstance(payload, str) else json_bytes(payload))


def json_bytes(obj: Any) -> bytes:
    """Compact JSON; falls back to the stdlib encoder past orjson's nesting limit (254)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def comment(text: str) -> bytes:
    """One SSE comment frame (a keep-alive that clients ignore)."""
    return encode_comment(text)
