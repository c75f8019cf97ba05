"""Several generations answered as one response (legacy Completions: prompt lists, ``n``).

Each choice is an ordinary engine request (its own lease on the model, so
the model stays loaded until the last one ends); :class:`ChoiceStreams`
reads them as one stream in the shape the runner reads
(``next_batch`` / ``interrupt`` / ``drained`` / ``cancel``)::

    streams = ChoiceStreams([s0, s1], prompt_of=[0, 0])
    await streams.next_batch()  # [ChoiceEvent(0, TextDelta(...)), ChoiceEvent(1, ...)]
    ...                         # then one Done: usage over all choices

Every choice's events come wrapped in a
:class:`~mlx_cairn.protocol.openai_completions.ChoiceEvent`; after the last
choice ends, one :class:`~mlx_cairn.types.Done` carries the usage of the
whole request: prompt tokens (and cache hits) once per prompt, output tokens
of every choice. A choice that fails ends the request with its Error, and the
other choices are cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from mlx_cairn.protocol.openai_completions import ChoiceEvent
from mlx_cairn.types import Done, Error, Event, Usage


class ChoiceStreams:
    """The engine streams of one request's choices, read as one (see the module doc)."""

    def __init__(self, streams: Sequence[Any], prompt_of: Sequence[int]) -> None:
        self.streams = list(streams)
        #: Which prompt each choice answers (its first choice counts the prompt's usage).
        self.prompt_of = list(prompt_of)
        self._done: dict[int, Done] = {}
        self._ended = False  # the final event was handed out

    @property
    def drained(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def interrupt(self) -> None:
        for s in self.streams:
            s.interrupt()

    async def next_batch(self) -> list[Any]:
        """The events queued now on any choice (waiting for one), ``[]`` when interrupted."""
        if self._ended:
            return []
        live = [i for i, s in enumerate(self.streams) if not s.drained]
        if len(live) == 1:
            batches = {live[0]: await self.streams[live[0]].next_batch()}
        else:
            batches = await _first_batches({i: self.streams[i] for i in live})
        out: list[Any] = []
        for i, events in sorted(batches.items()):
            for ev in events:
                if isinstance(ev, Error):
                    self._ended = True
                    self.cancel()
                    return [*out, ev]
                if isinstance(ev, Done):
                    self._done[i] = ev
                out.append(ChoiceEvent(i, ev))
        if len(self._done) == len(self.streams):
            self._ended = True
            out.append(self._total())
        return out

    def _total(self) -> Done:
        """One Done for the whole request (see the module doc)."""
        firsts = {p: self._done[i] for i, p in reversed(list(enumerate(self.prompt_of)))}
        u = [d.usage for d in self._done.values()]
        usage = Usage(
            input_tokens=sum(d.usage.input_tokens for d in firsts.values()),
            output_tokens=sum(x.output_tokens for x in u),
            cached_tokens=sum(d.usage.cached_tokens for d in firsts.values()),
            draft_tokens=sum(x.draft_tokens for x in u),
            accepted_draft_tokens=sum(x.accepted_draft_tokens for x in u),
        )
        first = self._done[0]
        return Done(first.stop_reason, first.matched_stop, usage, first.timings)


async def _first_batches(streams: dict[int, Any]) -> dict[int, list[Event]]:
    """``next_batch`` of every stream in ``streams``, as soon as one has events.

    One task per stream; those still waiting are cancelled (a cancelled wait
    takes nothing from its stream: its events stay queued for the next call).
    """
    tasks = {i: asyncio.ensure_future(s.next_batch()) for i, s in streams.items()}
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks.values():
            t.cancel()
        # Let the cancelled waits clean up; asyncio.wait (unlike awaiting them) does
        # not swallow a cancellation of this coroutine itself.
        await asyncio.wait(tasks.values())
    return {i: t.result() for i, t in tasks.items() if not t.cancelled()}
