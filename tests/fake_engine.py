"""A stand-in for ``mlx_cairn.engine.Engine`` with the same contract (server tests only).

Tokens are whitespace-separated words of the rendered conversation; output is
scripted per request by a callback. Prefix hits are simulated in 4-token
blocks so the cache headers and usage can be exercised.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_cairn.errors import ContextLengthExceeded, QueueFull
from mlx_cairn.types import ChatRequest, Done, Error, Event, TextDelta, Usage

BLOCK = 4


def render(req: ChatRequest) -> list[str]:
    parts: list[str] = []
    for m in req.messages:
        parts += [f"<{m.role}>", *m.content.split()]
        for tc in m.tool_calls:
            parts += [tc.name, tc.arguments]
    for t in req.tools:
        parts += ["<tool>", t.name]
    return parts


@dataclass
class FakePrepared:
    request: ChatRequest
    prompt: list[str]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


class FakeStream:
    def __init__(self, engine: FakeEngine, events: list[Event], delay: float) -> None:
        self.engine = engine
        self.events = list(events)
        self.delay = delay
        self.cancelled = False
        self.finished = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.cancelled:
            self._end()
            return Error("cancelled", "cancelled")
        ev = self.events.pop(0)
        if isinstance(ev, (Done, Error)):
            self._end()
        return ev

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            with self.engine.lock:
                self.engine.running -= 1

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled = True
            self.engine.cancels += 1
            self._end()

    async def aclose(self) -> None:
        self.cancel()


class FakeEngine:
    def __init__(
        self,
        script: Callable[[ChatRequest], list[Event]] | None = None,
        *,
        context: int = 4096,
        max_queue: int = 64,
        delay: float = 0.0,
    ) -> None:
        self.script = script or (lambda req: [TextDelta("Hello"), TextDelta(" world")])
        self.context = context
        self.max_queue = max_queue
        self.delay = delay
        self.lock = threading.Lock()
        self.running = 0
        self.cancels = 0
        self.seen: list[list[str]] = []
        self.requests: list[ChatRequest] = []

    def count_tokens(self, req: ChatRequest) -> int:
        return len(render(req))

    def prepare(self, req: ChatRequest) -> FakePrepared:
        prompt = render(req)
        if len(prompt) + req.max_tokens > self.context:
            raise ContextLengthExceeded(
                f"prompt ({len(prompt)}) + max_tokens ({req.max_tokens}) > context ({self.context})"
            )
        return FakePrepared(req, prompt)

    def submit(self, prepared: FakePrepared | ChatRequest) -> FakeStream:
        if isinstance(prepared, ChatRequest):
            prepared = self.prepare(prepared)
        with self.lock:
            if self.running >= self.max_queue:
                raise QueueFull(retry_after=2.0)
            self.running += 1
        prompt = prepared.prompt
        cached = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(prompt)) - 1 and old[n] == prompt[n]:
                n += 1
            cached = max(cached, n // BLOCK * BLOCK)
        self.seen.append(prompt)
        self.requests.append(prepared.request)
        events = list(self.script(prepared.request))
        if not events or not isinstance(events[-1], (Done, Error)):
            n_out = sum(1 for e in events if not isinstance(e, (Done, Error)))
            events.append(Done("end_turn", usage=Usage(len(prompt), n_out, cached)))
        return FakeStream(self, events, self.delay)

    def stats(self) -> dict[str, Any]:
        return {
            "queue_depth": 0,
            "running": self.running,
            "blocks_total": 64,
            "blocks_free": 64,
            "blocks_cached": 0,
            "blocks_in_use": 0,
            "prefix_hit_tokens": 0,
        }

    def close(self) -> None:
        pass
