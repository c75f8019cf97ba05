"""Large work: how much of it runs at once, where, and the memory handed back after it.

Decoding a request body of a megabyte or more, and rendering and tokenizing a
prompt of that size, take CPU for seconds and transient memory of tens of
times the text's size (a 30 MB prompt makes the tokenizer allocate about a
gigabyte). Small requests skip all of this; large ones pass :data:`GATE`::

    ids = GATE.call(tokenize, text)          # from a thread (engine.prepare): waits in it

    value = await GATE.run(fn, *args)        # from a coroutine: waits without a thread

Either way the job runs on one of the gate's own :data:`SLOTS` threads, so at
most that many run at once. A coroutine waits on the event loop, which costs
nothing; a thread that waits is one of the loop's executor threads (the ones
every small request needs too), so waiting threads go first (FIFO among
themselves, then the coroutines, FIFO), at most :data:`THREAD_QUEUE` of them
wait, and one more gets :class:`QueueFull` (429, retry) at once. Threads
first also means a request whose body was decoded (``run``) is tokenized
(``call`` from a worker) before the next body is decoded, so a burst of large
requests is worked through one by one instead of piling up in waiting
threads. A job that calls the gate again runs that call in place.

Memory: glibc keeps what a thread frees in that thread's arena, and
``malloc_trim`` hands back all of it except the free space at the top of each
non-main arena (glibc keeps up to 64 MB there). Running every large job on
the same few threads keeps that remainder to a few arenas, reached once and
reused, instead of one per executor thread that ever tokenized a big prompt.
When the last large job of a burst has been done for :data:`TRIM_DELAY_S`
seconds (the request that held the memory has answered by then),
:func:`trim_memory` hands the rest back (``malloc_trim(0)`` on glibc,
``malloc_zone_pressure_relief`` on macOS, a no-op elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from mlx_cairn.errors import QueueFull

log = logging.getLogger("mlx_cairn.heavy")

#: Request bodies and prompt texts of this many bytes (characters) or more are large work.
LARGE_BYTES = 1 << 20
#: Large jobs running at once: half the cores (the other half decode), 1 to 4.
SLOTS = max(1, min(4, (os.cpu_count() or 2) // 2))
#: Threads that may wait for a slot; one more is refused with QueueFull.
THREAD_QUEUE = 2 * SLOTS
#: Seconds after the last large job before memory is handed back.
TRIM_DELAY_S = 0.5

T = TypeVar("T")

# True inside a job: a nested call or run goes straight through.
_in_job: contextvars.ContextVar[bool] = contextvars.ContextVar("mlx_cairn_heavy", default=False)


def is_large(size: int) -> bool:
    """Whether work on ``size`` bytes (or characters) of input goes through the gate."""
    return size >= LARGE_BYTES


class _Waiter:
    """One caller waiting for a slot: a thread (an Event) or a coroutine (a Future)."""

    __slots__ = ("event", "future", "loop", "state")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.event = threading.Event() if loop is None else None
        self.future: asyncio.Future[None] | None = loop.create_future() if loop else None
        self.state = "waiting"  # -> "granted" | "gone"; changed under the gate's lock

    def grant(self) -> bool:
        """Hand this waiter the slot; False when it is no longer waiting."""
        if self.state != "waiting":
            return False
        if self.event is not None:
            self.event.set()
        else:
            assert self.loop is not None
            try:
                self.loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # its loop is closed: nobody is waiting any more
                self.state = "gone"
                return False
        self.state = "granted"
        return True

    def _wake(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


class WorkGate:
    """``slots`` threads for large jobs; FIFO waiting, bounded for threads (see module doc)."""

    def __init__(
        self,
        slots: int = SLOTS,
        thread_queue: int = THREAD_QUEUE,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        if slots < 1 or thread_queue < 0:
            raise ValueError("a work gate needs slots >= 1 and thread_queue >= 0")
        self.slots = slots
        self.thread_queue = thread_queue
        self._on_done = on_done if on_done is not None else request_trim
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="mlx-cairn-large")
        self._lock = threading.Lock()
        self._busy = 0
        self._threads: deque[_Waiter] = deque()  # served first
        self._tasks: deque[_Waiter] = deque()

    @property
    def busy(self) -> int:
        """Slots in use now."""
        with self._lock:
            return self._busy

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now (threads and coroutines)."""
        with self._lock:
            return len(self._threads) + len(self._tasks)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a gate thread once a slot is free, waiting in this thread.

        Raises QueueFull at once when ``thread_queue`` threads already wait.
        """
        if _in_job.get():
            return fn(*args)
        self._acquire_in_thread()
        return self._submit(fn, args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a gate thread once a slot is free; the wait blocks no thread.

        The slot is given back when ``fn`` returns, even if the caller was
        cancelled meanwhile: the thread cannot be stopped, so its work still counts.
        """
        if _in_job.get():
            return fn(*args)
        await self._acquire_async()
        done = asyncio.wrap_future(self._submit(fn, args))
        # A cancelled caller leaves the job running; its outcome is read here.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(done)

    # ------------------------------------------------------------ internals

    def _submit(self, fn: Callable[..., T], args: tuple[Any, ...]) -> Future[T]:
        """Start ``fn`` on a gate thread for a caller that holds a slot; the job gives it back."""
        ctx = contextvars.copy_context()

        def job() -> T:
            try:
                ctx.run(_in_job.set, True)
                return ctx.run(fn, *args)
            finally:
                self._release()

        try:
            return self._pool.submit(job)
        except BaseException:
            self._release()
            raise

    def _acquire_in_thread(self) -> None:
        w = _Waiter()
        with self._lock:
            if self._busy < self.slots:
                self._busy += 1
                return
            if len(self._threads) >= self.thread_queue:
                raise QueueFull(
                    f"{self._busy} large requests are being worked on and "
                    f"{len(self._threads) + len(self._tasks)} are waiting; retry later",
                    retry_after=2.0,
                )
            self._threads.append(w)
        assert w.event is not None
        w.event.wait()  # granted: the releasing caller handed its slot over

    async def _acquire_async(self) -> None:
        w = _Waiter(asyncio.get_running_loop())
        with self._lock:
            if self._busy < self.slots:
                self._busy += 1
                return
            self._tasks.append(w)
        assert w.future is not None
        try:
            await w.future
        except BaseException:
            with self._lock:
                granted = w.state == "granted"
                if not granted:
                    w.state = "gone"
                    with contextlib.suppress(ValueError):
                        self._tasks.remove(w)
            if granted:  # the slot arrived as the wait was cancelled: pass it on
                self._release()
            raise

    def _release(self) -> None:
        with self._lock:
            if not self._hand_over():
                self._busy -= 1
            idle = self._busy == 0
        if idle:
            self._on_done()

    def _hand_over(self) -> bool:
        """Give the slot being released straight to the next waiter (under the lock)."""
        for queue in (self._threads, self._tasks):
            while queue:
                if queue.popleft().grant():
                    return True
        return False


# ---------------------------------------------------------------- memory


def _find_trim() -> Callable[[], object] | None:
    """The C call that hands free heap memory back to the system, if this libc has one."""
    try:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None)  # the C library this process already runs on
            fn = libc.malloc_trim  # glibc only (musl has none: AttributeError)
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            return lambda: fn(0)
        if sys.platform == "darwin":
            libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
            relief = libc.malloc_zone_pressure_relief
            relief.argtypes, relief.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
            return lambda: relief(None, 0)  # every zone, as much as it can
    except (OSError, AttributeError):
        pass
    return None


_TRIM = _find_trim()
_trims = 0


def trim_memory() -> bool:
    """Hand the allocator's free memory back to the system now; False where there is no way.

    ctypes releases the GIL around the call, which takes tens of ms after a
    gigabyte was freed.
    """
    global _trims
    if _TRIM is None:
        return False
    _TRIM()
    _trims += 1
    return True


def trim_count() -> int:
    """How many times :func:`trim_memory` has run (tests wait on it)."""
    return _trims


class _Trimmer:
    """Runs :func:`trim_memory` once :data:`TRIM_DELAY_S` passed without a new request."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._cond = threading.Condition()
        self._due: float | None = None
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        if _TRIM is None:
            return
        with self._cond:
            self._due = time.monotonic() + self.delay
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="mlx-cairn-trim", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._due is None:
                    self._cond.wait()
                left = self._due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._due = None
            try:
                trim_memory()
            except Exception:  # pragma: no cover - a libc call that fails is only logged
                log.exception("handing memory back failed")


_trimmer = _Trimmer(TRIM_DELAY_S)


def request_trim() -> None:
    """Hand memory back a little later, once a burst of large work is over."""
    _trimmer.request()


def rss_bytes() -> int | None:
    """This process's resident set size (``VmRSS`` in /proc/self/status); None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: The process-wide gate every large request body and prompt passes.
GATE = WorkGate()
