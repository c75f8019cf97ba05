"""The engine thread's half of :class:`~mlx_cairn.engine.Engine`: the one owner of MLX.

:class:`EngineCore` builds the KV pools, the block pool, the prefix cache, the
scheduler and the model runner from an :class:`~mlx_cairn.engine.config.EngineConfig`,
and runs the loop that admits arrivals, plans and launches each step, applies
the step before it, and turns a failure into an error for the rows it touches
(docs/design.md §1, §4). Everything here runs on the engine thread except
construction; the any-thread API (``submit``, ``stats``, ``close`` ...) is
engine/engine.py, and the two meet at ``_lock``, ``_inbox`` and ``_cancels``::

    any thread                      engine thread (EngineCore._loop)
    Engine.submit -> _inbox ---->   _serve_once: arrivals, cancels, close
    stream.cancel -> _cancels -->     _step: schedule, launch n+1, apply n
    Engine.stats  <- _stats <----     _snapshot_stats
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_cairn.engine.config import (
    DEFAULT_HYBRID_MAX_BATCH,
    DEFAULT_MAX_BATCH,
    DEFAULT_SNAPSHOT_BYTES,
    EngineConfig,
)
from mlx_cairn.engine.disk import DiskTier, stable_seed
from mlx_cairn.engine.draft import DraftModel, same_vocabulary
from mlx_cairn.engine.hybrid_state import StateSlots
from mlx_cairn.engine.kv_events import KVEventPublisher
from mlx_cairn.engine.logits import masks_for
from mlx_cairn.engine.model_runner import (
    ModelRunner,
    SampledStep,
    StepOutput,
    merge_outputs,
    read_verified,
)
from mlx_cairn.engine.paged import KVPools, LayerSpec, pool_blocks
from mlx_cairn.engine.paged_quant import block_bytes as quant_block_bytes
from mlx_cairn.engine.paged_quant import check_kv_quant
from mlx_cairn.engine.residency import load_resident, save_resident
from mlx_cairn.engine.scheduler import Scheduler, StepPlan
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.engine.update import RowResult, StateUpdate
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.types import Error

log = logging.getLogger("mlx_cairn.engine")

#: Once no announced request is outstanding, how long an idle engine's first step
#: waits for one more to be announced (``EngineConfig.gather_s`` bounds the whole
#: wait; 32 connections opened at once are read one after another: the first
#: request can be templated and submitted before the next is announced).
GATHER_SETTLE_S = 0.01


class EngineCore:
    """The engine's state and its engine-thread loop (see the module docstring).

    Construction sizes and allocates everything; :class:`~mlx_cairn.engine.Engine`
    then starts ``_thread`` on :meth:`_loop`. Subclasses may override
    :meth:`_make_runner` (a distributed engine's runner sends each step).
    """

    def __init__(self, loaded_model: Any, config: EngineConfig) -> None:
        cfg = self.config = config
        self.loaded = loaded_model
        model = loaded_model.model
        block_size = cfg.block_size
        kv_bits, kv_group_size = cfg.kv_bits, cfg.kv_group_size
        kv_cache_gb = cfg.kv_cache_gb
        kv_dtype = cfg.kv_dtype
        if kv_dtype is None:
            kv_dtype = mx.float32 if mx.default_device() == mx.cpu else model.dtype
        specs = layer_specs(model)
        check_kv_quant(kv_bits, kv_group_size, specs)
        if kv_bits is None:
            per_block = KVPools.block_bytes(specs, block_size, kv_dtype.size)
        else:
            per_block = quant_block_bytes(specs, block_size, kv_bits, kv_group_size, kv_dtype.size)
        slot_bytes = KVPools.slot_bytes(specs)
        max_batch = cfg.max_batch
        if max_batch is None:
            # Recurrent state takes slots per admitted sequence: hybrids batch fewer.
            max_batch = DEFAULT_HYBRID_MAX_BATCH if slot_bytes else DEFAULT_MAX_BATCH
        draft_model = cfg.draft_model
        draft_specs = _draft_specs(loaded_model, draft_model) if draft_model is not None else []
        per_block += KVPools.block_bytes(draft_specs, block_size, kv_dtype.size)
        states: StateSlots | None = None
        if slot_bytes:
            state_snapshots = cfg.state_snapshots
            if state_snapshots is None:
                budget = DEFAULT_SNAPSHOT_BYTES
                if kv_cache_gb is not None:
                    budget = min(budget, int(kv_cache_gb * (1 << 30)) // 4)
                state_snapshots = min(256, max(4, budget // slot_bytes))
            # Slot 0 (zeros), two per sequence, the snapshots, and room for the
            # snapshots a step writes before they join the store.
            num_slots = 1 + 3 * max_batch + state_snapshots
            states = StateSlots(
                num_slots,
                capacity=state_snapshots,
                interval=cfg.snapshot_interval,
                slot_bytes=slot_bytes,
            )
            if kv_cache_gb is not None:
                kv_cache_gb = max(
                    kv_cache_gb - num_slots * slot_bytes / (1 << 30), per_block * 2 / (1 << 30)
                )
        num_blocks = pool_blocks(
            per_block,
            num_blocks=cfg.num_blocks,
            kv_cache_gb=kv_cache_gb,
            default_tokens=max_batch * int(loaded_model.context_length),
            block_size=block_size,
            context_tokens=int(loaded_model.context_length),
        )
        self.block_size = block_size
        self.max_queue = cfg.max_queue
        apply_first = cfg.apply_first
        if apply_first is None:
            apply_first = mx.default_device().type == mx.DeviceType.cpu
        #: Read step n back before queueing step n+1 (``EngineConfig.apply_first``).
        self.apply_first = bool(apply_first)
        self.gather_s = float(cfg.gather_s)
        speculates = cfg.speculative is not None or draft_model is not None
        #: Most draft tokens per row and step (0: no speculative decoding).
        self._spec_k = cfg.speculative_tokens if speculates and not slot_bytes else 0
        if speculates and slot_bytes:
            log.warning("speculative decoding is off: the model has recurrent layers")
        self.context_length = int(loaded_model.context_length)
        self._pools = KVPools(
            layers=specs,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=kv_dtype,
            num_slots=states.num_slots if states is not None else 0,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )
        log.info(
            "KV pool: %d blocks of %d tokens (%d tokens), %s",
            num_blocks,
            block_size,
            (num_blocks - 1) * block_size,
            "full precision" if kv_bits is None else f"{kv_bits}-bit, groups of {kv_group_size}",
        )
        self._pool = BlockPool(num_blocks=num_blocks, block_size=block_size)
        self._disk: DiskTier | None = None
        self._seed: int | None = None
        if cfg.kv_events is not None:
            # Routers compare hashes across restarts and replicas: seed from the model.
            self._seed = stable_seed(str(loaded_model.identity))
        if cfg.kv_disk_dir is not None:
            # Hashes must mean the same after a restart: seed the chain from the model.
            self._seed = stable_seed(str(loaded_model.identity))
            self._disk = DiskTier(
                Path(cfg.kv_disk_dir),
                budget_bytes=int(cfg.disk_gb * (1 << 30)),
                identity=str(loaded_model.identity),
                block_size=block_size,
                dtype=kv_dtype,
                layers=specs,
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
            )
        self._cache = PrefixCache(self._pool, seed=self._seed)
        self._scheduler = Scheduler(
            self._pool,
            self._cache,
            max_batch=max_batch,
            step_token_budget=cfg.step_token_budget,
            states=states,
        )
        if cfg.decode_share is not None:
            self._scheduler.decode_share = float(cfg.decode_share)
        #: KV-cache events for a router (engine/kv_events.py), and whether this engine
        #: opened the socket (and closes it) or was handed one that outlives it.
        self._events: KVEventPublisher | None = None
        self._owns_events = False
        if self._disk is not None:
            disk = self._disk
            self._scheduler.disk = disk
            self._scheduler.on_evict = lambda victims: disk.capture(victims, self._pools)
            self._scheduler.on_loaded = self._disk_loaded
            if states is not None:
                states.on_drop = lambda h, snap: disk.capture_state(
                    h, snap.num_blocks, snap.slot, self._pools
                )
        materialize(model)
        self._runner = self._make_runner(model, self._pools)
        self._drafter: DraftModel | None = None
        if draft_model is not None and self._spec_k:
            materialize(draft_model.model)
            self._drafter = DraftModel(
                draft_model,
                KVPools(
                    layers=draft_specs,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    dtype=kv_dtype,
                ),
            )
        self._eos = frozenset(int(t) for t in loaded_model.eos_token_ids)
        #: Test hook: called on the engine thread before each step's forward pass;
        #: an exception fails that step's requests only.
        self._fault_hook: Callable[[], None] | None = None
        #: Test hook for faults tied to one request: called with (phase, sequence)
        #: at each phase ("schedule", "launch", "sample", "finalize" (read back),
        #: "update", "detokenize", "push"); an exception fails that request only
        #: and the rest of the step goes on.
        self._row_fault_hook: Callable[[str, Sequence], None] | None = None

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: set[int] = set()
        self._queued = 0  # submitted, not yet admitted (the max_queue cap)
        self._announced = 0  # announced (Engine.announce), not yet submitted or given up
        self._announces = 0  # announcements ever made
        self._closing = False
        self._ids = itertools.count(1)
        # Engine thread only: the one writer of request state, and the step in flight.
        # A weak reference: a cycle would keep the model and the pools alive
        # after close() until the next garbage collection.
        left_queue = weakref.WeakMethod(self._left_queue)

        def on_left_queue() -> None:
            if (m := left_queue()) is not None:
                m()

        self._update = StateUpdate(
            self._scheduler, loaded_model.tokenizer, self._eos, on_left_queue
        )
        self._inflight: StepOutput | None = None  # launched, not read back yet
        self._step_from = 0.0  # when the step being computed started (Scheduler.step_done)
        self._stalled = False  # the last step could plan nothing: wait for an event
        # Last: a socket this engine opens is not left bound by a failed start-up.
        if isinstance(cfg.kv_events, str):
            self._events, self._owns_events = KVEventPublisher(cfg.kv_events), True
        elif cfg.kv_events is not None:
            self._events = cfg.kv_events
        if self._events is not None:
            self._scheduler.events = self._events
            self._events.cleared()  # a router may still hold a previous engine's blocks
            self._events.flush()
        self._stats = EngineStats()
        self._snapshot_stats()
        self._thread = threading.Thread(target=self._loop, name="mlx-cairn-engine", daemon=True)

    def _make_runner(self, model: Any, pools: KVPools) -> ModelRunner:
        """The runner of the forward calls (a distributed engine's sends each step)."""
        return ModelRunner(model, pools)

    def _left_queue(self) -> None:
        with self._lock:
            self._queued -= 1

    @property
    def _seqs(self) -> dict[int, Sequence]:
        return self._update.seqs

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
                self._save_resident()
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

    def _save_resident(self) -> None:
        """At close every cached block leaves the pool: the disk tier keeps them."""
        assert self._disk is not None
        save_resident(self._disk, self._scheduler, self._pools)

    def _disk_loaded(self, seq: Sequence) -> None:
        """A waiting request's blocks came back from disk: into the pool with them."""
        assert self._disk is not None
        load_resident(seq, self._disk, self._scheduler, self._pools)

    def _snapshot_stats(self) -> None:
        c = self._cache.stats()
        sched = self._scheduler
        up = self._update
        snap = EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            blocks_total=int(c["blocks_total"]),
            blocks_free=int(c["blocks_free"]),
            blocks_cached=int(c["blocks_cached"]),
            blocks_in_use=int(c["blocks_in_use"]),
            block_size=self.block_size,
            kv_cache_bytes=self._pools.nbytes,
            kv_pool_tokens=int(c["blocks_total"]) * self.block_size,
            kv_bits=self._pools.kv_bits or 0,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            partial_hit_tokens=sched.partial_hit_tokens,
            prefill_tokens=up.prefill_tokens,
            prefix_join_waits=sched.join_waits,
            prefill_holds=sched.prefill_holds,
            preemptions=sched.num_preemptions,
            generated_tokens=up.generated_tokens,
            requests_total=up.requests,
            requests_completed=up.completed,
            requests_failed=up.failed,
            requests_cancelled=up.cancelled,
            spec_verify_rows=up.verify_rows,
            spec_draft_tokens=up.draft_proposed,
            spec_accepted_tokens=up.draft_accepted,
        )
        if (ev := self._events) is not None:
            snap = replace(snap, kv_events_batches=ev.sent, kv_events_dropped=ev.dropped)
        if (d := self._disk) is not None:  # EngineStats.disk_<x> is DiskStats.<x>
            snap = replace(snap, **{f"disk_{k}": v for k, v in asdict(d.stats).items()})
        if (st := sched.states) is not None:
            snap = replace(
                snap,
                state_slots_total=st.num_slots - 1,
                state_snapshots=st.num_snapshots,
                state_snapshot_bytes=st.snapshot_bytes,
                state_cache_bytes=self._pools.state_nbytes,
                state_snapshot_hits=st.hits,
                state_snapshot_hit_tokens=st.hit_tokens,
            )
        with self._lock:
            self._stats = snap


def layer_specs(model: Any) -> list[LayerSpec]:
    """A model's per-layer KV specs (docs/design.md §4): mlx-lm models give their layers'
    shapes and windows; a uniform model gives one shape for all layers."""
    specs = getattr(model, "layer_specs", None)
    if specs:
        return list(specs)
    return [LayerSpec(model.num_kv_heads, model.head_dim, model.head_dim)] * model.num_layers


def _draft_specs(loaded: Any, draft: Any) -> list[LayerSpec]:
    """The draft model's per-layer KV specs; refuses a draft that cannot propose for
    ``loaded`` (another vocabulary, or recurrent layers)."""
    if not same_vocabulary(loaded, draft):
        raise ValueError(
            f"the draft model {draft.name} has another vocabulary than {loaded.name}: "
            "a draft model must use the same tokenizer"
        )
    specs = layer_specs(draft.model)
    if KVPools.slot_bytes(specs):
        raise ValueError(f"the draft model {draft.name} has recurrent layers: not supported")
    return list(specs)


def materialize(model: Any) -> None:
    """Evaluate every array the model holds (parameters and private buffers such as
    RoPE frequencies) here: MLX cannot evaluate a lazy array built on another
    thread's stream, and the forward passes run on the engine thread."""
    arrays: list[mx.array] = []
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        arrays.extend(v for v in m.values() if isinstance(v, mx.array))
    mx.eval(arrays)
