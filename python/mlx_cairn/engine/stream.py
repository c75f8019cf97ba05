"""A request's Event stream, filled by the engine thread, read from any thread or loop.

The engine thread calls :meth:`RequestStream._push` / :meth:`RequestStream._finish`;
readers iterate asynchronously (any asyncio loop: wake-ups go through
``loop.call_soon_threadsafe``, the loop is never blocked) or synchronously
(:meth:`RequestStream.iter_sync`, a ``threading.Condition`` wait)::

    stream = engine.submit(request)
    async for ev in stream:        # ends after Done or Error
        ...
    await stream.aclose()          # cancels if it has not finished
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mlx_cairn.types import Done, Error, Event

if TYPE_CHECKING:
    from mlx_cairn.engine.sequence import PreparedRequest


class RequestStream:
    """Async (and sync) iterator over one request's Events; the last is Done or Error."""

    def __init__(
        self, request_id: int, prepared: PreparedRequest, cancel: Callable[[int], None]
    ) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self._cancel_cb = cancel
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._events: deque[Event] = deque()
        self._finished = False  # the engine pushed the last event
        self._consumed_last = False  # the reader saw the last event
        self._cancelled = False
        #: Sampled token ids (EOS included), set when the request ends.
        self.output_ids: list[int] = []
        # One async waiter at a time: (loop, future) of the reader blocked in __anext__.
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    # ------------------------------------------------------------ engine side

    def _push(self, events: list[Event]) -> None:
        """Append events (engine thread); wakes a waiting reader."""
        if not events:
            return
        with self._lock:
            if self._finished:
                return
            self._events.extend(events)
            if isinstance(events[-1], (Done, Error)):
                self._finished = True
            self._wake_locked()

    def _finish(self, event: Done | Error) -> None:
        """Push the final event unless one was already pushed."""
        self._push([event])

    def _wake_locked(self) -> None:
        self._cond.notify_all()
        if self._waiter is not None:
            loop, fut = self._waiter
            self._waiter = None
            # A closed reader loop raises RuntimeError: nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut)

    # ------------------------------------------------------------ reader side

    @property
    def finished(self) -> bool:
        """True once the final event (Done or Error) has been queued."""
        return self._finished

    def cancel(self) -> None:
        """Cancel the request: it leaves the batch and its blocks are freed within one step.

        Harmless after the stream finished; the stream then ends with
        ``Error("cancelled", ...)`` unless it had already ended.
        """
        with self._lock:
            if self._cancelled or self._finished:
                self._cancelled = True
                return
            self._cancelled = True
        self._cancel_cb(self.request_id)

    async def aclose(self) -> None:
        """Cancel (if still running) and stop reading."""
        self.cancel()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            with self._lock:
                if self._events:
                    return self._pop_locked()
                if self._finished:  # and every event was read
                    raise StopAsyncIteration
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                self._waiter = (loop, fut)
            try:
                await fut
            except BaseException:
                with self._lock:
                    if self._waiter is not None and self._waiter[1] is fut:
                        self._waiter = None
                raise

    def _pop_locked(self) -> Event:
        ev = self._events.popleft()
        if isinstance(ev, (Done, Error)):
            self._consumed_last = True
        return ev

    def get(self, timeout: float | None = None) -> Event | None:
        """Blocking read of the next event (None at the end of the stream).

        Raises TimeoutError when ``timeout`` seconds pass without an event.
        """
        with self._cond:
            while not self._events:
                if self._finished:  # and every event was read
                    return None
                if not self._cond.wait(timeout):
                    raise TimeoutError("no event from the engine in time")
            return self._pop_locked()

    def iter_sync(self, timeout: float | None = None) -> Iterator[Event]:
        """Synchronous iteration for scripts; cancels if the caller stops early."""
        try:
            while (ev := self.get(timeout)) is not None:
                yield ev
        finally:
            if not self._consumed_last:
                self.cancel()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
