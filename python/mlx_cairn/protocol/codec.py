"""The dialect-neutral encoder/fold interface (docs/design.md §1).

Every dialect turns one request's Event stream into a list of *wire events*:
``(name, payload)`` pairs, exactly the frames a streaming client receives
(``name`` is the SSE ``event:`` field, None for dialects without one).
A streaming response frames them as they come; a JSON response folds the very
same wire events into one body. There is no second code path, so
``fold(stream) == non_stream`` holds by construction::

    codec = AnthropicCodec(...)                 # one per request
    wire = codec.open()                         # e.g. message_start
    for ev in events:                           # TextDelta, ToolCall, ..., Done
        wire += codec.feed(ev)
    body = codec.fold(wire)                     # the JSON response

A dialect implements :class:`Codec`; the runner in :mod:`mlx_cairn.api.respond`
does the rest (pings, disconnects, headers, errors).
"""

from __future__ import annotations

import math
import secrets
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.frames import comment, frame, json_bytes
from mlx_cairn.types import Event, Timings, ToolCall, Usage

#: One frame of a dialect's stream: (SSE event name or None, JSON payload or raw str).
WireEvent = tuple[str | None, Any]


class Codec(Protocol):
    """Encodes one request's Events for one dialect (stateful, single use)."""

    def open(self) -> list[WireEvent]:
        """Frames sent before the first Event (e.g. Anthropic ``message_start``)."""
        ...

    def feed(self, ev: Event) -> list[WireEvent]:
        """Frames for one Event; after Done/Error the stream is complete."""
        ...

    def ping(self) -> bytes:
        """One keep-alive frame (already framed)."""
        ...

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The non-streaming JSON body: a fold over ``open() + feed(...)`` frames."""
        ...


def encode(we: WireEvent) -> bytes:
    """SSE bytes of one wire event."""
    return frame(we[0], we[1])


@dataclass(frozen=True, slots=True)
class Framing:
    """How a stream's wire events become bytes: SSE (every dialect but one) or NDJSON.

    A codec names its framing in a ``framing`` attribute; without one it is
    :data:`SSE`. ``note`` frames a line clients skip (the session-cache
    figures at the end of a stream when the server has no HTTP trailers);
    b"" where the format has no such line.

    >>> NDJSON.encode((None, {"done": True}))
    b'{"done":true}\\n'
    """

    media_type: bytes
    encode: Callable[[WireEvent], bytes]
    note: Callable[[str], bytes]


def _ndjson_line(we: WireEvent) -> bytes:
    return json_bytes(we[1]) + b"\n"


SSE = Framing(b"text/event-stream; charset=utf-8", encode, comment)
#: One JSON object per line (the Ollama API): no comment line exists, so nothing
#: but the objects themselves is ever written (its clients parse every line).
NDJSON = Framing(b"application/x-ndjson", _ndjson_line, lambda _text: b"")


def framing_of(codec: Any) -> Framing:
    """The framing ``codec`` streams in (:data:`SSE` unless it names another)."""
    f = getattr(codec, "framing", None)
    return f if isinstance(f, Framing) else SSE


_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str, n: int = 24) -> str:
    """A random id such as ``msg_...``, ``toolu_...``, ``chatcmpl-...`` or ``call_...``."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(n))


def timings_body(t: Timings) -> dict[str, float]:
    """Timing figures, documented extra fields in ``usage.timings``."""
    return {
        "queue_ms": round(t.queue_ms, 3),
        "ttft_ms": round(t.ttft_ms, 3),
        "prefill_tokens_per_s": round(t.prefill_tokens_per_s, 3),
        "decode_tokens_per_s": round(t.decode_tokens_per_s, 3),
    }


def speculative_usage(u: Usage) -> dict[str, int]:
    """Speculative decoding's figures, extra ``usage`` fields of every dialect: draft
    tokens scored and accepted (none when the request did not speculate)."""
    if not u.draft_tokens:
        return {}
    return {"draft_tokens": u.draft_tokens, "accepted_draft_tokens": u.accepted_draft_tokens}


def speculative_switch(body: dict[str, Any]) -> bool | None:
    """The extra field ``speculative`` (every dialect): ``false`` opts a request out of
    the server's speculative decoding; absent or ``null``: the server's setting."""
    v = body.get("speculative")
    if v is None:
        return None
    if not isinstance(v, bool):
        raise fail("speculative", "must be a boolean")
    return v


def cache_salt(body: dict[str, Any]) -> str | None:
    """``cache_salt`` (as in vLLM): requests with different salts share no cached prefix."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise fail("cache_salt", "must be a non-empty string")
    return v


def tool_call_as_text(ev: ToolCall) -> str:
    """A tool call the response may not carry as a tool call, as the text the model meant."""
    try:
        return orjson.dumps({"name": ev.name, "arguments": orjson.loads(ev.arguments)}).decode()
    except (orjson.JSONDecodeError, TypeError):  # not JSON, or nested beyond orjson's limit
        return orjson.dumps({"name": ev.name, "arguments": ev.arguments}).decode()


# ------------------------------------------ request validation (every dialect)

#: What a document, audio or file part (or an image where none is read: an assistant
#: turn) becomes in the prompt.
MEDIA_PLACEHOLDER = "[{kind} omitted: not read by this server]"


def fail(param: str, message: str) -> InvalidRequest:
    """A 400 naming ``param``."""
    return InvalidRequest(f"{param}: {message}", param=param)


def each_object(raw: Any, field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The items of ``raw`` (a list of objects, or None for none) with their param names.

    Example: ``for param, t in each_object(body.get("tools"), "tools")`` yields
    ``("tools[0]", {...})``...; a non-list or a non-object item is a 400 naming it.
    """
    if raw is None:
        return
    if not isinstance(raw, list):
        raise fail(field, "must be a list")
    for i, item in enumerate(raw):
        param = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise fail(param, "must be an object")
        yield param, item


def nonempty_list(raw: Any, field: str) -> list[Any]:
    """``raw`` when it is a non-empty list; a 400 naming ``field`` otherwise."""
    if not isinstance(raw, list):
        raise fail(field, "must be a list")
    if not raw:
        raise fail(field, "must not be empty")
    return raw


def opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    """``body[key]`` when it is a boolean, ``default`` when absent; a 400 otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise fail(key, "must be a boolean")
    return v


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def short(v: Any) -> str:
    """``repr(v)`` cut to 40 characters, for error messages."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def required_model(body: dict[str, Any]) -> str:
    """``model``: a required non-empty string."""
    model = body.get("model")
    if model is None:
        raise fail("model", "field required")
    if not isinstance(model, str) or not model:
        raise fail("model", "must be a non-empty string")
    return model


#: Deepest nesting of objects and lists a request body may have. Tool schemas
#: rarely pass 10; the bound keeps every later walk of the body (validation,
#: copies of echoed fields, JSON encoding) far from recursion limits.
MAX_JSON_DEPTH = 64


def check_depth(body: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse (400) a decoded JSON body nested more than ``limit`` levels deep.

    Iterative, so the check itself cannot hit the recursion limit.
    """
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise InvalidRequest(
                f"request body is nested more than {limit} levels deep", param=None
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
