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
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_cairn import constrain
from mlx_cairn.constrain import GrammarMask
from mlx_cairn.engine import prepare as _prep
from mlx_cairn.engine.disk import DiskTier, stable_seed
from mlx_cairn.engine.draft import DraftModel, same_vocabulary
from mlx_cairn.engine.hybrid_state import DEFAULT_INTERVAL_BLOCKS, StateSlots
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
from mlx_cairn.engine.paged_quant import DEFAULT_KV_GROUP_SIZE, check_kv_quant
from mlx_cairn.engine.paged_quant import block_bytes as quant_block_bytes
from mlx_cairn.engine.scheduler import Scheduler, StepPlan
from mlx_cairn.engine.sequence import PreparedRequest, Sequence
from mlx_cairn.engine.speculate import RowSpec
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.engine.stream import RequestStream
from mlx_cairn.engine.update import RowResult, StateUpdate
from mlx_cairn.errors import EngineError, QueueFull
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.types import (
    DEFAULT_NUM_SPECULATIVE,
    MAX_NUM_SPECULATIVE,
    SPECULATIVE_MODES,
    ChatRequest,
    Error,
    Event,
)

log = logging.getLogger("mlx_cairn.engine")

#: Sequences decoding at once by default. Decode reads the weights once per step
#: whatever the batch, so more rows cost little (bench/bench_http.py at 32 streams).
DEFAULT_MAX_BATCH = 32
#: The default for models with recurrent layers (three state slots per sequence).
DEFAULT_HYBRID_MAX_BATCH = 16

#: How long an idle engine's first step waits at most for announced requests
#: (:meth:`Engine.announce`). The HTTP server announces each generation request
#: before templating it; a burst of 16 reached the engine over ~40 ms here, while
#: a prefill step for its first request alone takes 150-250 ms.
DEFAULT_GATHER_S = 0.05
#: ... and, once none is outstanding, how long it waits for one more to be
#: announced (32 connections opened at once are read one after another: the
#: first request can be templated and submitted before the next is announced).
GATHER_SETTLE_S = 0.01

#: Default memory for the state snapshots of a hybrid model.
DEFAULT_SNAPSHOT_BYTES = 1 << 30
#: Default size of the disk tier (GiB, the whole directory).
DEFAULT_DISK_GB = 16.0

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
        max_batch: sequences admitted (holding blocks) at once (default
            :data:`DEFAULT_MAX_BATCH`, :data:`DEFAULT_HYBRID_MAX_BATCH` for a model
            with recurrent layers, whose state slots grow with it).
        step_token_budget: tokens per step: one per decoding sequence, the rest
            goes to chunked prefill (a prompt's last sliver, at most an eighth of
            the budget, goes with its chunk).
        kv_dtype: pool dtype; default fp32 on CPU, the model's dtype otherwise.
        state_snapshots: models with recurrent layers (hybrids): prefix snapshots
            of their state kept at most (engine/hybrid_state.py). Default: what
            :data:`DEFAULT_SNAPSHOT_BYTES` holds (at least 4, at most 256); with
            ``kv_cache_gb`` the snapshots' memory is taken from that budget.
        snapshot_interval: snapshot points every this many blocks of a prompt.
        kv_disk_dir: a directory for the disk tier under the pool (engine/disk.py):
            evicted blocks are kept there, across restarts, up to ``kv_disk_gb``
            GiB for the whole directory (default :data:`DEFAULT_DISK_GB`). Not used
            for models with recurrent layers.
        speculative: ``"ngram"``: speculative decoding by prompt lookup
            (engine/speculate.py); greedy output is unchanged, sampled output keeps
            the model's distribution. Rows with logits processors, grammars or
            logprobs, and models with recurrent layers, decode without it.
        draft_model: a ``LoadedModel`` with the same tokenizer that proposes the
            drafts instead (engine/draft.py), on KV pools of its own that share the
            model's block tables (their memory comes out of the KV budget).
        num_speculative_tokens: most draft tokens per step and row (default
            :data:`~mlx_cairn.types.DEFAULT_NUM_SPECULATIVE`), adapted
            per row to its acceptance.
        apply_first: the order of a step's two halves. Step n+1 is always planned
            and built before step n is read back (n's tokens enter it as lazy
            placeholders). Launch first (a GPU): queue n+1, then read n back, so
            the device never idles. Apply first (default on the CPU): read n back
            and send its tokens, then queue n+1. On the CPU ``mx.async_eval``
            returns only once nearly all of a step has run, so launching first
            delivers every token one step late (bench/RESULTS.md, issue 17).
        gather_s: when the engine is idle and requests arrive while others are
            announced (:meth:`announce`: being templated and tokenized), the
            first step waits up to this long for them (and :data:`GATHER_SETTLE_S`
            for one more after the last), so that a burst is prefilled in one
            step rather than its first request alone. Only engines that have
            had an announcement wait.
        kv_bits: 8 or 4 to store K and V quantized along the head dimension
            (engine/paged_quant.py, as mlx-lm's ``QuantizedKVCache``); the
            budget then holds ~2x / ~3.5x the tokens. None: full precision.
            Recurrent state and a draft model's pools stay full precision; the
            disk tier stores the quantized blocks as they are (a tier written at
            other settings is not read).
        kv_group_size: values per scale/bias group (32, 64 or 128; must divide
            every layer's head dimension).
        decode_share: the least share of the engine's time decoding streams get
            while other requests prefill (0 to 0.9; default
            ``scheduler.DECODE_SHARE``; 0 mixes every prefill chunk into the
            decode steps, the most prefill throughput).
        kv_events: publish the prefix cache's changes for a cache-aware router
            (engine/kv_events.py): a ZMQ bind address (``tcp://HOST:PORT``; the
            engine opens the socket and closes it) or a ``KVEventPublisher`` that
            outlives the engine. Block hashes are then seeded from the model, as
            with ``kv_disk_dir``.
    """

    def __init__(
        self,
        loaded_model: Any,
        *,
        kv_cache_gb: float | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_queue: int = 64,
        max_batch: int | None = None,
        step_token_budget: int = 512,
        kv_dtype: mx.Dtype | None = None,
        state_snapshots: int | None = None,
        snapshot_interval: int = DEFAULT_INTERVAL_BLOCKS,
        kv_disk_dir: str | os.PathLike[str] | None = None,
        kv_disk_gb: float | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        draft_model: Any = None,
        apply_first: bool | None = None,
        gather_s: float = DEFAULT_GATHER_S,
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        decode_share: float | None = None,
        kv_events: str | KVEventPublisher | None = None,
    ) -> None:
        if decode_share is not None and not (
            isinstance(decode_share, (int, float)) and 0 <= decode_share <= 0.9
        ):
            raise ValueError(f"decode_share must be between 0 and 0.9, got {decode_share!r}")
        for name, val in (
            ("block_size", block_size),
            ("max_queue", max_queue),
            ("max_batch", 1 if max_batch is None else max_batch),
            ("step_token_budget", step_token_budget),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if not (isinstance(gather_s, (int, float)) and 0 <= gather_s <= 10):
            raise ValueError(f"gather_s must be between 0 and 10 seconds, got {gather_s!r}")
        if draft_model is not None and speculative is not None:
            raise ValueError("speculative and draft_model are two ways to speculate: pick one")
        if speculative is not None and speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}"
            )
        if num_speculative_tokens is None:
            num_speculative_tokens = DEFAULT_NUM_SPECULATIVE
        if (
            not isinstance(num_speculative_tokens, int)
            or not 0 <= num_speculative_tokens <= MAX_NUM_SPECULATIVE
        ):
            raise ValueError(
                f"num_speculative_tokens must be an integer in 0..{MAX_NUM_SPECULATIVE}, "
                f"got {num_speculative_tokens!r}"
            )
        self.loaded = loaded_model
        model = loaded_model.model
        if kv_dtype is None:
            kv_dtype = mx.float32 if mx.default_device() == mx.cpu else model.dtype
        layer_specs = _layer_specs(model)
        check_kv_quant(kv_bits, kv_group_size, layer_specs)
        if kv_bits is None:
            per_block = KVPools.block_bytes(layer_specs, block_size, kv_dtype.size)
        else:
            per_block = quant_block_bytes(
                layer_specs, block_size, kv_bits, kv_group_size, kv_dtype.size
            )
        slot_bytes = KVPools.slot_bytes(layer_specs)
        if max_batch is None:
            # Recurrent state takes slots per admitted sequence: hybrids batch fewer.
            max_batch = DEFAULT_HYBRID_MAX_BATCH if slot_bytes else DEFAULT_MAX_BATCH
        draft_specs = _draft_specs(loaded_model, draft_model) if draft_model is not None else []
        per_block += KVPools.block_bytes(draft_specs, block_size, kv_dtype.size)
        states: StateSlots | None = None
        if slot_bytes:
            if state_snapshots is None:
                budget = DEFAULT_SNAPSHOT_BYTES
                if kv_cache_gb is not None:
                    budget = min(budget, int(kv_cache_gb * (1 << 30)) // 4)
                state_snapshots = min(256, max(4, budget // slot_bytes))
            if not isinstance(state_snapshots, int) or state_snapshots < 0:
                raise ValueError(f"state_snapshots must be >= 0, got {state_snapshots!r}")
            # Slot 0 (zeros), two per sequence, the snapshots, and room for the
            # snapshots a step writes before they join the store.
            num_slots = 1 + 3 * max_batch + state_snapshots
            states = StateSlots(
                num_slots,
                capacity=state_snapshots,
                interval=snapshot_interval,
                slot_bytes=slot_bytes,
            )
            if kv_cache_gb is not None:
                kv_cache_gb = max(
                    kv_cache_gb - num_slots * slot_bytes / (1 << 30), per_block * 2 / (1 << 30)
                )
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
        if apply_first is None:
            apply_first = mx.default_device().type == mx.DeviceType.cpu
        #: Read step n back before queueing step n+1 (see ``apply_first`` above).
        self.apply_first = bool(apply_first)
        self.gather_s = float(gather_s)
        speculates = speculative is not None or draft_model is not None
        #: Most draft tokens per row and step (0: no speculative decoding).
        self._spec_k = num_speculative_tokens if speculates and not slot_bytes else 0
        if speculates and slot_bytes:
            log.warning("speculative decoding is off: the model has recurrent layers")
        self.context_length = int(loaded_model.context_length)
        self._pools = KVPools(
            layers=layer_specs,
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
        if kv_events is not None:
            # Routers compare hashes across restarts and replicas: seed from the model.
            self._seed = stable_seed(str(loaded_model.identity))
        if kv_disk_dir is not None:
            if kv_disk_gb is None:
                kv_disk_gb = DEFAULT_DISK_GB
            if not (isinstance(kv_disk_gb, (int, float)) and kv_disk_gb > 0):
                raise ValueError(f"kv_disk_gb must be positive, got {kv_disk_gb!r}")
            # Hashes must mean the same after a restart: seed the chain from the model.
            self._seed = stable_seed(str(loaded_model.identity))
            self._disk = DiskTier(
                Path(kv_disk_dir),
                budget_bytes=int(kv_disk_gb * (1 << 30)),
                identity=str(loaded_model.identity),
                block_size=block_size,
                dtype=kv_dtype,
                layers=layer_specs,
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
            )
        self._cache = PrefixCache(self._pool, seed=self._seed)
        self._scheduler = Scheduler(
            self._pool,
            self._cache,
            max_batch=max_batch,
            step_token_budget=step_token_budget,
            states=states,
        )
        if decode_share is not None:
            self._scheduler.decode_share = float(decode_share)
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
        _materialize(model)
        self._runner = self._make_runner(model, self._pools)
        self._drafter: DraftModel | None = None
        if draft_model is not None and self._spec_k:
            _materialize(draft_model.model)
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
        if isinstance(kv_events, str):
            self._events, self._owns_events = KVEventPublisher(kv_events), True
        elif kv_events is not None:
            self._events = kv_events
        if self._events is not None:
            self._scheduler.events = self._events
            self._events.cleared()  # a router may still hold a previous engine's blocks
            self._events.flush()
        self._stats = EngineStats()
        self._snapshot_stats()
        self._thread = threading.Thread(target=self._loop, name="mlx-cairn-engine", daemon=True)
        _live_engines.add(self)
        self._thread.start()

    def _make_runner(self, model: Any, pools: KVPools) -> ModelRunner:
        """The runner of the forward calls (a distributed engine's sends each step)."""
        return ModelRunner(model, pools)

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
        disk = self._disk
        assert disk is not None
        try:
            cached = [
                (b, h)
                for b in range(1, self._pool.num_blocks)
                if (h := self._cache.block_hash(b)) is not None
            ]
            if cached:
                disk.capture(cached, self._pools)
            if (states := self._scheduler.states) is not None:
                for h, snap in states.snapshots():
                    disk.capture_state(h, snap.num_blocks, snap.slot, self._pools)
            disk.flush()
            if not disk.drain(timeout=60.0):
                log.warning("disk tier: writes still pending at close")
        except Exception:  # the tier is a cache: never fail a close on it
            log.exception("disk tier: saving the cached blocks failed")
        finally:
            disk.close()

    def _disk_loaded(self, seq: Sequence) -> None:
        """A waiting request's blocks (and a hybrid's state snapshot) came back from disk:
        put them in fresh pool blocks (and a state slot) and register them, so its
        admission finds them (engine thread; a failed or stale read only loses the hit)."""
        try:
            loaded = seq.disk_read.result()
        except Exception as e:
            log.warning("disk tier: a read failed: %s", e)
            return
        disk = self._disk
        assert disk is not None
        bs, p = self.block_size, self._pools
        start, k = seq.disk_start, len(loaded.hashes)
        if k:
            hashes = self._cache.hash_blocks(
                seq.hash_tokens(0, (start + k) * bs), salt=seq.prepared.salt
            )
            hit = list(self._cache.lookup(hashes)) if start else []
            ids = self._scheduler._allocate(k) if len(hit) == start else None
            if ids is None:
                if hit:
                    self._pool.free(hit)
                return
            # Runs of consecutive block ids are written as slices: on this CPU an
            # indexed write of 105 MiB takes ~10x as long as slice writes of the same rows.
            runs = _id_runs(list(ids))
            where = mx.array(ids, dtype=mx.int32) if len(runs) > _MAX_SLICE_RUNS else None
            # Every pool array (a quantized pool's packed words, scales and biases
            # alike) in the order of the file's parts.
            for pool, host in zip(disk.pool_arrays(p), loaded.arrays, strict=True):
                arr = mx.array(host)
                if pool.dtype == mx.bfloat16:
                    arr = arr.view(mx.bfloat16)
                arr = arr.transpose(2, 0, 1, 3)  # file [n, bs, kvh, w] -> pool's [kvh, n, bs, w]
                if where is not None:
                    pool[:, where] = arr
                    continue
                for at, first, n in runs:
                    pool[:, first : first + n] = arr[:, at : at + n]
            self._cache.insert(hashes, hit + list(ids))
            if self._events is not None:
                self._scheduler.publish_stored(seq, hashes, hit + list(ids), start, start + k)
            self._pool.free(hit + list(ids))
        states = self._scheduler.states
        nb = seq.disk_snap_blocks
        if states is None or loaded.state is None or not nb:
            return
        hashes = self._cache.hash_blocks(seq.hash_tokens(0, nb * bs), salt=seq.prepared.salt)
        blocks = list(self._cache.lookup(seq.hash_tokens(0, nb * bs + 1), salt=seq.prepared.salt))
        slot = states.allocate() if len(blocks) >= nb else None
        if slot is not None:
            for (layer, entry, _, _), host in zip(disk.state_entries, loaded.state, strict=True):
                arrs = p.state[layer]
                assert arrs is not None
                arr = mx.array(host)
                bf16 = arrs[entry].dtype == mx.bfloat16
                arrs[entry][slot] = arr.view(mx.bfloat16) if bf16 else arr
            states.add(int(hashes[nb - 1]), blocks[nb - 1], nb, slot)
        if blocks:
            self._pool.free(blocks)

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


#: Above this many runs of consecutive ids, blocks read from disk are written with one
#: indexed assignment instead of one slice per run.
_MAX_SLICE_RUNS = 16


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


def _id_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``ids`` as runs of consecutive values: (index in ``ids``, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _layer_specs(model: Any) -> list[LayerSpec]:
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
    specs = _layer_specs(draft.model)
    if KVPools.slot_bytes(specs):
        raise ValueError(f"the draft model {draft.name} has recurrent layers: not supported")
    return list(specs)


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


def _materialize(model: Any) -> None:
    """Evaluate every array the model holds (parameters and private buffers such as
    RoPE frequencies) here: MLX cannot evaluate a lazy array built on another
    thread's stream, and the forward passes run on the engine thread."""
    arrays: list[mx.array] = []
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        arrays.extend(v for v in m.values() if isinstance(v, mx.array))
    mx.eval(arrays)
