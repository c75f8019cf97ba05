"""The engine thread: the loop that owns MLX (docs/design.md §1, §4).

:class:`EngineCore` runs on the parts engine/parts.py built: it takes arrivals
and cancels from the inbox, plans each step (engine/scheduler.py), launches it
on the model runner, applies the step before it (engine/update.py, the one
writer of request state), and turns a failure into an error for the rows it
touches, the rest of the step going on. Only construction and the any-thread
API (engine/engine.py) run elsewhere; the two sides meet at ``_lock``,
``_inbox`` and ``_cancels``::

    any thread                      engine thread (EngineCore._loop)
    Engine.submit -> _inbox ---->   _serve_once: arrivals, cancels, close
    stream.cancel -> _cancels -->     _step: schedule, launch n+1, apply n
    Engine.stats  <- _stats <----     _snapshot_stats
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from mlx_cairn.engine.hybrid_state import StateSlots
from mlx_cairn.engine.logits import masks_for
from mlx_cairn.engine.model_runner import SampledStep, StepOutput, merge_outputs, read_verified
from mlx_cairn.engine.parts import EngineParts
from mlx_cairn.engine.plan import StepPlan
from mlx_cairn.engine.residency import save_resident
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.engine.update import RowResult
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.types import Error

log = logging.getLogger("mlx_cairn.engine")

#: Once no announced request is outstanding, how long an idle engine's first step
#: waits for one more to be announced (``EngineConfig.gather_s`` bounds the whole
#: wait; 32 connections opened at once are read one after another: the first
#: request can be templated and submitted before the next is announced).
GATHER_SETTLE_S = 0.01


class EngineCore(EngineParts):
    """The engine-thread half of :class:`~mlx_cairn.engine.Engine` (see the module
    docstring); :class:`~mlx_cairn.engine.Engine` starts :meth:`_loop` on its thread."""

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
            busy = self._wait_for_work()
            if busy:
                if self._inbox and self._announces and self._idle():
                    self._gather()
                self._stalled = False
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
                closing = self._closing
        if not busy:
            self._runner.idle()
            return True
        up = self._update
        for seq in inbox:
            up.arrive(seq)
        for rid in cancels:
            up.cancel(rid)
        if closing:
            self._drain_inflight()
            up.fail_all("the engine was closed", count=False)
            if self._disk is not None:
                save_resident(self._disk, self._scheduler, self._pools)
            if (ev := self._events) is not None:
                ev.cleared()  # this engine's blocks go with it
                ev.flush()
                if self._owns_events:
                    ev.close()
            self._snapshot_stats()
            return False
        try:
            self._step()
        except Exception as e:  # a bug outside the forward pass: fail everyone, go on
            log.exception("engine step failed")
            self._drain_inflight()
            up.fail_all(f"engine error: {e}")
        if self._events is not None:
            self._events.flush()  # this step's cache changes, one batch
        self._snapshot_stats()
        return True

    def _wait_for_work(self) -> bool:
        """Wait (lock held) for an arrival, a cancel, close or a step to run; False when
        the runner's ``idle_s`` passed without one (None: wait as long as it takes)."""
        # A step that could plan nothing (and has nothing in flight) changes
        # nothing by running again: only an arrival, a cancel or close can.
        while not (
            self._inbox
            or self._cancels
            or self._closing
            or (not self._stalled and (self._inflight is not None or self._scheduler.has_work()))
        ):
            if not self._lock.wait(self._runner.idle_s):
                return False
        return True

    def _idle(self) -> bool:
        """Nothing admitted and nothing in flight (engine thread)."""
        return self._inflight is None and not self._scheduler.running

    def _gather(self) -> None:
        """Wait (lock held) until no announced request is outstanding and none more is
        announced for :data:`GATHER_SETTLE_S`, at most ``gather_s`` in all."""
        deadline = time.monotonic() + self.gather_s
        while not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._announced:
                self._lock.wait(left)
                continue
            seen = self._announces
            self._lock.wait(min(left, GATHER_SETTLE_S))
            if self._announces == seen:
                break

    def _step(self) -> None:
        """Plan and build the next step, apply the previous one (see update.py); the
        new step is queued before that apply, or after it with ``apply_first``."""
        up = self._update
        up.row_hook = self._row_fault_hook
        if self._inflight is not None and self._scheduler.wants_sync():
            # A speculating row plans from its known tokens: read the step in flight first.
            ready, self._inflight = self._inflight, None
            self._apply(ready)
        plan = self._scheduler.schedule(self._row_check("schedule"))
        for seq, err in plan.failed:
            up.fail(seq, "scheduled", err)
        if self._drafter is not None and plan.verify:
            plan = self._fill_drafts(plan)
        launched: StepOutput | None = None
        if plan:
            up.admitted(plan, time.perf_counter())
            try:
                if self._fault_hook is not None:
                    self._fault_hook()
            except Exception as e:
                log.warning("step failed for %d request(s): %s", len(plan.sequences()), e)
                for seq in plan.sequences():
                    up.failed += 1
                    up.end(seq, Error("internal", f"generation failed: {e}"))
            else:
                if copies := [r.copy for r in plan.rows if r.copy is not None]:
                    # Partial-block prefix reuse: before any forward call of the step.
                    self._runner.copy_rows(copies)
                    if self._drafter is not None:
                        self._drafter.pools.copy_rows(copies)
                if self.apply_first:
                    self._runner.hold()
                if self._inflight is None:
                    self._step_from = time.perf_counter()  # otherwise from the last apply
                launched = self._launch_isolated(plan)
                if launched is not None:
                    up.launched(launched)
        elif self._inflight is None and (reads := self._scheduler.loading()):
            # Only requests whose blocks are being read from disk wait: wait for one.
            concurrent.futures.wait(reads, timeout=0.05, return_when="FIRST_COMPLETED")
        elif self._inflight is None:
            up.unstick()
            self._stalled = self._scheduler.has_work()
            if self._stalled:
                log.warning("no request can run now; waiting for an arrival or a cancel")
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._apply(previous)
        self._runner.release()  # queue what hold() kept back (apply_first)
        if self._idle():
            self._pools.mirror = None  # no decode rows left: free its memory
        if self._disk is not None:
            self._disk.flush()
        if launched is not None and launched.deferred and self._inflight is launched:
            self._inflight = self._sample_deferred(launched)

    def _fill_drafts(self, plan: StepPlan) -> StepPlan:
        """The draft model proposes the planned verify rows' drafts (engine/draft.py);
        if it fails, those rows decode one token instead (the model's own output
        never depends on the drafts)."""
        assert self._drafter is not None
        rows = list(plan.verify)
        try:
            drafts = self._drafter.propose(rows)
        except Exception as e:
            log.warning("the draft model failed (%s); decoding without drafts this step", e)
            with contextlib.suppress(Exception):
                mx.eval(self._drafter.pools.arrays())
            plain = tuple(replace(r, n=1, draft=()) for r in rows)
            return replace(plan, decode=(*plan.decode, *plain), verify=())
        verify = tuple(replace(r, draft=d) for r, d in zip(rows, drafts, strict=True))
        return replace(plan, verify=verify)

    def _sample_deferred(self, out: StepOutput) -> StepOutput:
        """Sample the rows of ``out`` that waited for their last token (now applied).

        Rows that ended meanwhile are dropped; a row whose mask fails fails alone.
        """
        up = self._update
        vocab = int(out.deferred_logits.shape[-1])  # type: ignore[union-attr]
        keep: list[int] = []
        masks: list[list[mx.array]] = []
        hook = self._row_fault_hook
        for i, r in enumerate(out.deferred):
            if not up.live(r.seq):
                continue
            try:
                if hook is not None:
                    hook("sample", r.seq)
                masks.append(masks_for(r.seq, vocab))
                keep.append(i)
            except Exception as e:
                up.fail(r.seq, "masked", e)
        try:
            part = self._runner.sample_deferred(out, keep, masks)
        except Exception as e:
            for i in keep:
                up.fail(out.deferred[i].seq, "sampled", e)
            part = StepOutput(StepPlan(), (), None)
        up.queued(part)
        whole = merge_outputs([out, part])
        assert whole is not None
        whole.plan = out.plan
        whole.deferred, whole.deferred_logits = (), None
        return whole

    # -------------------------------------------------- faults, one row at a time

    def _row_check(self, phase: str) -> Callable[[Sequence], None] | None:
        hook = self._row_fault_hook
        if hook is None:
            return None
        return lambda seq: hook(phase, seq)

    def _execute(self, plan: StepPlan) -> StepOutput:
        hook = self._row_fault_hook
        if hook is not None:
            for r in plan.rows:
                hook("launch", r.seq)
                if r.samples:
                    hook("sample", r.seq)
        return self._runner.execute(plan)

    def _launch_isolated(self, plan: StepPlan) -> StepOutput | None:
        """Launch ``plan``; if that fails, find the rows that fail it and launch the rest.

        The runner writes no request state, so a failed launch leaves nothing
        to undo: each row is retried alone; the rows that fail alone are ended,
        the others were launched and their outputs are merged into one. Writes
        a failed launch left in the pools only touch its own rows' slots, and
        the retries rewrite them.
        """
        try:
            return self._execute(plan)
        except Exception as e:
            first = e
        self._recover_pools()
        rows = plan.sequences()
        if len(rows) == 1:
            self._update.fail(rows[0], "launched", first)
            return None
        parts: list[StepOutput] = []
        for seq in rows:
            try:
                parts.append(self._execute(plan.only(seq)))
            except Exception as e:
                self._recover_pools()
                self._update.fail(seq, "launched", e)
        return merge_outputs(parts)

    def _read_back(self, out: StepOutput) -> tuple[SampledStep, list[RowResult] | None]:
        """The step's host values; when reading it whole fails, row by row (failed rows
        get their exception)."""
        check = self._row_check("finalize")
        verify_rows = [r for rows, _, _ in out.verify for r in rows]
        try:
            if check is not None:
                for r in (*out.rows, *verify_rows):
                    check(r.seq)
            return self._runner.read(out), None
        except Exception as e:
            if out.sampled is None and not out.verify:
                raise
            first = e
        log.warning("reading a step back failed (%s); reading its rows one by one", first)
        results: list[RowResult] = []
        for i, r in enumerate(out.rows):
            try:
                if check is not None:
                    check(r.seq)
                results.append(int(out.sampled[i].item()))  # type: ignore[index, arg-type]
            except Exception as e:
                results.append(e)
        verified = read_verified(out, by_row=True)
        if check is not None:
            for j, (r, got) in enumerate(verified):
                try:
                    check(r.seq)
                except Exception as e:
                    verified[j] = (r, e if not isinstance(got, BaseException) else got)
        # Logprobs are dropped with the batched read: the rows still get their tokens.
        return SampledStep(out.plan, out.rows, [], {}, verified), results

    # ------------------------------------------------------------ applying a step

    def _apply(self, out: StepOutput) -> None:
        """Read a launched step back and apply it."""
        try:
            step, results = self._read_back(out)
        except Exception as e:  # the device computation itself failed
            log.exception("a launched step failed")
            for seq in out.plan.sequences():
                if self._update.live(seq):
                    self._update.failed += 1
                    self._update.end(seq, Error("internal", f"generation failed: {e}"))
            self._update.lost(out)
            self._drain_inflight()
            self._recover_pools()
            return
        now = time.perf_counter()
        self._scheduler.step_done(out.plan, now - self._step_from)
        self._step_from = now
        self._update.sampled(step, results)

    def _drain_inflight(self) -> None:
        """Wait for (and drop) a launched step."""
        out, self._inflight = self._inflight, None
        if out is not None:
            with contextlib.suppress(Exception):
                self._runner.read(out)
            self._update.lost(out)

    def _recover_pools(self) -> None:
        # Writes of a failed step may still be pending in the pool graphs; they
        # only touch blocks of the failed rows, so materialize them and move on.
        self._pools.mirror = None
        try:
            mx.eval(self._pools.arrays())
        except Exception:  # pragma: no cover - the graph itself is broken
            log.exception("KV pools could not be evaluated; rebuilding them")
            self._inflight = None
            for seq in list(self._seqs.values()):
                self._update.end(seq, Error("internal", "the KV cache was reset"))
            p = self._pools
            p.reset()
            self._pool = BlockPool(num_blocks=p.num_blocks, block_size=p.block_size)
            self._cache = PrefixCache(self._pool, seed=self._seed)
            self._scheduler.pool, self._scheduler.cache = self._pool, self._cache
            self._scheduler.events_cleared()
            if (st := self._scheduler.states) is not None:
                self._scheduler.states = StateSlots(
                    st.num_slots,
                    capacity=st.capacity,
                    interval=st.interval,
                    slot_bytes=st.slot_bytes,
                )
