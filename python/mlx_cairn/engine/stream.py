"""A request's Event stream, filled by the engine thread, read from any thread or loop.

The engine thread calls :meth:`RequestStream._push` / :meth:`RequestStream._finish`;
readers iterate asynchronously (any asyncio loop, never blocked) or
synchronously (:meth:`RequestStream.iter_sync`, a ``threading.Condition`` wait)::

    stream = engine.submit(request)
    async for ev in stream:        # ends after Done or Error
        ...
    await stream.aclose()          # cancels if it has not finished

    while not stream.drained:      # what a server does: all events queued so far
        events = await stream.next_batch()

Wake-ups are batched per event loop: an engine step pushes one token to each
of its rows, and all the readers of one loop that wait meanwhile are woken by
one ``loop.call_soon_threadsafe`` (a :class:`_LoopWaker`), not one per stream
and token. A reader waits on one future per wake-up, no task, however many
events it then takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mlx_cairn.types import Done, Error, Event

if TYPE_CHECKING:
    from mlx_cairn.engine.request import PreparedRequest


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
        # One async waiter at a time: (waker of its loop, future) of the blocked reader.
        self._waiter: tuple[_LoopWaker, asyncio.Future[None]] | None = None

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
            waker, fut = self._waiter
            self._waiter = None
            waker.wake(fut)

    # ------------------------------------------------------------ reader side

    @property
    def finished(self) -> bool:
        """True once the final event (Done or Error) has been queued."""
        return self._finished

    @property
    def drained(self) -> bool:
        """True once the reader has taken the final event (nothing more will come)."""
        return self._consumed_last

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
                fut = self._wait_locked()
            await self._await(fut)

    async def next_batch(self) -> list[Event]:
        """Every event queued now, waiting for at least one.

        Returns ``[]`` when :meth:`interrupt` woke the wait, and at once after
        the final event was taken (see :attr:`drained`).
        """
        with self._lock:
            if not self._events:
                if self._finished:
                    return []
                fut = self._wait_locked()
            else:
                fut = None
        if fut is not None:
            await self._await(fut)
        with self._lock:
            events = list(self._events)
            self._events.clear()
            if events and isinstance(events[-1], (Done, Error)):
                self._consumed_last = True
            return events

    def interrupt(self) -> None:
        """Wake a :meth:`next_batch` (or ``__anext__``) wait of this stream's reader early.

        Call it from the reader's own event loop (a disconnect, a ping timer):
        the wait returns ``[]`` (``__anext__`` just waits again). Nothing
        happens when the reader is not waiting.
        """
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter[1].done():
            waiter[1].set_result(None)

    def _wait_locked(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = (_LoopWaker.of(loop), fut)
        return fut

    async def _await(self, fut: asyncio.Future[None]) -> None:
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


class _LoopWaker:
    """Resolves reader futures on one event loop, one ``call_soon_threadsafe`` per batch.

    The first :meth:`wake` after the loop last ran :meth:`_run` schedules it;
    wakes that come before it runs (the other rows of the same engine step)
    only join its list. The engine thread never waits on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future[None]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        """The waker of ``loop`` (made on first use)."""
        with _WAKERS_LOCK:
            waker = _WAKERS.get(loop)
            if waker is None:
                waker = _WAKERS[loop] = cls(loop)
        return waker

    def wake(self, fut: asyncio.Future[None]) -> None:
        """Resolve ``fut`` on its loop soon (any thread)."""
        with self._lock:
            self._pending.append(fut)
            if len(self._pending) > 1:  # a _run is already scheduled
                return
        # A closed reader loop raises RuntimeError: nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            futs, self._pending = self._pending, []
        for fut in futs:
            if not fut.done():
                fut.set_result(None)


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = (
    weakref.WeakKeyDictionary()
)
_WAKERS_LOCK = threading.Lock()
