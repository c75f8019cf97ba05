"""Server settings and the per-app state every route reads."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from mlx_cairn import heavy
from mlx_cairn.api.connection import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT
from mlx_cairn.api.dialects import DialectSet
from mlx_cairn.api.registry import ModelRegistry
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.frames import json_bytes
from mlx_cairn.protocol.images import ImageLimits

#: Default request-body limit (Claude Code sends long conversations).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: Default upper bound on ``max_tokens`` (a request above it is a 400).
DEFAULT_MAX_TOKENS_LIMIT = 128_000


@dataclass(slots=True)
class ServerConfig:
    """Settings of one server (``cairn serve`` flags)."""

    #: The shared API token; None leaves the server open.
    api_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    #: Give a request whose prompt fits the room that is left instead of a 400.
    clamp_max_tokens: bool = False
    #: Seconds of silence on a stream before a ping frame.
    ping_interval: float = 3.0
    #: Seconds a connection may take to send a complete request head (then it is closed).
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    #: Seconds a request body may make no progress (then 408 and close).
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    #: Browser origins allowed to call the server (CORS); ``"*"`` is any origin,
    #: empty sends no CORS headers at all. Values as :func:`cors_origin` returns them.
    cors_origins: tuple[str, ...] = ()
    #: Image limits and whether image URLs are fetched (``--max-image-*``,
    #: ``--max-images``, ``--allow-image-urls``, ``--image-url-timeout``).
    images: ImageLimits = field(default_factory=ImageLimits)


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s@]+")


def cors_origin(value: str) -> str:
    """One ``--cors-origin``: ``*``, or an origin as browsers send it
    (``scheme://host[:port]``, lower case, no path). A trailing ``/`` is dropped.

    >>> cors_origin("HTTP://LocalHost:5173/")
    'http://localhost:5173'
    """
    origin = value.strip().rstrip("/").lower()
    if origin == "*" or _ORIGIN.fullmatch(origin):
        return origin
    raise argparse.ArgumentTypeError(
        f"expected '*' or an origin such as http://localhost:5173, got {value!r}"
    )


@dataclass(slots=True)
class AppState:
    """What the routes share: models, settings, dialects."""

    registry: ModelRegistry
    config: ServerConfig
    dialects: DialectSet
    #: State a dialect keeps for the app's lifetime (e.g. stored Responses), by name.
    dialect_state: dict[str, Any] = field(default_factory=dict)


def app_state(request: Request) -> AppState:
    """The :class:`AppState` of the app serving ``request``."""
    return request.app.state.cairn  # type: ignore[no-any-return]


async def read_json(request: Request) -> Any:
    """The request body as JSON; invalid JSON or UTF-8 is a 400.

    A large body (``LARGE_BYTES``, 1 MiB, or more) is decoded in a worker
    thread once :data:`mlx_cairn.heavy.GATE` has a slot for it, so the event
    loop never waits on it and only a few decode at once; small ones are
    decoded in place (tens of microseconds).
    """
    raw = await request.body()
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        if heavy.is_large(len(raw)):
            return await heavy.GATE.run(orjson.loads, raw)
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with orjson."""
    return Response(json_bytes(body), status, headers, media_type="application/json")
