"""Dialects: who owns which paths, and how each one spells an error.

A dialect module (``mlx_cairn.api.anthropic``, later the OpenAI ones) exposes
``DIALECT`` (a :class:`Dialect`) and ``router`` (a FastAPI ``APIRouter``) and is
listed in :data:`mlx_cairn.api.app.DIALECT_MODULES`. Every error the server
sends (401 from the gate, 413, 404 for an unknown path, a validation 400, an
engine failure) goes through :func:`error_response` with the dialect picked by
:meth:`DialectSet.for_scope`:

1. the dialect whose path prefix matches the request path (longest wins);
2. on shared paths (``/v1/models``, ``/health``, unknown paths) the first
   dialect whose ``header_hint`` header is present (Anthropic:
   ``anthropic-version``, which the anthropic SDK and Claude Code always send);
3. else the dialect marked ``shared_default`` (else the first one listed).

Every 4xx answer is logged once, when it is sent, as one INFO line on the
``mlx_cairn.api`` logger that says why (path only, never the query string)::

    400 POST /v1/messages: invalid_request_error: messages[1].role: must be ...
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mlx_cairn.errors import CairnError

log = logging.getLogger("mlx_cairn.api")

#: Longest error message written to a log line (the rest is cut with "...").
LOG_MESSAGE_CHARS = 500
#: Characters a log viewer may break a line on.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")

#: (status, kind, message, param) -> JSON error body.
ErrorBody = Callable[[int, str, str, "str | None"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One servable model name, for the model listings."""

    id: str
    #: The served model this name resolves to (itself unless an alias).
    target: str
    created: int
    loaded: bool
    #: The most tokens (prompt + answer) one request may hold; None until the
    #: model has been loaded once (it is read from the loaded model).
    context_length: int | None = None
    #: The model reads pictures (from the loaded model, else its folder's config).
    vision: bool = False


@dataclass(frozen=True)
class Dialect:
    """How one API dialect plugs into the shared server."""

    name: str
    #: Path prefixes this dialect owns, e.g. ("/v1/messages",).
    prefixes: tuple[str, ...]
    error_body: ErrorBody
    #: Body of ``GET /v1/models`` in this dialect's shape.
    models_body: Callable[[list[ModelInfo]], dict[str, Any]] | None = None
    #: A request header that selects this dialect on shared paths.
    header_hint: str | None = None
    #: Use this dialect on shared paths when no header hint matches.
    shared_default: bool = False


class ApiError(CairnError):
    """An HTTP-level error raised by the server itself (auth, size, routing)."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self._status = status
        self.kind = kind
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return self._status


class DialectSet:
    """The dialects of one app, with the lookup rule of the module doc."""

    def __init__(self, dialects: Iterable[Dialect]) -> None:
        self.dialects = list(dialects)
        if not self.dialects:
            raise ValueError("at least one dialect is required")
        self._by_prefix = sorted(
            ((p, d) for d in self.dialects for p in d.prefixes), key=lambda pd: -len(pd[0])
        )
        self.default = next((d for d in self.dialects if d.shared_default), self.dialects[0])

    def for_scope(self, scope: MutableMapping[str, Any]) -> Dialect:
        """The dialect that answers this request (see the module doc)."""
        path: str = scope.get("path", "")
        for prefix, d in self._by_prefix:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return d
        names = {k for k, _ in scope.get("headers", [])}
        for d in self.dialects:
            if d.header_hint and d.header_hint.encode() in names:
                return d
        return self.default


#: Statuses worth retrying (timeout, conflict, rate limit, server side); every
#: other 4xx fails the same way again.
RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


class ErrorResponse(Response):
    """An error envelope that logs why it was sent (4xx only, one line, see the module doc).

    The line is written when the response is sent, the one moment that knows
    both the request (method, path) and the reason, whoever built it: the
    gate, an exception handler or a generation that failed before its JSON
    body. 5xx answers are logged where they are raised, with their traceback.
    """

    def __init__(
        self,
        body: dict[str, Any],
        status: int,
        *,
        kind: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        headers = dict(headers or {})
        # The official SDKs (and Claude Code) read this before their own rules:
        # without it Claude Code retries a 401 ten times over three minutes.
        headers.setdefault("x-should-retry", "true" if status in RETRYABLE else "false")
        super().__init__(
            orjson.dumps(body), status_code=status, headers=headers, media_type="application/json"
        )
        err = body.get("error")
        etype = err.get("type") if isinstance(err, dict) else None
        self.error_type = etype if isinstance(etype, str) else kind
        self.message = message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if 400 <= self.status_code < 500:
            log.info(
                "%d %s %s: %s: %s",
                self.status_code,
                log_safe(str(scope.get("method", ""))),
                log_safe(str(scope.get("path", ""))),  # the query string is never logged
                self.error_type,
                log_safe(self.message, LOG_MESSAGE_CHARS),
            )
        await super().__call__(scope, receive, send)


def log_safe(text: str, limit: int | None = None) -> str:
    """``text`` with control characters escaped (a log line stays one line), cut at ``limit``.

    >>> log_safe("a\\nb")
    'a\\\\nb'
    """
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def error_response(
    dialect: Dialect,
    status: int,
    kind: str,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error in ``dialect``'s envelope (an :class:`ErrorResponse`)."""
    body = dialect.error_body(status, kind, message, param)
    return ErrorResponse(body, status, kind=kind, message=message, headers=headers)


def response_for(dialect: Dialect, err: CairnError) -> Response:
    """The error response for a typed error (QueueFull gets Retry-After)."""
    headers = dict(getattr(err, "headers", {}) or {})
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    return error_response(
        dialect,
        err.status,
        err.kind,
        err.message_for(dialect.name),
        param=err.param,
        headers=headers,
    )
