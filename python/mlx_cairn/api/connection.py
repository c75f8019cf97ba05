"""HTTP/1.1 connections under uvicorn: a header deadline, lingering bodies, half-closes.

uvicorn's h11 protocol only times out a keep-alive connection that sits idle
after a response; a client that connects and sends nothing, or half a request
head, or drips a body nobody reads any more, holds its connection forever. And
when a client half-closes its side after a complete request (``shutdown(SHUT_WR)``,
as ``curl --no-keepalive`` scripts and some proxies do) uvicorn closes the
connection at once and the answer is never sent.

:class:`CairnH11Protocol` subclasses uvicorn's ``H11Protocol`` at the seam it
offers (``uvicorn.Config(http=<protocol class>)``) and adds, per connection,
keyed on h11's view of the client (``conn.their_state``)::

    their_state   IDLE ──── request head ────► SEND_BODY ──── end of body ────► DONE (or MUST_CLOSE)
                  │                             │                               │
    timer         head: --header-timeout from   linger: once our answer is out  none (the app
                  connection start / the end    and the body still comes, it    is answering)
                  of the previous answer; data  must make progress every
                  does not reset it             --body-timeout seconds
    on EOF        close                         close (it can never complete)   see below

A FIN after a complete request looks the same whether the client only shut
its sending side (and waits for the answer) or closed the socket (it gave up):
only a write tells them apart, as a closed peer answers it with a reset. The
FIN may come at any moment after the request, also after the answer has
started (a client slower than a quick server to call ``shutdown``), so
whenever it comes after a complete request:

- the connection stays open for writing, and is closed once the answer is out;
- every :data:`HALF_CLOSE_WATCH` seconds the socket's pending error
  (``SO_ERROR``) is read: the reset of a peer that is gone sets it, and then
  the connection closes and the app sees ``http.disconnect`` (a generation is
  cancelled). A stream's own writes (its frames, its pings) draw that reset;
- an HTTP/1.1 answer that has not started yet is not written to for a long
  while (a non-streamed generation), so one ``100 Continue`` goes out at once
  to draw the reset. HTTP/1.1 clients must skip a 1xx answer they did not ask
  for (RFC 9110 15.2), and Python's http.client, h11 / httpx, curl and the
  SDKs do;
- HTTP/1.0 has no 1xx answers: an answer that has not started within
  :data:`HALF_CLOSE_GRACE` seconds is taken for one to a client that left.

An EOF in the middle of a request (body not complete) or between requests
closes the connection.

A body the app is still reading is timed by the gate (:mod:`mlx_cairn.api.auth`),
which answers 408 in the dialect's envelope. When the head deadline passes with
part of a head received, a bare ``408`` goes out before the close.

Checked with uvicorn 0.30 and 0.54 (``pyproject.toml`` pins that range): it relies
on ``H11Protocol``'s ``conn``, ``cycle``, ``transport``, ``handle_events`` and
``on_response_complete``, and on ``RequestResponseCycle``'s ``response_started``,
``response_complete``, ``waiting_for_100_continue`` and ``keep_alive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import is_ssl

log = logging.getLogger("mlx_cairn.api")

#: Seconds a connection may take to send a complete request head.
DEFAULT_HEADER_TIMEOUT = 60.0
#: Seconds a request body may go without progress.
DEFAULT_BODY_TIMEOUT = 60.0
#: Seconds after an HTTP/1.0 client's EOF within which the answer must start (module doc).
HALF_CLOSE_GRACE = 5.0
#: Seconds between two looks for the reset of a peer that sent EOF (module doc).
HALF_CLOSE_WATCH = 0.1

_TIMEOUT_MESSAGE = b"request head not received in time\n"
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_TIMEOUT_MESSAGE)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _TIMEOUT_MESSAGE
)


class CairnH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the timers and the half-close rule of the module doc.

    Use :func:`http_protocol` to get a subclass with other timeouts.
    """

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    half_close_grace: float = HALF_CLOSE_GRACE
    half_close_watch: float = HALF_CLOSE_WATCH

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._eof_timer: asyncio.TimerHandle | None = None
        self._watch_timer: asyncio.TimerHandle | None = None
        self._half_closed = False

    # ------------------------------------------------------ protocol events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_timers(progress=True)

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_timers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_timers()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client closed its sending side: keep the connection for the answer
        to a complete request and watch for a reset (module doc), else close.

        Returning True keeps the transport open for writing; the cycle then
        closes it once its response is complete (``keep_alive = False``). TLS
        transports cannot half-close, so they always close. Called again when
        reading resumes after a pause (the EOF is read once more): idempotent.
        """
        cycle = self.cycle
        if (
            cycle is None
            or cycle.response_complete
            or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)  # MUST_CLOSE: HTTP/1.0
            or is_ssl(self.transport)
        ):
            return None
        cycle.keep_alive = False
        if not self._half_closed:
            self._half_closed = True
            # A started answer's own writes draw the reset of a peer that is gone.
            if not cycle.response_started and self.conn.their_http_version == b"1.1":
                self._probe(cycle)
            elif not cycle.response_started:
                self._eof_timer = self.loop.call_later(self.half_close_grace, self._eof_expired)
            self._watch_timer = self.loop.call_later(self.half_close_watch, self._watch)
        return True

    def _probe(self, cycle: Any) -> None:
        """Write one ``100 Continue``: a peer that closed its socket answers it with a reset."""
        # A 100 the request asked for (Expect) and the app has not read for yet
        # is this one: uvicorn must not send a second.
        cycle.waiting_for_100_continue = False
        with contextlib.suppress(h11.LocalProtocolError):
            self.transport.write(
                self.conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            )

    def _watch(self) -> None:
        """Close the connection once the peer that sent EOF has reset it (module doc)."""
        self._watch_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        try:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock is not None else 0
        except OSError as e:
            err = e.errno or -1
        if err:
            log.debug(
                "%s: closed its side, then reset the connection (%s); treating it as gone",
                _peer(self.client),
                errno.errorcode.get(err, err),
            )
            transport.abort()  # connection_lost: the app sees http.disconnect
            return
        self._watch_timer = self.loop.call_later(self.half_close_watch, self._watch)

    # --------------------------------------------------------------- timers

    def _sync_timers(self, *, progress: bool = False) -> None:
        """(Re)arm or cancel the head and linger timers for the current state."""
        if self.transport is None or self.transport.is_closing():
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout, self._head_expired)
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        cycle = self.cycle
        lingering = state is h11.SEND_BODY and cycle is not None and cycle.response_complete
        if lingering and (self._linger_timer is None or progress):
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            self._linger_timer = self.loop.call_later(self.body_timeout, self._linger_expired)
        elif not lingering and self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._linger_timer, self._eof_timer, self._watch_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger_timer = self._eof_timer = self._watch_timer = None

    def _eof_expired(self) -> None:
        self._eof_timer = None
        if self.cycle is None or self.cycle.response_started or self.transport.is_closing():
            return
        log.debug(
            "%s: closed its side and no answer started in %gs; treating it as gone",
            _peer(self.client),
            self.half_close_grace,
        )
        self.transport.close()  # connection_lost: the app sees http.disconnect

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        log.debug(
            "%s: no complete request head in %gs (%d bytes of one); closing",
            _peer(self.client),
            self.header_timeout,
            len(partial),
        )
        if partial:
            self.transport.write(_REQUEST_TIMEOUT)
        self._close()

    def _linger_expired(self) -> None:
        self._linger_timer = None
        log.debug(
            "%s: request body stalled for %gs after the answer; closing",
            _peer(self.client),
            self.body_timeout,
        )
        self._close()

    def _close(self) -> None:
        if self.transport.is_closing():
            return
        with contextlib.suppress(h11.LocalProtocolError):  # mid-response: just drop it
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def http_protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT
) -> type[CairnH11Protocol]:
    """A :class:`CairnH11Protocol` subclass with these timeouts, for ``uvicorn.Config(http=...)``.

    >>> http_protocol(5, 10).header_timeout
    5
    """
    if not (header_timeout > 0 and body_timeout > 0):
        raise ValueError("timeouts must be positive")
    return type(
        "CairnH11Protocol",
        (CairnH11Protocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout},
    )


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"
