"""The serving engine's any-thread API: what callers of :class:`Engine` use.

Example::

    from mlx_cairn import Engine, EngineConfig
    from mlx_cairn.models import load
    engine = Engine(load(None), EngineConfig(kv_cache_gb=1.0))
    async for ev in engine.generate(ChatRequest([Message("user", "Hi")], max_tokens=32)):
        ...
    for ev in engine.generate_sync(request):   # scripts
        ...
    engine.close()

Threads: ``prepare`` / ``count_tokens`` / ``submit`` / ``announce`` / ``stats`` /
``cancel`` / ``close`` run on any thread; everything that touches MLX, the
block pool or the prefix cache runs on the engine thread (engine/core.py).
Requests reach it through an inbox; Events leave through each request's
:class:`~mlx_cairn.engine.stream.RequestStream`. The options are one
:class:`~mlx_cairn.engine.config.EngineConfig` (engine/config.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

from mlx_cairn import constrain
from mlx_cairn.constrain import GrammarMask
from mlx_cairn.engine import prepare as _prep
from mlx_cairn.engine.config import EngineConfig
from mlx_cairn.engine.core import EngineCore
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.engine.speculate import RowSpec
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.engine.stream import RequestStream
from mlx_cairn.engine.worker import WorkerOwner
from mlx_cairn.errors import EngineError, QueueFull
from mlx_cairn.types import ChatRequest, Event


class Engine(EngineCore, WorkerOwner):
    """Continuous-batching generation over a paged KV cache with prefix reuse.

    Args:
        loaded_model: a ``mlx_cairn.models.LoadedModel``.
        config: the options (:class:`~mlx_cairn.engine.config.EngineConfig`;
            None: every default).

    Raises:
        ValueError: the options do not suit the model (a KV budget too small
            for one block, a ``kv_group_size`` that does not divide its head
            dimension, a draft model with another vocabulary ...).

    Building it sizes and allocates the pools (engine/parts.py) and starts the
    engine thread (engine/core.py); ``close`` (or leaving a ``with`` block) stops it.
    """

    def __init__(self, loaded_model: Any, config: EngineConfig | None = None) -> None:
        super().__init__(loaded_model, EngineConfig() if config is None else config)
        self._start_worker(self._loop, "mlx-cairn-engine")

    def prepare(self, request: ChatRequest, *, clamp_max_tokens: bool = False) -> PreparedRequest:
        """Template + tokenize + validate (raises ContextLengthExceeded / InvalidRequest).

        ``clamp_max_tokens``: lower ``max_tokens`` to the room the prompt leaves
        (context or KV pool) instead of raising when the prompt itself fits.
        """
        return _prep.prepare(
            self.loaded,
            request,
            context_length=self.context_length,
            max_tokens_capacity=(self._pools.num_blocks - 1) * self.block_size,
            clamp_max_tokens=clamp_max_tokens,
        )

    def count_tokens(self, request: ChatRequest) -> int:
        """Prompt tokens of ``request`` (== ``usage.input_tokens`` of its generation).

        Renders and tokenizes only: ``max_tokens`` and sampling settings are not
        checked, and a prompt longer than the context or the KV pool still gets
        its size (clients use it to decide when to compact a conversation).
        """
        return len(_prep.render(self.loaded, request).ids)

    def submit(self, request: ChatRequest | PreparedRequest) -> RequestStream:
        """Queue a request; raises QueueFull at once when ``max_queue`` requests wait."""
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        with self._lock:
            if self._closing:
                raise EngineError("the engine is closed")
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} requests are already waiting")
            rid = next(self._ids)
            stream = RequestStream(rid, prepared, self._cancel)
            seq = Sequence(
                request_id=rid,
                prepared=prepared,
                stream=stream,
                tokens=list(prepared.prompt_ids),
                arrival=rid,
            )
            if self._spec_k and _speculates(prepared):
                seq.spec = RowSpec(self._spec_k, by_model=self._drafter is not None)
            if prepared.grammar is not None:
                seq.row_masks.append(
                    GrammarMask(
                        constrain.vocabulary(self.loaded).matcher(prepared.grammar),
                        prepared.grammar_after,
                    )
                )
            self._queued += 1
            self._inbox.append(seq)
            self._lock.notify_all()
        return stream

    def announce(self) -> Callable[[], None]:
        """Say that a request is on its way (being parsed, templated, tokenized).

        Call the returned function once it has been submitted or given up
        (it is idempotent; garbage collection counts as giving up). While an
        announced request is outstanding, an idle engine's first step waits
        for it (at most ``gather_s``), so that a burst of requests is
        prefilled together: otherwise its first request takes a step to
        itself and the rest wait behind it::

            done = engine.announce()
            try:
                stream = engine.submit(engine.prepare(request))
            finally:
                done()
        """
        with self._lock:
            self._announced += 1
            self._announces += 1
        return _Announced(self)

    async def generate(self, request: ChatRequest | PreparedRequest) -> AsyncIterator[Event]:
        """Submit and iterate; closing the iterator early cancels the request."""
        stream = self.submit(request)
        try:
            async for ev in stream:
                yield ev
        finally:
            stream.cancel()

    def generate_sync(
        self, request: ChatRequest | PreparedRequest, *, timeout: float | None = None
    ) -> Iterator[Event]:
        """Synchronous generation for scripts (``timeout``: max seconds between events)."""
        return self.submit(request).iter_sync(timeout)

    def stats(self) -> EngineStats:
        """Counters for /health and /metrics (a snapshot taken after the last step,
        with the live ``queue_depth``)."""
        with self._lock:
            return replace(self._stats, queue_depth=self._queued)

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify_all()


class _Announced:
    """What :meth:`Engine.announce` returns: call it once the request is submitted
    or given up (idempotent; garbage collection counts as giving up)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine: Engine | None = engine

    def __call__(self) -> None:
        engine = self._engine
        if engine is None:
            return
        with engine._lock:  # a Condition over an RLock: safe from __del__ on any thread
            if self._engine is None:
                return
            self._engine = None
            engine._announced -= 1
            engine._lock.notify_all()

    __del__ = __call__


def _speculates(prepared: PreparedRequest) -> bool:
    """Whether a request may speculate: not opted out, and nothing that reads each
    token before the next is scored (processors, a grammar, logprobs)."""
    s = prepared.sampling
    return (
        prepared.request.speculative is not False
        and prepared.grammar is None
        and not s.uses_processors
        and not s.logprobs
    )
