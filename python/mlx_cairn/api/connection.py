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
only a write tells them apart, as a closed peer answers it with a reset. A
client that half-closes does so right after its request, before the answer
starts, so:

- EOF before the answer has started: the connection stays open for writing.
  An answer that starts within :data:`HALF_CLOSE_GRACE` seconds is sent in
  full (were the client gone after all, a stream's next writes fail and
  surface as a disconnect); one that has not started by then is treated as a
  disconnect, so a long non-streamed generation for a client that left is
  cancelled after the grace instead of running to its end;
- EOF once the answer has started: the client is gone, the connection closes
  and the app sees ``http.disconnect`` at once (a stream stops generating).

A body the app is still reading is timed by the gate (:mod:`mlx_cairn.api.auth`),
which answers 408 in the dialect's envelope. When the head deadline passes with
part of a head received, a bare ``408`` goes out before the close.

Checked with uvicorn 0.30 and 0.54 (``pyproject.toml`` pins that range): it relies
on ``H11Protocol``'s ``conn``, ``cycle``, ``transport``, ``handle_events`` and
``on_response_complete``, and on ``RequestResponseCycle.response_complete`` and
``keep_alive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import is_ssl

log = logging.getLogger("mlx_cairn.api")

#: Seconds a connection may take to send a complete request head.
DEFAULT_HEADER_TIMEOUT = 60.0
#: Seconds a request body may go without progress.
DEFAULT_BODY_TIMEOUT = 60.0
#: Seconds after a client's EOF within which the answer must start (see the module doc).
HALF_CLOSE_GRACE = 5.0

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._eof_timer: asyncio.TimerHandle | None = None

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
        to a complete request whose answer has not started (module doc), else close.

        Returning True keeps the transport open for writing; the cycle then
        closes it once its response is complete (``keep_alive = False``). TLS
        transports cannot half-close, so they always close.
        """
        cycle = self.cycle
        if (
            cycle is not None
            and not cycle.response_started
            and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)  # MUST_CLOSE: HTTP/1.0
            and not is_ssl(self.transport)
        ):
            cycle.keep_alive = False
            if self._eof_timer is None:
                self._eof_timer = self.loop.call_later(self.half_close_grace, self._eof_expired)
            return True
        return None

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
        for timer in (self._head_timer, self._linger_timer, self._eof_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger_timer = self._eof_timer = None

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
