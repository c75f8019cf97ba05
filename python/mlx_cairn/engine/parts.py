"""What an engine holds, sized and built from its :class:`~mlx_cairn.engine.config.EngineConfig`.

:class:`EngineParts` turns the options and the model's shapes into the KV pools
(engine/paged.py), the block pool and prefix cache (``mlx_cairn.kv``), the
scheduler, the model runner, the disk tier and a router's KV events, and keeps
the state the two threads share (the inbox, the cancels, the stats snapshot).
Sizing, per model::

    per block   = K and V of every layer (quantized with kv_bits) + a draft model's
    num_blocks  = kv_cache_gb (less a hybrid's state slots) / per block,
                  or num_blocks, or max_batch full contexts (engine/paged.py)
    state slots = 1 + 3 * max_batch + state_snapshots    (hybrids only)

The loop that runs on them is engine/core.py; the any-thread API engine/engine.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
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
from mlx_cairn.engine.model_runner import ModelRunner, StepOutput
from mlx_cairn.engine.paged import KVPools, LayerSpec, pool_blocks
from mlx_cairn.engine.paged_quant import block_bytes as quant_block_bytes
from mlx_cairn.engine.paged_quant import check_kv_quant
from mlx_cairn.engine.residency import load_resident
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.engine.update import StateUpdate
from mlx_cairn.kv import BlockPool, PrefixCache

log = logging.getLogger("mlx_cairn.engine")


class EngineParts:
    """The engine's parts and shared state, built from ``config`` for ``loaded_model``.

    Subclasses may override :meth:`_make_runner` (a distributed engine's runner
    sends each step to the other ranks).

    Raises:
        ValueError: the options do not suit the model (engine/paged.py's sizing
            refusals, ``check_kv_quant``, a draft model that cannot propose).
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
            self._scheduler.on_loaded = lambda seq: load_resident(
                seq, disk, self._scheduler, self._pools
            )
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

    def _make_runner(self, model: Any, pools: KVPools) -> ModelRunner:
        """The runner of the forward calls (a distributed engine's sends each step)."""
        return ModelRunner(model, pools)

    def _left_queue(self) -> None:
        with self._lock:
            self._queued -= 1

    @property
    def _seqs(self) -> dict[int, Sequence]:
        return self._update.seqs

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
