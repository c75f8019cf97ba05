"""The one auth gate in front of every route, plus the request-body limit.

:class:`Gate` is plain ASGI middleware wrapped around the whole app, so a
route added later cannot bypass it. Rules (DESIGN.md §6):

- no token configured: everything is open;
- ``x-api-key`` is read first; if absent, ``Authorization: Bearer <token>``
  (scheme case-insensitive); whichever is read decides;
- a repeated ``x-api-key`` or ``Authorization`` header is refused;
- the comparison is constant time (SHA-256 digests compared with
  :func:`hmac.compare_digest`, so length leaks nothing either);
- ``/health`` and ``/`` (GET or HEAD) with no credential at all answer
  liveness only; with a wrong one they are a 401 like everything else
  (Claude Code probes ``HEAD /`` at start-up without its credential);
- CORS preflights never reach the gate: when ``--cors-origin`` is set, the
  CORS middleware around the whole app answers them (browsers send no
  credentials on a preflight) and adds its headers to the gate's 401s;
- a 401 carries ``WWW-Authenticate: Bearer`` and never says which check failed.

Bodies: a ``Content-Length`` above the limit is refused before any route
runs (413); a chunked body is counted as it arrives and refused when it
passes the limit. Before the 413 goes out, the rest of the body is read and
thrown away (up to :data:`DRAIN_LIMIT`): closing a socket with unread data
makes the kernel send a reset, and the client would see "connection reset"
instead of the 413.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import MutableMapping
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_cairn.api.dialects import ApiError, DialectSet, error_response

Verdict = Literal["ok", "anonymous", "denied"]
AUTH_SCOPE_KEY = "cairn.auth"
UNAUTHORIZED_MESSAGE = "invalid or missing credentials"
#: Paths that answer anonymous callers (with less detail).
ANONYMOUS_PATHS = frozenset({"/health", "/"})
#: Bytes of an over-limit body read and discarded so the 413 reaches the client.
DRAIN_LIMIT = 64 * 1024 * 1024


async def drain_body(receive: Receive, already: int = 0) -> None:
    """Read and discard request-body messages until the body ends or
    :data:`DRAIN_LIMIT` bytes have passed (then the connection is closed)."""
    seen = already
    while seen <= DRAIN_LIMIT:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


def token_digest(token: str) -> bytes:
    """The digest the gate compares against; an empty token is refused."""
    if not token:
        raise ValueError("the configured API token is empty")
    return hashlib.sha256(token.encode()).digest()


def check_credentials(headers: list[tuple[bytes, bytes]], digest: bytes | None) -> Verdict:
    """Judge a request's credential headers against the configured token digest."""
    if digest is None:
        return "ok"
    api_keys = [v for k, v in headers if k == b"x-api-key"]
    auths = [v for k, v in headers if k == b"authorization"]
    if len(api_keys) > 1 or len(auths) > 1:
        return "denied"
    if api_keys:
        presented = api_keys[0].strip()
    elif auths:
        scheme, _, cred = auths[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "denied"
        presented = cred.strip()
    else:
        return "anonymous"
    ok = hmac.compare_digest(hashlib.sha256(presented).digest(), digest)
    return "ok" if ok else "denied"


def is_authenticated(scope: MutableMapping[str, Any]) -> bool:
    """Whether the gate accepted this request's credential (or no token is set)."""
    return scope.get(AUTH_SCOPE_KEY) == "ok"


class Gate:
    """ASGI middleware: auth for every route, then the body-size limit."""

    def __init__(
        self, app: ASGIApp, *, dialects: DialectSet, digest: bytes | None, max_body_bytes: int
    ) -> None:
        self.app = app
        self.dialects = dialects
        self.digest = digest
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        verdict = check_credentials(headers, self.digest)
        if verdict == "denied" or (verdict == "anonymous" and scope["path"] not in ANONYMOUS_PATHS):
            resp = error_response(
                self.dialects.for_scope(scope),
                401,
                "authentication",
                UNAUTHORIZED_MESSAGE,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await resp(scope, receive, send)
            return
        scope[AUTH_SCOPE_KEY] = verdict

        lengths = [v for k, v in headers if k == b"content-length"]
        if lengths:
            try:
                declared = int(lengths[0])
            except ValueError:
                declared = -1
            if declared < 0 or len(lengths) > 1:
                resp = error_response(
                    self.dialects.for_scope(scope), 400, "invalid_request", "bad Content-Length"
                )
                await resp(scope, receive, send)
                return
            if declared > self.max_body:
                await self._too_large(scope, receive, send)
                return
        await self.app(scope, self._limited(receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await drain_body(receive)
        resp = error_response(
            self.dialects.for_scope(scope),
            413,
            "too_large",
            f"request body is larger than the server limit of {self.max_body} bytes",
            headers={"Connection": "close"},
        )
        await resp(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body

        async def wrapped() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    if msg.get("more_body", False):
                        await drain_body(receive, seen)
                    raise ApiError(
                        413,
                        "too_large",
                        f"request body is larger than the server limit of {limit} bytes",
                    )
            return msg

        return wrapped
