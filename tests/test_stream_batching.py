"""RequestStream hand-off to an event loop: one wake-up per batch, batches read whole (issue 17)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from live_server import scripted_server, sse_events
from mlx_cairn.api import respond as runner
from mlx_cairn.engine.stream import RequestStream
from mlx_cairn.types import Done, Error, TextDelta, Timings, Usage
from scripted_model import say


class CountingLoop(asyncio.SelectorEventLoop):
    """A loop that counts the cross-thread wake-ups it is given."""

    threadsafe_calls = 0

    def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def new_stream(rid: int = 0, cancels: list[int] | None = None) -> RequestStream:
    return RequestStream(rid, None, (cancels if cancels is not None else []).append)  # type: ignore[arg-type]


def done() -> Done:
    return Done("end_turn", None, Usage(1, 2, 0), Timings())


def run(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_one_wakeup_for_every_stream_of_a_step() -> None:
    """The engine thread pushes one token to each of 8 waiting streams: one call_soon_threadsafe."""
    loop = CountingLoop()
    streams = [new_stream(i) for i in range(8)]

    async def main() -> list[list[Any]]:
        readers = [asyncio.ensure_future(s.next_batch()) for s in streams]
        await asyncio.sleep(0)  # every reader is waiting now
        # The "engine step" runs while the loop is busy here, as it would be
        # when the engine thread pushes all its rows between two loop turns.
        t = threading.Thread(
            target=lambda: [s._push([TextDelta(f"t{s.request_id}")]) for s in streams]
        )
        t.start()
        t.join()
        return list(await asyncio.gather(*readers))

    got = run(loop, main())
    assert got == [[TextDelta(f"t{i}")] for i in range(8)]
    assert loop.threadsafe_calls == 1


def test_next_batch_takes_everything_queued_and_ends() -> None:
    s = new_stream()
    s._push([TextDelta("a"), TextDelta("b")])
    s._push([TextDelta("c")])

    async def main() -> tuple[list[Any], list[Any], bool, list[Any]]:
        first = await s.next_batch()
        s._push([TextDelta("d"), done()])
        second = await s.next_batch()
        return first, second, s.drained, await s.next_batch()

    first, second, drained, after = run(asyncio.new_event_loop(), main())
    assert first == [TextDelta("a"), TextDelta("b"), TextDelta("c")]
    assert second == [TextDelta("d"), done()]
    assert drained and after == []


def test_interrupt_wakes_a_waiting_reader_with_nothing() -> None:
    s = new_stream()

    async def main() -> tuple[list[Any], list[Any]]:
        reader = asyncio.ensure_future(s.next_batch())
        await asyncio.sleep(0)
        s.interrupt()
        woken = await reader
        s.interrupt()  # nobody waits: nothing happens
        s._push([Error("cancelled", "x")])
        return woken, await s.next_batch()

    woken, last = run(asyncio.new_event_loop(), main())
    assert woken == []
    assert last == [Error("cancelled", "x")]


def test_async_iteration_and_pushes_from_a_thread_keep_order() -> None:
    s = new_stream()
    events: list[Any] = [TextDelta(str(i)) for i in range(200)] + [done()]

    def engine() -> None:
        for i in range(0, len(events), 3):
            s._push(events[i : i + 3])

    async def main() -> list[Any]:
        t = threading.Thread(target=engine)
        t.start()
        out = [ev async for ev in s]
        t.join()
        return out

    assert run(asyncio.new_event_loop(), main()) == events


def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    cancels: list[int] = []
    s = new_stream(7, cancels)

    async def main() -> list[Any]:
        reader = asyncio.ensure_future(s.next_batch())
        await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        s._push([TextDelta("x")])  # no future left to resolve: no error on the loop
        return await s.next_batch()

    assert run(asyncio.new_event_loop(), main()) == [TextDelta("x")]
    s.cancel()
    assert cancels == [7]


# ------------------------------------------------ large bodies parse off the loop


def test_a_body_parsed_off_the_loop_answers_as_on_it(monkeypatch: Any) -> None:
    """Past PARSE_OFF_LOOP_BYTES validation runs in a worker thread: same answers, same 400s."""
    monkeypatch.setattr(runner, "PARSE_OFF_LOOP_BYTES", 1)  # every body takes that path
    auth = {"x-api-key": "tok", "anthropic-version": "2023-06-01"}
    with scripted_server("tok", {}) as env:
        url = env["url"] + "/v1/messages"
        body = {
            "model": "scripted",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": say("Hello")}],
        }
        r = httpx.post(url, json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": "Hello"}]
        s = httpx.post(url, json={**body, "stream": True}, headers=auth, timeout=30)
        names = [n for n, _ in sse_events(s.text) if n != "ping"]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        bad = httpx.post(url, json={**body, "max_tokens": -1}, headers=auth, timeout=30)
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_request_error"
