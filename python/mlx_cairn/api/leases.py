"""A served model's slot, and the lease a request holds on it.

- A request holds a :class:`ModelLease` from :meth:`ModelRegistry.get
  <mlx_cairn.api.registry.ModelRegistry.get>` until its stream ends (or, for
  ``prepare`` / ``count_tokens`` only, until that call returns). A model with
  a lease, or with requests waiting for it, is never unloaded
  (:mod:`mlx_cairn.api.loading`), so no request runs on a half-loaded or
  half-unloaded model.
- Requests that waited for a load are answered in the order they arrived:
  each takes a turn (:meth:`ModelLease.turn`) and submits only after every
  earlier one submitted or gave up; tokenizing still runs in parallel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_cairn.models.hub import Progress
from mlx_cairn.types import Done, Error


@dataclass(eq=False)
class ServedModel:
    """One model slot: its names, its state, and while loaded its LoadedModel and Engine."""

    names: list[str]
    source: str | None
    loaded: Any = None
    engine: Any = None
    #: The last load's failure (kept until a load succeeds).
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: unloaded | loading | loaded | unloading
    state: str = "unloaded"
    pinned: bool = False
    #: Requests holding a lease (running, or between lookup and submit).
    active: int = 0
    #: Requests waiting for this model's load.
    waiting: int = 0
    last_used: float | None = None
    load_seconds: float | None = None
    loaded_at: float | None = None
    loads: int = 0
    unloads: int = 0
    memory_bytes: int = 0
    #: The engine's context (after ``--context-length``), kept across unloads:
    #: the model listings report it.
    context_length: int | None = None
    #: Seconds this model stays loaded once idle, as the last request that said
    #: so asked (:meth:`ModelRegistry.keep_alive`; ``inf``: never unloaded);
    #: None: the server's ``idle_unload``.
    keep_alive: float | None = None
    download: Progress | None = None
    _loading: concurrent.futures.Future[None] | None = field(default=None, repr=False)
    _turns: _Turns = field(default_factory=lambda: _Turns(), repr=False)

    @property
    def name(self) -> str:
        """The primary name."""
        return self.names[0]

    def describe(self) -> dict[str, Any]:
        """The ``/health`` entry (engine stats are added by the caller)."""
        out: dict[str, Any] = {
            "name": self.name,
            "names": list(self.names),
            "loaded": self.engine is not None,
            "state": self.state,
            "pinned": self.pinned,
            "active_requests": self.active,
            "waiting_requests": self.waiting,
            "memory_bytes": self.memory_bytes,
            "last_used": self.last_used,
            "load_seconds": self.load_seconds,
            "loads": self.loads,
            "unloads": self.unloads,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.download is not None and self.state == "loading":
            out["download"] = self.download.snapshot()
        return out


class ModelLease:
    """What a request holds: the model's names and an engine that cannot be unloaded under it.

    ``engine`` wraps the real one: ``submit`` returns a stream that gives the
    lease back when it ends (last event read, or cancelled); ``prepare`` that
    raises and ``count_tokens`` give it back at once. A lease dropped unused
    gives it back when garbage collected.

    A lease from :meth:`ModelRegistry.get` that waited for its model's load
    (or came while earlier waiters had not submitted yet) carries a turn:
    ``await lease.turn()`` before ``engine.submit`` keeps arrival order among
    them (submitting or releasing gives the turn to the next one). Leases from
    the synchronous :meth:`ModelRegistry.lease` take no turn.
    """

    def __init__(
        self,
        sm: ServedModel,
        engine: Any,
        release: Callable[[], None],
        ticket: int | None = None,
    ) -> None:
        self.served = sm
        self.names = sm.names
        self.source = sm.source
        self.loaded = sm.loaded
        self.created = sm.created
        self.ticket = ticket
        turns = sm._turns
        self._pass_turn = _Once(lambda: turns.done(ticket) if ticket is not None else None)
        pass_turn = self._pass_turn

        def release_all() -> None:
            pass_turn()
            release()

        self._release = _Once(release_all)
        self.engine = _LeasedEngine(engine, self._release, self._pass_turn)
        weakref.finalize(self, self._release)

    @property
    def name(self) -> str:
        return self.served.name

    async def turn(self) -> None:
        """Wait until every request that waited for this load before this one has
        submitted or given up (at once for a lease that did not wait)."""
        if self.ticket is not None:
            await self.served._turns.wait(self.ticket)

    def release(self) -> None:
        """Give the lease back now (idempotent)."""
        self._release()


class _Turns:
    """Arrival order of the requests waiting for one model's load (one per model).

    Tickets are taken in arrival order; ticket ``t`` may submit once every
    ticket before it is done (submitted, released, or its wait failed)::

        taken:  0 1 2 3 4          front = 2 (0 and 1 done)
        done:   x x . x .          3 is done too, but 2 still holds the turn

    Thread-safe; waiters are asyncio futures woken on their own loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = 0
        self._front = 0  # the lowest ticket not done
        self._done: set[int] = set()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def take(self) -> int:
        with self._lock:
            self._taken += 1
            return self._taken - 1

    def outstanding(self) -> bool:
        """Tickets taken and not yet done (a newcomer then queues behind them)."""
        with self._lock:
            return self._front < self._taken

    def done(self, ticket: int) -> None:
        with self._lock:
            self._done.add(ticket)
            while self._front in self._done:
                self._done.discard(self._front)
                self._front += 1
            ready = [w for w in self._waiters if w[0] <= self._front]
            self._waiters = [w for w in self._waiters if w[0] > self._front]
        for _, loop, fut in ready:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, fut)

    async def wait(self, ticket: int) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if ticket <= self._front:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((ticket, loop, fut))
        await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Once:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _LeasedEngine:
    def __init__(self, engine: Any, release: _Once, pass_turn: _Once) -> None:
        self._engine = engine
        self._release = release
        self._pass_turn = pass_turn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._engine.prepare(*args, **kwargs)
        except BaseException:
            self._release()
            raise

    def count_tokens(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._engine.count_tokens(*args, **kwargs)
        finally:
            self._release()

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        try:
            stream = self._engine.submit(*args, **kwargs)
        except BaseException:
            self._release()
            raise
        finally:
            self._pass_turn()  # queued in the engine (or refused): the next waiter may submit
        return _LeasedStream(stream, self._release)


class _LeasedStream:
    """The engine's stream; the lease goes back after the final event or a cancel."""

    def __init__(self, stream: Any, release: _Once) -> None:
        self._stream = stream
        self._release = release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __aiter__(self) -> _LeasedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            ev = await self._stream.__anext__()
        except BaseException:
            self._release()
            raise
        if isinstance(ev, (Done, Error)):
            self._release()  # that was the final event
        return ev

    def cancel(self) -> None:
        self._stream.cancel()
        self._release()

    async def aclose(self) -> None:
        self.cancel()
