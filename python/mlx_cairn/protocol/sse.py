"""The one place the dialect encoders get SSE frames from (the Rust framer).

``frame(event, payload)`` and ``comment(text)`` return the bytes of one SSE
frame: an ``event:`` line when a name is given, one ``data:`` line per line of
the payload, a blank line at the end (:mod:`mlx_cairn.sse`).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from mlx_cairn.sse import encode_comment, encode_event


def frame(event: str | None, payload: Any) -> bytes:
    """One SSE frame; ``payload`` is JSON-encoded unless it is already a str."""
    if isinstance(payload, str):
        data: str | bytes = payload
    else:
        try:
            data = orjson.dumps(payload)
        except TypeError:  # nested past orjson's limit: the stdlib encoder goes deeper
            data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return encode_event(event, data)


def comment(text: str) -> bytes:
    """One SSE comment frame (a keep-alive that clients ignore)."""
    return encode_comment(text)
