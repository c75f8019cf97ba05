"""The large-work gate (its own threads, FIFO with threads first, the bounded
thread queue, cancellation) and handing memory back to the system."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import time

import pytest

from mlx_cairn import heavy
from mlx_cairn.errors import QueueFull
from mlx_cairn.heavy import WorkGate

pytestmark = pytest.mark.timeout(60)


def wait_until(pred, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class Holder:
    """A thread whose job on ``gate`` runs until released."""

    def __init__(self, gate: WorkGate, order: list[str] | None = None, name: str = "") -> None:
        self.gate, self.order, self.name = gate, order, name
        self.entered = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.gate.call(self._job)
        except BaseException as e:  # handed to the test
            self.error = e
            self.entered.set()

    def _job(self) -> None:
        assert threading.current_thread().name.startswith("mlx-cairn-large")
        if self.order is not None:
            self.order.append(self.name)
        self.entered.set()
        self.release.wait(30)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(10)


def test_at_most_slots_run_and_the_rest_wait_in_order() -> None:
    done: list[int] = []
    gate = WorkGate(slots=2, thread_queue=8, on_done=lambda: done.append(1))
    order: list[str] = []
    holders = [Holder(gate, order, f"h{i}") for i in range(2)]
    for h in holders:
        assert h.entered.wait(5)
    waiting = []
    for i in range(3):
        waiting.append(Holder(gate, order, f"w{i}"))
        wait_until(lambda i=i: gate.waiting == i + 1, "the holder never queued")
    assert gate.busy == 2 and order == ["h0", "h1"]
    for h, w in zip(holders, waiting, strict=False):
        h.finish()  # its slot goes to the longest waiting one
        assert w.entered.wait(5)
    assert order == ["h0", "h1", "w0", "w1"] and gate.busy == 2 and not done
    for w in waiting:
        w.finish()
    assert order[-1] == "w2" and gate.busy == 0 and done == [1]


def test_threads_beyond_the_queue_are_refused_at_once() -> None:
    gate = WorkGate(slots=1, thread_queue=1, on_done=lambda: None)
    first = Holder(gate)
    assert first.entered.wait(5)
    second = Holder(gate)
    wait_until(lambda: gate.waiting == 1, "the second never queued")
    third = Holder(gate)
    assert third.entered.wait(5)
    assert isinstance(third.error, QueueFull) and "retry" in str(third.error)
    first.finish()
    assert second.entered.wait(5) and second.error is None
    second.finish()
    assert gate.busy == 0


def test_coroutines_wait_without_threads_and_threads_go_first() -> None:
    gate = WorkGate(slots=1, thread_queue=1, on_done=lambda: None)
    order: list[str] = []
    first = Holder(gate, order, "first")
    assert first.entered.wait(5)

    async def main() -> None:
        tasks = [asyncio.ensure_future(gate.run(order.append, f"task{i}")) for i in range(20)]
        await asyncio.sleep(0)
        while gate.waiting < 20:
            await asyncio.sleep(0.005)
        # Twenty waiting coroutines: none of them took a thread or the thread queue.
        thread = await asyncio.to_thread(Holder, gate, order, "thread")
        while gate.waiting < 21:
            await asyncio.sleep(0.005)
        first.finish()
        assert await asyncio.to_thread(thread.entered.wait, 5)
        thread.finish()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == ["first", "thread", *(f"task{i}" for i in range(20))]
    assert gate.busy == 0


def test_a_cancelled_wait_gives_nothing_away() -> None:
    gate = WorkGate(slots=1, thread_queue=1, on_done=lambda: None)
    first = Holder(gate)
    assert first.entered.wait(5)

    async def main() -> None:
        task = asyncio.ensure_future(gate.run(lambda: None))
        while gate.waiting < 1:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.waiting == 0

    asyncio.run(main())
    first.finish()
    assert gate.busy == 0


def test_a_cancelled_caller_keeps_the_slot_until_its_work_ends() -> None:
    gate = WorkGate(slots=1, thread_queue=1, on_done=lambda: None)
    started, release = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        release.wait(10)
        return "done"

    async def main() -> None:
        task = asyncio.ensure_future(gate.run(work))
        assert await asyncio.to_thread(started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.busy == 1  # the thread still runs: its slot is still taken
        release.set()
        while gate.busy:
            await asyncio.sleep(0.005)

    asyncio.run(main())


def test_a_job_that_calls_the_gate_again_takes_no_second_slot() -> None:
    gate = WorkGate(slots=1, thread_queue=0, on_done=lambda: None)

    def nested() -> int:
        # QueueFull (thread_queue 0) or a deadlock otherwise.
        return gate.call(lambda: gate.busy)

    assert asyncio.run(gate.run(nested)) == 1
    assert gate.call(nested) == 1
    assert gate.busy == 0


def test_jobs_run_on_the_gates_own_few_threads() -> None:
    gate = WorkGate(slots=2, thread_queue=8, on_done=lambda: None)
    names: set[str] = set()

    def job() -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.01)

    threads = [threading.Thread(target=gate.call, args=(job,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert 1 <= len(names) <= 2 and all(n.startswith("mlx-cairn-large") for n in names)


def test_errors_give_the_slot_back() -> None:
    gate = WorkGate(slots=1, thread_queue=1, on_done=lambda: None)

    def boom() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError):
        asyncio.run(gate.run(boom))
    with pytest.raises(ValueError):
        gate.call(boom)
    assert gate.busy == 0


def test_large_is_a_megabyte() -> None:
    assert not heavy.is_large(heavy.LARGE_BYTES - 1) and heavy.is_large(heavy.LARGE_BYTES)
    assert 1 <= heavy.SLOTS <= 4 and heavy.THREAD_QUEUE >= heavy.SLOTS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_trim_hands_freed_heap_memory_back() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    heavy.trim_memory()
    before = heavy.rss_bytes()
    assert before is not None
    # 300 MB in 64 kB blocks (below the mmap threshold: they live in the heap),
    # each written so its pages are resident, then freed.
    blocks = [libc.malloc(64 * 1024) for _ in range(4800)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    pin = libc.malloc(64 * 1024)  # keeps the heap's top in use: free alone cannot shrink it
    for b in blocks:
        libc.free(b)
    held = heavy.rss_bytes()
    assert held is not None and held > before + 200 * 2**20
    count = heavy.trim_count()
    assert heavy.trim_memory()
    assert heavy.trim_count() == count + 1
    after = heavy.rss_bytes()
    libc.free(pin)
    assert after is not None and after < before + 50 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_a_finished_burst_is_trimmed_once_after_a_pause() -> None:
    gate = WorkGate(slots=2, thread_queue=2)  # the default on_done: request_trim
    time.sleep(heavy.TRIM_DELAY_S * 2)  # a trim an earlier test asked for has run
    count = heavy.trim_count()
    for _ in range(5):
        gate.call(lambda: None)
    wait_until(lambda: heavy.trim_count() > count, "no trim after the burst")
    time.sleep(heavy.TRIM_DELAY_S * 2)
    assert heavy.trim_count() == count + 1  # five releases, one trim
