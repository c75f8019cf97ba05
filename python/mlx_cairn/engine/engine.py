"""The serving engine: a thread that owns MLX and runs continuous batching.

Example::

    from mlx_cairn import Engine
    from mlx_cairn.models import load
    engine = Engine(load(None), kv_cache_gb=1.0)
    async for ev in engine.generate(ChatRequest([Message("user", "Hi")], max_tokens=32)):
        ...
    for ev in engine.generate_sync(request):   # scripts
        ...
    engine.close()

Threads: ``prepare`` / ``count_tokens`` / ``submit`` / ``stats`` / ``cancel`` run
on any thread; everything that touches MLX, the block pool or the prefix
cache runs on the engine thread. Requests reach it through an inbox; Events
leave through each request's :class:`~mlx_cairn.engine.stream.RequestStream`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import mlx.core as mx

from mlx_cairn.engine import prepare as _prep
from mlx_cairn.engine.output import SequenceOutput
from mlx_cairn.engine.paged import KVPools, LayerSpec, pool_blocks
from mlx_cairn.engine.reasoning import ReasoningBudget
from mlx_cairn.engine.runner import InFlight, ModelRunner, merge_inflight
from mlx_cairn.engine.scheduler import Scheduler, StepPlan
from mlx_cairn.engine.sequence import PreparedRequest, Sequence
from mlx_cairn.engine.stream import RequestStream
from mlx_cairn.errors import EngineError, QueueFull
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.types import Admitted, ChatRequest, Done, Error, Event, StopReason, Timings, Usage

log = logging.getLogger("mlx_cairn.engine")

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Engine threads are daemons; stop them cleanly before MLX is torn down.
    for engine in list(_live_engines):
        engine.close(timeout=10.0)


class Engine:
    """Continuous-batching generation over a paged KV cache with prefix reuse.

    Args:
        loaded_model: a ``mlx_cairn.models.LoadedModel``.
        kv_cache_gb: KV pool size in GiB (all layers, K and V). Default: what
            ``max_batch`` full contexts need, capped at 2 GiB (or at one full
            context when that alone is larger) and at a quarter of available
            memory. Refused if it exceeds 90% of available memory.
        num_blocks: exact number of blocks instead (block 0 is reserved);
            overrides ``kv_cache_gb``.
        block_size: tokens per block.
        max_queue: requests waiting for admission before ``submit`` raises QueueFull.
        max_batch: sequences admitted (holding blocks) at once.
        step_token_budget: tokens per step: one per decoding sequence, the rest
            goes to chunked prefill.
        kv_dtype: pool dtype; default fp32 on CPU, the model's dtype otherwise.
    """

    def __init__(
        self,
        loaded_model: Any,
        *,
        kv_cache_gb: float | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_queue: int = 64,
        max_batch: int = 16,
        step_token_budget: int = 512,
        kv_dtype: mx.Dtype | None = None,
    ) -> None:
        for name, val in (
            ("block_size", block_size),
            ("max_queue", max_queue),
            ("max_batch", max_batch),
            ("step_token_budget", step_token_budget),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        self.loaded = loaded_model
        model = loaded_model.model
        if kv_dtype is None:
            kv_dtype = mx.float32 if mx.default_device() == mx.cpu else model.dtype
        # Per-layer pools (DESIGN.md §4): mlx-lm models give their layers' KV
        # shapes and windows; a uniform model gives one shape for all layers.
        layer_specs = getattr(model, "layer_specs", None) or [
            LayerSpec(model.num_kv_heads, model.head_dim, model.head_dim)
        ] * model.num_layers
        per_block = KVPools.block_bytes(layer_specs, block_size, kv_dtype.size)
        num_blocks = pool_blocks(
            per_block,
            num_blocks=num_blocks,
            kv_cache_gb=kv_cache_gb,
            default_tokens=max_batch * int(loaded_model.context_length),
            block_size=block_size,
            context_tokens=int(loaded_model.context_length),
        )
        self.block_size = block_size
        self.max_queue = max_queue
        self.context_length = int(loaded_model.context_length)
        self._pools = KVPools(
            layers=layer_specs,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=kv_dtype,
        )
        self._pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
        self._cache = PrefixCache(self._pool)
        self._scheduler = Scheduler(
            self._pool, self._cache, max_batch=max_batch, step_token_budget=step_token_budget
        )
        _materialize(model)
        self._runner = ModelRunner(model, self._pools)
        self._eos = frozenset(int(t) for t in loaded_model.eos_token_ids)
        #: Test hook: called on the engine thread before each step's forward pass;
        #: an exception fails that step's requests only.
        self._fault_hook: Callable[[], None] | None = None
        #: Test hook for faults tied to one request: called with (phase, sequence)
        #: at each phase ("schedule", "launch", "finalize", "update"); an
        #: exception fails that request only and the rest of the step goes on.
        self._row_fault_hook: Callable[[str, Sequence], None] | None = None

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: set[int] = set()
        self._queued = 0  # submitted, not yet admitted (the max_queue cap)
        self._closing = False
        self._ids = itertools.count(1)
        self._seqs: dict[int, Sequence] = {}  # engine thread only
        self._inflight: InFlight | None = None  # the launched, not yet finalized step
        self._counters = {"requests": 0, "completed": 0, "failed": 0, "cancelled": 0}
        self._generated_tokens = 0
        self._stats: dict[str, Any] = {}
        self._snapshot_stats()
        self._thread = threading.Thread(target=self._loop, name="mlx-cairn-engine", daemon=True)
        _live_engines.add(self)
        self._thread.start()

    # ------------------------------------------------------------ any thread

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
            self._queued += 1
            self._inbox.append(seq)
            self._lock.notify_all()
        return stream

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

    def stats(self) -> dict[str, Any]:
        """Counters for /health and /metrics (a snapshot taken after the last step).

        Keys: ``queue_depth`` (submitted, not yet admitted), ``running`` /
        ``waiting`` (admitted / queued sequences, preempted ones included),
        ``blocks_total`` (usable), ``blocks_free`` / ``blocks_in_use`` /
        ``blocks_cached`` (registered in the prefix cache, free or in use), ``block_size``,
        ``kv_cache_bytes``, ``prefix_hit_tokens``, ``preemptions``,
        ``generated_tokens``, ``requests_total`` (= ``requests_requests``),
        ``requests_completed`` / ``_failed`` / ``_cancelled``.
        """
        with self._lock:
            out = dict(self._stats)
            out["queue_depth"] = self._queued
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; unfinished requests end with an Error event."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify_all()

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            while self._serve_once():
                pass
        finally:
            # MLX needs the streams of a thread torn down before the thread
            # ends, or the process may abort at exit.
            mx.clear_streams()

    def _serve_once(self) -> bool:
        """Wait for work, apply arrivals and cancels, run one step. False once closed."""
        with self._lock:
            while not (
                self._inbox
                or self._cancels
                or self._closing
                or self._inflight is not None
                or self._scheduler.has_work()
            ):
                self._lock.wait()
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            closing = self._closing
        for seq in inbox:
            self._seqs[seq.request_id] = seq
            self._scheduler.add(seq)
            self._counters["requests"] += 1
        for rid in cancels:
            if (victim := self._seqs.get(rid)) is not None:
                self._counters["cancelled"] += 1
                self._end(victim, Error("cancelled", "the request was cancelled"))
        if closing:
            self._drain_inflight()
            for seq in list(self._seqs.values()):
                self._end(seq, Error("internal", "the engine was closed"))
            self._snapshot_stats()
            return False
        try:
            self._step()
        except Exception as e:  # a bug outside the forward pass: fail everyone, go on
            log.exception("engine step failed")
            self._drain_inflight()
            for seq in list(self._seqs.values()):
                self._counters["failed"] += 1
                self._end(seq, Error("internal", f"engine error: {e}"))
        self._snapshot_stats()
        return True

    def _step(self) -> None:
        """Launch the next step, then finalize the previous one (see runner.py)."""
        sched = self._scheduler
        plan = sched.schedule(self._row_check("schedule"))
        for seq, err in plan.failed:
            self._fail_row(seq, "scheduled", err)
        launched: InFlight | None = None
        if plan:
            now = time.perf_counter()
            for seq in plan.sequences():
                if seq.t_admit == 0.0:
                    seq.t_admit = now
                    with self._lock:
                        self._queued -= 1
                    seq.stream._push([Admitted(seq.num_prompt, max(seq.cached_tokens, 0))])
            try:
                if self._fault_hook is not None:
                    self._fault_hook()
            except Exception as e:
                log.warning("step failed for %d request(s): %s", len(plan.sequences()), e)
                for seq in plan.sequences():
                    self._counters["failed"] += 1
                    self._end(seq, Error("internal", f"generation failed: {e}"))
            else:
                launched = self._launch_isolated(plan)
        elif self._inflight is None:
            self._unstick()
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._finalize(previous)

    # -------------------------------------------------- faults, one row at a time

    def _row_check(self, phase: str) -> Callable[[Sequence], None] | None:
        hook = self._row_fault_hook
        if hook is None:
            return None
        return lambda seq: hook(phase, seq)

    def _fail_row(self, seq: Sequence, phase: str, err: BaseException) -> None:
        """End one request whose settings or state failed it; the others go on."""
        if self._seqs.get(seq.request_id) is not seq:
            return
        log.warning("request %d failed while %s: %s", seq.request_id, phase, err)
        self._counters["failed"] += 1
        self._end(seq, Error("internal", f"generation failed: {err}"))

    def _launch(self, plan: StepPlan) -> InFlight:
        check = self._row_check("launch")
        if check is not None:
            for seq in plan.sequences():
                check(seq)
        return self._runner.launch(plan)

    def _launch_isolated(self, plan: StepPlan) -> InFlight | None:
        """Launch ``plan``; if that fails, find the rows that fail it and launch the rest.

        A failed launch commits no bookkeeping (runner.launch changes sequence
        state only once nothing can fail), so each row is retried alone; the
        rows that fail alone are ended, the others were launched and their
        steps are merged into one in-flight step. Writes a failed launch left
        in the pools only touch its own rows' slots, and the retries rewrite them.
        """
        try:
            return self._launch(plan)
        except Exception as e:
            first = e
        self._recover_pools()
        rows = plan.sequences()
        if len(rows) == 1:
            self._fail_row(rows[0], "launched", first)
            return None
        parts: list[InFlight] = []
        for seq in rows:
            try:
                parts.append(self._launch(plan.only(seq)))
            except Exception as e:
                self._recover_pools()
                self._fail_row(seq, "launched", e)
        return merge_inflight(parts)

    def _read_back(self, step: InFlight) -> list[tuple[Sequence, int | BaseException]]:
        """(sequence, token) per sampling row; a row whose read fails gets its exception."""
        check = self._row_check("finalize")
        try:
            if check is not None:
                for seq in step.rows:
                    check(seq)
            return list(self._runner.finalize(step))
        except Exception as e:
            if step.sampled is None:
                raise
            first = e
        log.warning("reading a step back failed (%s); reading its rows one by one", first)
        out: list[tuple[Sequence, int | BaseException]] = []
        for i, seq in enumerate(step.rows):
            try:
                if check is not None:
                    check(seq)
                out.append((seq, int(step.sampled[i].item())))
            except Exception as e:
                out.append((seq, e))
        return out

    # ------------------------------------------------------------ applying a step

    def _finalize(self, step: InFlight) -> None:
        """Read a launched step's tokens back and turn them into Events."""
        try:
            results = self._read_back(step)
        except Exception as e:  # the device computation itself failed
            log.exception("a launched step failed")
            for seq in step.plan.sequences():
                if self._seqs.get(seq.request_id) is seq:
                    self._counters["failed"] += 1
                    self._end(seq, Error("internal", f"generation failed: {e}"))
            self._drain_inflight()
            self._recover_pools()
            return
        now = time.perf_counter()
        check = self._row_check("update")
        for seq, token in results:
            if self._seqs.get(seq.request_id) is not seq:
                continue  # ended (cancelled, failed, finished) while in flight
            if isinstance(token, BaseException):
                self._fail_row(seq, "read back", token)
                continue
            try:
                if check is not None:
                    check(seq)
                self._apply_token(seq, token, now)
            except Exception as e:  # one row's text side or bookkeeping: that row only
                self._fail_row(seq, "updated", e)

    def _apply_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.inflight.popleft()
        if seq.forced is not None:
            # Sampled after the reasoning budget ran out: replaced by the forced ids.
            if not seq.inflight:
                self._apply_forced(seq, now)
            return
        seq.tokens.append(token)
        self._scheduler.register(seq)
        self._on_token(seq, token, now)

    def _apply_forced(self, seq: Sequence, now: float) -> None:
        """Append the forced ids (the close of reasoning) as if they had been sampled.

        Tokens sampled in their place were never fed to the model (a sequence
        with forced ids is not scheduled), so nothing is rolled back but the
        count of computed tokens, which may have run ahead onto them.
        """
        forced, seq.forced = seq.forced or [], None
        seq.num_computed = min(seq.num_computed, len(seq.tokens))
        for t in forced:
            seq.tokens.append(t)
            if not self._on_token(seq, t, now):
                return
        self._scheduler.register(seq)

    def _unstick(self) -> None:
        """Nothing could run and nothing is in flight: end what can never progress.

        With the capacity check in prepare() and the rules above none of this
        should happen; if it does, the loop must not spin on it.
        """
        sched = self._scheduler
        for seq in list(sched.running):
            if seq.num_pending == 0 and seq.forced is None:
                self._fail_row(seq, "stuck", RuntimeError("the request has nothing left to run"))
        if sched.waiting and not sched.running:
            seq = sched.waiting[0]
            self._end(seq, Error("internal", "the request does not fit in the KV cache"))

    def _drain_inflight(self) -> None:
        """Wait for (and drop) a launched step."""
        step, self._inflight = self._inflight, None
        if step is not None:
            with contextlib.suppress(Exception):
                self._runner.finalize(step)
            now = time.perf_counter()
            for seq in step.rows:
                if seq.inflight:
                    # Its sampled token is lost: the last known token is fed again
                    # (its KV row is rewritten, identically), or the sequence would
                    # have nothing pending and never finish.
                    seq.inflight.clear()
                    seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
                if seq.forced is not None and self._seqs.get(seq.request_id) is seq:
                    self._apply_forced(seq, now)  # or it would never be scheduled again

    def _recover_pools(self) -> None:
        # Writes of a failed step may still be pending in the pool graphs; they
        # only touch blocks of the failed rows, so materialize them and move on.
        try:
            mx.eval(self._pools.arrays())
        except Exception:  # pragma: no cover - the graph itself is broken
            log.exception("KV pools could not be evaluated; rebuilding them")
            self._inflight = None
            for seq in list(self._seqs.values()):
                self._end(seq, Error("internal", "the KV cache was reset"))
            p = self._pools
            p.reset()
            self._pool = BlockPool(num_blocks=p.num_blocks, block_size=p.block_size)
            self._cache = PrefixCache(self._pool)
            self._scheduler.pool, self._scheduler.cache = self._pool, self._cache

    def _on_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Turn one new token into Events; False once the sequence has ended."""
        self._generated_tokens += 1
        if seq.t_first_token == 0.0:
            seq.t_first_token = now
        if seq.pipeline is None:
            seq.pipeline = SequenceOutput(self.loaded.tokenizer, seq.prepared)
            p = seq.prepared
            if p.reasoning_budget is not None:
                seq.budget = ReasoningBudget(
                    budget=p.reasoning_budget,
                    open_ids=p.reasoning_tags[0],
                    close_ids=p.reasoning_tags[1],
                    in_reasoning=p.in_reasoning,
                )
        out: SequenceOutput = seq.pipeline
        reason: StopReason | None = None
        matched: str | None = None
        try:
            if token in self._eos:
                events = out.flush()
                reason = "end_turn"
            else:
                events, matched = out.push(token)
                if matched is not None:
                    reason = "stop_sequence"
                elif seq.num_output >= seq.prepared.max_tokens:
                    events += out.flush()
                    reason = "max_tokens"
        except Exception as e:  # a text-side failure ends only this request
            log.warning("text pipeline failed: %s", e)
            self._counters["failed"] += 1
            self._end(seq, Error("internal", f"output processing failed: {e}"))
            return False
        if reason == "end_turn" and out.saw_tool_call:
            reason = "tool_use"
        if reason is None:
            seq.stream._push(events)
            if seq.budget is not None and (force := seq.budget.push(token)) is not None:
                # Close the reasoning unless max_tokens would cut the tag itself.
                if seq.num_output + len(force) < seq.prepared.max_tokens:
                    seq.forced = force
                if seq.forced is not None and not seq.inflight:
                    self._apply_forced(seq, now)
            return seq.request_id in self._seqs
        self._counters["completed"] += 1
        self._end(seq, None)
        seq.stream._push([*events, self._done(seq, reason, matched, now)])
        return False

    def _done(self, seq: Sequence, reason: StopReason, matched: str | None, now: float) -> Done:
        prompt = seq.num_prompt
        cached = max(seq.cached_tokens, 0)
        first = seq.t_first_token or now
        decode_n = seq.num_output - 1
        timings = Timings(
            queue_ms=1000 * (seq.t_admit - seq.t_submit) if seq.t_admit else 0.0,
            ttft_ms=1000 * (first - seq.t_submit),
            prefill_tokens_per_s=(prompt - cached) / (first - seq.t_admit)
            if seq.t_admit > 0 and first > seq.t_admit
            else 0.0,
            decode_tokens_per_s=decode_n / (now - first) if decode_n > 0 and now > first else 0.0,
        )
        usage = Usage(input_tokens=prompt, output_tokens=seq.num_output, cached_tokens=cached)
        return Done(stop_reason=reason, matched_stop=matched, usage=usage, timings=timings)

    def _end(self, seq: Sequence, final: Done | Error | None) -> None:
        """Remove ``seq`` from the engine (freeing its blocks) and end its stream."""
        if self._seqs.pop(seq.request_id, None) is None:
            return
        if seq.t_admit == 0.0:
            with self._lock:
                self._queued -= 1
            seq.t_admit = -1.0  # counted out of the queue
        self._scheduler.remove(seq)
        seq.stream.output_ids = seq.tokens[seq.num_prompt :]
        if final is not None:
            seq.stream._finish(final)

    def _snapshot_stats(self) -> None:
        c = self._cache.stats()
        sched = self._scheduler
        snap = {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "blocks_total": c.get("blocks_total", self._pools.num_blocks),
            "blocks_free": c.get("blocks_free"),
            "blocks_cached": c.get("blocks_cached"),
            "blocks_in_use": c.get("blocks_in_use"),
            "block_size": self.block_size,
            "kv_cache_bytes": self._pools.nbytes,
            "prefix_hit_tokens": sched.prefix_hit_tokens,
            "preemptions": sched.num_preemptions,
            "generated_tokens": self._generated_tokens,
            **{f"requests_{k}": v for k, v in self._counters.items()},
            "requests_total": self._counters["requests"],
        }
        with self._lock:
            self._stats = snap


def _materialize(model: Any) -> None:
    """Evaluate every array the model holds (parameters and private buffers such as
    RoPE frequencies) here: MLX cannot evaluate a lazy array built on another
    thread's stream, and the forward passes run on the engine thread."""
    arrays: list[mx.array] = []
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        arrays.extend(v for v in m.values() if isinstance(v, mx.array))
    mx.eval(arrays)
