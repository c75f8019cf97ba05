"""The engine of an embedding model: one worker thread, a bounded queue, chunked forwards.

An embedding model never shares weights with a chat engine (a chat model asked
for embeddings is refused, and the other way round), so it gets a worker of its
own rather than a slot in a chat engine's step loop; it keeps the same
contract as :class:`~mlx_cairn.engine.Engine` where the server reads one
(``submit`` / ``stats`` / ``close``, ``QueueFull`` past ``max_queue``).

Batching: every queued request is cut into its sequences, and each forward
takes sequences from the queued requests in turn (round robin, longest first
within a request) up to ``max_batch_rows`` rows and ``max_batch_tokens``
padded tokens. So a request of 2,000 passages is many short forwards, a
one-line query that arrives meanwhile rides in the next one, and no forward
holds the machine for long: chat engines' decode steps run between them (on a
GPU they interleave at forward granularity, on the CPU the two threads share
the cores). A sequence longer than the budget runs alone.

Example::

    engine = EmbeddingEngine(load_embedding_model(folder))
    vecs = engine.embed_sync(engine.tokenize(["a", "b"], truncate=False))  # [2, dims]
    engine.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.engine.worker import WorkerOwner
from mlx_cairn.errors import ContextLengthExceeded, EngineError, InvalidRequest, QueueFull
from mlx_cairn.models.embedding import EmbeddingModel, forward_budget, not_a_chat_model

log = logging.getLogger("mlx_cairn.engine")

#: Queued requests before ``submit`` raises QueueFull (the chat engine's default).
DEFAULT_MAX_QUEUE = 64
#: Rows of one forward pass at most.
DEFAULT_MAX_BATCH_ROWS = 64
#: Work of one forward pass, in FLOPs: about 2 s on this project's CPU reference
#: (~150 GFLOP/s), a few ms on a GPU. It sets the padded-token budget per model.
DEFAULT_FORWARD_FLOPS = 3e11
#: Bounds on that budget (tiny models would get millions; huge ones a handful).
MIN_BATCH_TOKENS, MAX_BATCH_TOKENS = 256, 16384


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One request's answer."""

    #: [inputs, dimensions] float32, each row of unit length.
    vectors: np.ndarray
    prompt_tokens: int
    #: Seconds from submit to its first forward, and to its last.
    queue_seconds: float
    total_seconds: float


@dataclass(eq=False)
class _Job:
    seqs: list[list[int]]
    future: concurrent.futures.Future[EmbeddingResult]
    arrived: float
    #: Indices of ``seqs`` in the order they are computed (longest first).
    order: list[int] = field(default_factory=list)
    scheduled: int = 0  # how many of ``order`` went into a forward
    computed: int = 0
    started: float | None = None
    cancelled: bool = False
    out: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


class EmbeddingStream:
    """A submitted request: ``await`` it through ``async for`` (one
    :class:`EmbeddingResult`, then the end) or :meth:`result`; :meth:`cancel` drops it.

    The server's model lease wraps it like a chat stream, giving the model back
    when the iteration ends or the stream is cancelled.
    """

    def __init__(self, job: _Job, engine: EmbeddingEngine) -> None:
        self._job = job
        self._engine = engine
        self._read = False

    def __aiter__(self) -> EmbeddingStream:
        return self

    async def __anext__(self) -> EmbeddingResult:
        if self._read:
            raise StopAsyncIteration
        self._read = True
        return await asyncio.wrap_future(self._job.future)

    def result(self, timeout: float | None = None) -> EmbeddingResult:
        """Block until the answer is there (scripts and tests)."""
        return self._job.future.result(timeout)

    def cancel(self) -> None:
        """Drop the request (no-op once answered): its sequences not yet computed are skipped."""
        self._engine._cancel(self._job)


class EmbeddingEngine(WorkerOwner):
    """See the module doc. ``loaded`` is the model (the registry measures it)."""

    def __init__(
        self,
        model: EmbeddingModel,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        max_batch_tokens: int | None = None,
    ) -> None:
        if max_queue < 1 or max_batch_rows < 1 or (max_batch_tokens or 1) < 1:
            raise ValueError("max_queue, max_batch_rows and max_batch_tokens must be at least 1")
        self.loaded = model
        self.context_length = model.max_length
        self.max_queue = max_queue
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens or min(
            MAX_BATCH_TOKENS, max(MIN_BATCH_TOKENS, forward_budget(model, DEFAULT_FORWARD_FLOPS))
        )
        self._lock = threading.Condition()
        self._jobs: list[_Job] = []  # arrival order; a job leaves once answered or dropped
        self._closing = False
        self._counts = {"total": 0, "completed": 0, "failed": 0, "cancelled": 0, "tokens": 0}
        self._start_worker(self._loop, "mlx-cairn-embed")

    # ------------------------------------------------------------ any thread

    def tokenize(self, texts: list[str], *, truncate: bool) -> list[list[int]]:
        """Token ids of each text, specials included (ContextLengthExceeded when one is
        longer than the model takes and ``truncate`` is false)."""
        return self.loaded.tokenize(texts, truncate=truncate)

    def check_ids(self, seqs: list[list[int]], *, truncate: bool, param: str) -> list[list[int]]:
        """Token-id inputs as given: each id must be in the vocabulary, each input fit."""
        vocab, limit = self.loaded.vocab_size, self.loaded.max_length
        out = []
        for i, s in enumerate(seqs):
            bad = next((t for t in s if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{param}[{i}]: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                    param=param,
                )
            if len(s) > limit:
                if not truncate:
                    raise ContextLengthExceeded(
                        prompt_tokens=len(s), limit=limit, prompt_param=param
                    )
                s = s[:limit]
            out.append(list(s))
        return out

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """Chat, messages and completions routes end here: a 400 before any work."""
        raise not_a_chat_model(self.loaded.name)

    def count_tokens(self, *args: Any, **kwargs: Any) -> int:
        raise not_a_chat_model(self.loaded.name)

    def submit(self, seqs: list[list[int]]) -> EmbeddingStream:
        """Queue one request's token-id sequences; raises QueueFull at once when
        ``max_queue`` requests wait. An empty request is answered at once."""
        fut: concurrent.futures.Future[EmbeddingResult] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # cancelled through the job, never the future
        job = _Job([list(s) for s in seqs], fut, time.perf_counter())
        job.order = sorted(range(len(job.seqs)), key=lambda i: -len(job.seqs[i]))
        with self._lock:
            if self._closing:
                raise EngineError("the engine is closed")
            if sum(1 for j in self._jobs if j.started is None) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} embedding requests are already waiting")
            self._counts["total"] += 1
            if not job.seqs:
                self._counts["completed"] += 1
                fut.set_result(
                    EmbeddingResult(np.zeros((0, self.loaded.dimensions), np.float32), 0, 0.0, 0.0)
                )
            else:
                self._jobs.append(job)
                self._lock.notify_all()
        return EmbeddingStream(job, self)

    def embed_sync(self, seqs: list[list[int]], timeout: float | None = None) -> np.ndarray:
        """Submit and wait (scripts and tests): the vectors [len(seqs), dimensions]."""
        return self.submit(seqs).result(timeout).vectors

    def stats(self) -> EngineStats:
        """Requests waiting (``queue_depth``) and being computed (``running``), and counters."""
        with self._lock:
            queued = sum(1 for j in self._jobs if j.started is None)
            c = self._counts
            return EngineStats(
                queue_depth=queued,
                running=len(self._jobs) - queued,
                prefill_tokens=c["tokens"],
                requests_total=c["total"],
                requests_completed=c["completed"],
                requests_failed=c["failed"],
                requests_cancelled=c["cancelled"],
            )

    def _cancel(self, job: _Job) -> None:
        with self._lock:
            if job in self._jobs and not job.cancelled:
                job.cancelled = True
                self._counts["cancelled"] += 1
                if job.computed == job.scheduled:  # not in a forward now: drop it at once
                    self._jobs.remove(job)

    # ------------------------------------------------------------ worker thread

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._jobs and not self._closing:
                        self._lock.wait()
                    if self._closing:
                        for job in self._jobs:
                            job.future.set_exception(EngineError("the engine was closed"))
                        self._jobs.clear()
                        return
                    rows = self._take()
                try:
                    vecs = self.loaded.embed([job.seqs[i] for job, i in rows])
                except Exception as e:  # a failed forward fails its requests; the rest go on
                    log.exception("embedding forward failed")
                    self._fail({job for job, _ in rows}, EngineError(f"embedding failed: {e}"))
                    continue
                self._store(rows, vecs)
                time.sleep(0)  # let a waiting chat engine thread take the interpreter first
        finally:
            mx.clear_streams()  # MLX needs a thread's streams gone before it ends

    def _take(self) -> list[tuple[_Job, int]]:
        """The next forward's rows (lock held): queued requests in turn, one sequence
        each per round, while the padded batch stays within both budgets::

            job A (3 seqs), job B (1 seq)  ->  rows A0 B0 A1 A2   (budget permitting)
        """
        rows: list[tuple[_Job, int]] = []
        width = 0
        now = time.perf_counter()
        while True:
            added = False
            for job in self._jobs:
                if job.cancelled or job.scheduled == len(job.order):
                    continue
                i = job.order[job.scheduled]
                w = max(width, len(job.seqs[i]))
                if rows and (
                    len(rows) >= self.max_batch_rows or w * (len(rows) + 1) > self.max_batch_tokens
                ):
                    return rows
                rows.append((job, i))
                job.scheduled += 1
                job.started = job.started or now
                width, added = w, True
            if not added:
                return rows

    def _store(self, rows: list[tuple[_Job, int]], vecs: np.ndarray) -> None:
        with self._lock:
            for (job, i), v in zip(rows, vecs, strict=True):
                if job.out is None:
                    job.out = np.empty((len(job.seqs), vecs.shape[1]), np.float32)
                job.out[i] = v
                job.computed += 1
            for job in {job for job, _ in rows}:
                if job.cancelled:
                    if job.computed == job.scheduled and job in self._jobs:
                        self._jobs.remove(job)
                    continue
                if job.computed < len(job.seqs):
                    continue
                self._jobs.remove(job)
                end = time.perf_counter()
                self._counts["completed"] += 1
                self._counts["tokens"] += job.tokens
                assert job.out is not None and job.started is not None
                job.future.set_result(
                    EmbeddingResult(
                        job.out, job.tokens, job.started - job.arrived, end - job.arrived
                    )
                )

    def _fail(self, jobs: set[_Job], err: Exception) -> None:
        with self._lock:
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
                if not job.cancelled:
                    self._counts["failed"] += 1
                    job.future.set_exception(err)
