"""The one auth gate in front of every route, plus the request-body limit.

:class:`Gate` is plain ASGI middleware wrapped around the whole app, so a
route added later cannot bypass it. Rules (docs/design.md §6):

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

Paths: a trailing ``/`` is dropped before anything else (``POST /v1/messages/``
is ``POST /v1/messages``), so no route answers with a redirect, whose
``Location`` would echo the request's ``Host`` header.

Bodies (one :class:`_Exchange` per request):

- a ``Content-Length`` above the limit is answered 413 at once, before any
  byte of the body is read, so a client sending ``Expect: 100-continue`` gets
  the 413 and never a ``100 Continue``;
- a chunked body is counted as it arrives and refused when it passes the limit;
- a body that makes no progress for ``body_timeout`` seconds while the app
  reads it is answered 408 (``Connection: close``);
- a client that disconnects while sending its body is a disconnect, not an
  error: one DEBUG line, no response, and ``/metrics`` counts it as status
  499 (the ClientDisconnect it raises in the route is caught here).

After a 413 has gone out (complete, so the client can read it), the rest of
the body is read and thrown away for a bounded time (:func:`drain_body`)
before the connection closes: closing a socket with unread data makes the
kernel send a reset, and a client still sending would see "connection reset"
instead of the 413.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import MutableMapping
from typing import Any, Literal

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_cairn.api.connection import DEFAULT_BODY_TIMEOUT
from mlx_cairn.api.dialects import ApiError, DialectSet, error_response, log_safe
from mlx_cairn.api.metrics import CLIENT_GONE_SCOPE_KEY

log = logging.getLogger("mlx_cairn.api")

Verdict = Literal["ok", "anonymous", "denied"]
AUTH_SCOPE_KEY = "cairn.auth"
UNAUTHORIZED_MESSAGE = "invalid or missing credentials"
#: Paths that answer anonymous callers (with less detail).
ANONYMOUS_PATHS = frozenset({"/health", "/"})
#: Bytes of an over-limit body read and discarded so the 413 reaches the client.
DRAIN_LIMIT = 64 * 1024 * 1024
#: Seconds of silence after which draining an over-limit body stops (at most the body timeout).
DRAIN_IDLE = 5.0
#: Seconds an over-limit body is drained at most, however steadily it comes.
DRAIN_TOTAL = 30.0


async def drain_body(
    receive: Receive, already: int = 0, *, idle: float = DRAIN_IDLE, total: float = DRAIN_TOTAL
) -> None:
    """Read and discard request-body messages until the body ends, the client
    leaves, :data:`DRAIN_LIMIT` bytes have passed, nothing came for ``idle``
    seconds or ``total`` seconds have passed (then the connection is closed)."""
    seen = already
    deadline = time.monotonic() + total
    while seen <= DRAIN_LIMIT:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            msg = await asyncio.wait_for(receive(), min(idle, left))
        except asyncio.TimeoutError:
            return
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
    """ASGI middleware: auth for every route, then the body rules of the module doc."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        dialects: DialectSet,
        digest: bytes | None,
        max_body_bytes: int,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
    ) -> None:
        self.app = app
        self.dialects = dialects
        self.digest = digest
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        _drop_trailing_slash(scope)
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

        ex = _Exchange(receive, send, limit=self.max_body, timeout=self.body_timeout)
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
                # Answered before reading: uvicorn sends "100 Continue" on the
                # first receive() and never once an answer has started, so a
                # client sending ``Expect: 100-continue`` gets just the 413.
                ex.drain_after_answer = True
                await self._too_large(scope, ex)
                return
        try:
            await self.app(scope, ex.receive, ex.send)
        except ClientDisconnect:
            if not ex.disconnected:
                raise
        if ex.disconnected and not ex.started:
            await self._gone(scope, ex)

    async def _too_large(self, scope: Scope, ex: _Exchange) -> None:
        await self._refuse(
            scope,
            ex,
            413,
            "too_large",
            f"request body is larger than the server limit of {self.max_body} bytes",
        )

    async def _refuse(
        self, scope: Scope, ex: _Exchange, status: int, kind: str, message: str
    ) -> None:
        """Answer an error and close the connection (the body is not read on)."""
        resp = error_response(
            self.dialects.for_scope(scope), status, kind, message, headers={"Connection": "close"}
        )
        await resp(scope, ex.receive, ex.send)

    async def _gone(self, scope: Scope, ex: _Exchange) -> None:
        """The body stopped: a 408 if it stalled, nothing if the client left."""
        method = log_safe(str(scope.get("method", "")))
        path = log_safe(str(scope.get("path", "")))
        if ex.timed_out:
            await self._refuse(
                scope,
                ex,
                408,
                "timeout",
                f"request body made no progress for {self.body_timeout:g} seconds",
            )
            return
        scope[CLIENT_GONE_SCOPE_KEY] = True
        log.debug("%s %s: the client disconnected while sending its body", method, path)


class _Exchange:
    """One request's receive and send channels as the gate hands them to the app.

    ``receive``: counts body bytes against the limit (413 past it), gives up
    on a body that makes no progress for ``timeout`` seconds (the app then
    sees ``http.disconnect``, the gate answers 408) and notes a client that
    left while sending its body. Once the body is complete it passes messages
    through untimed (the app then waits for a disconnect while it answers).

    ``send``: notes whether an answer started; when the answer is a 413 for
    an over-limit body, holds the connection open after the answer's last
    byte while the rest of the body is drained (:func:`drain_body`).
    """

    def __init__(self, receive: Receive, send: Send, *, limit: int, timeout: float) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.timeout = timeout
        self.seen = 0
        self.body_done = False
        self.started = False
        self.disconnected = False
        self.timed_out = False
        self.drain_after_answer = False

    async def receive(self) -> Message:
        if self.disconnected:
            return {"type": "http.disconnect"}
        if self.body_done:
            return await self._receive()
        try:
            msg = await asyncio.wait_for(self._receive(), self.timeout)
        except asyncio.TimeoutError:
            self.disconnected = self.timed_out = True
            return {"type": "http.disconnect"}
        if msg["type"] == "http.disconnect":
            self.disconnected = True
        elif msg["type"] == "http.request":
            self.seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                self.body_done = True
            if self.seen > self.limit:
                self.drain_after_answer = not self.body_done
                raise ApiError(
                    413,
                    "too_large",
                    f"request body is larger than the server limit of {self.limit} bytes",
                    headers={"Connection": "close"},
                )
        return msg

    async def send(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.started = True
        last = msg["type"] == "http.response.body" and not msg.get("more_body", False)
        if not (last and self.drain_after_answer):
            await self._send(msg)
            return
        self.drain_after_answer = False
        await self._send({**msg, "more_body": True})  # the client has the whole answer now
        await drain_body(self._receive, self.seen, idle=min(DRAIN_IDLE, self.timeout))
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


def _drop_trailing_slash(scope: Scope) -> None:
    """``/v1/messages/`` -> ``/v1/messages`` (``/`` stays ``/``)."""
    path: str = scope["path"]
    if len(path) > 1 and path.endswith("/"):
        scope["path"] = path.rstrip("/") or "/"
        raw = scope.get("raw_path")
        if isinstance(raw, bytes):
            scope["raw_path"] = raw.rstrip(b"/") or b"/"
