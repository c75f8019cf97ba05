"""The engine's per-sequence state (engine/request.py holds the request it serves).

Token layout of a sequence (``tokens`` = prompt ids, then sampled ids whose
values are known; ``inflight`` = sampled tokens of steps still running on
the device, as lazy MLX scalars)::

    tokens + inflight:  p0 ... p(P-1) | o0 ... o(k-1) | i0 i1
    computed: [0, num_computed)            KV rows written (or being written
                                           by a step in flight)
    pending:  [num_computed, num_tokens)   fed to the model next: the rest of
                                           the prompt while prefilling, exactly
                                           one token (maybe in flight) when
                                           decoding

A preempted sequence drops its blocks and sets ``num_computed = 0``; it is
resumed later by recomputing ``tokens`` (mostly from the prefix cache, since
its full blocks were registered as they filled).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.engine.stream import RequestStream


@dataclass(eq=False, slots=True)
class Sequence:
    """Engine-thread state of one running or waiting request."""

    request_id: int
    prepared: PreparedRequest
    stream: RequestStream
    tokens: list[int]
    #: Order of first arrival; preemption picks the largest.
    arrival: int
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: Number of leading blocks already registered in the prefix cache.
    num_registered: int = 0
    #: Chained prefix-cache hashes (``mlx_cairn.kv.BlockHashes``) of the first
    #: full blocks of ``tokens``, extended block by block; None until admission.
    block_hashes: Any = None
    #: Chained hashes of every full block of ``tokens`` at admission (the lookup's):
    #: those past ``num_registered`` are blocks this sequence is about to compute,
    #: which a request sharing them waits for (``Scheduler._joins``); None while waiting.
    admit_hashes: Any = None
    #: Prompt tokens served from the prefix cache at first admission.
    cached_tokens: int = -1
    # Recurrent state (hybrid models, engine/hybrid_state.py); 0 = no slot.
    #: The sequence's live state slot and its last-block-boundary slot.
    state_slot: int = 0
    boundary_slot: int = 0
    #: Where the next step reads the state: the live slot, or at admission the
    #: prefix hit's snapshot (0: zeros, a fresh start).
    state_read: int = 0
    #: Where the prefix hit in the KV cache ended past the longest snapshot, in
    #: blocks (a snapshot point, engine/hybrid_state.py; 0: none).
    branch_blocks: int = 0
    #: The block ids of that KV hit (the blocks the prefix cache keeps for them).
    hit_ids: list[int] = field(default_factory=list)
    #: Blocks covered by the state in ``boundary_slot`` (0: none yet).
    boundary_blocks: int = 0
    #: Snapshot slot the planned chunk writes at its end (0: none).
    plan_snapshot: int = 0
    # Disk tier (engine/disk.py): the read of this prompt's blocks (a Future), the
    # number of resident blocks it continues, and whether the tier was asked.
    disk_read: Any = None
    disk_start: int = 0
    #: Blocks of the state snapshot read with them (hybrids; 0: none).
    disk_snap_blocks: int = 0
    disk_tried: bool = False
    #: Snapshots written, waiting for their blocks to join the prefix cache:
    #: (number of blocks, slot).
    pending_snapshots: list[tuple[int, int]] = field(default_factory=list)
    num_preemptions: int = 0
    #: Lazy sampled tokens of launched steps, oldest first (at most two).
    inflight: deque[Any] = field(default_factory=deque)
    #: Logits processors and their caches (mlx_cairn.engine.logits.RowProcessors),
    #: created lazily for rows that use any.
    processors: Any = None
    #: Extra per-row processors (``mlx_cairn.engine.logits.RowMask``: the grammar seam).
    row_masks: list[Any] = field(default_factory=list)
    #: Text side (mlx_cairn.engine.output.SequenceOutput), created lazily.
    pipeline: Any = None
    #: Speculative decoding (mlx_cairn.engine.speculate.RowSpec), or None.
    spec: Any = None
    #: A verify row of this sequence is in flight (its tokens are not known yet:
    #: ``num_computed`` runs ahead over its draft until the step is read back).
    verifying: bool = False
    #: Reasoning budget tracker (mlx_cairn.engine.reasoning.ReasoningBudget), or None.
    budget: Any = None
    #: Token ids that replace the sampled tokens still in flight (the forced
    #: end of reasoning); while set, the sequence is not scheduled.
    forced: list[int] | None = None
    # Timings (perf_counter seconds).
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first_token: float = 0.0

    @property
    def num_prompt(self) -> int:
        return self.prepared.num_prompt_tokens

    def hash_tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """``tokens[start:end]`` as the prefix cache hashes them: a picture's positions
        carry its digest (``Media.hash_ids``), so another picture never shares them."""
        media = self.prepared.media
        if media is None:
            return self.tokens[start:end]
        stop = len(self.tokens) if end is None else min(end, len(self.tokens))
        p = len(media.hash_ids)
        if start >= p:
            return self.tokens[start:stop]
        return media.hash_ids[start : min(stop, p)] + self.tokens[p:stop]

    @property
    def num_output(self) -> int:
        """Sampled tokens whose values are known."""
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        """Known tokens plus tokens still in flight."""
        return len(self.tokens) + len(self.inflight)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def wants_more(self) -> bool:
        """Another sampled token is allowed (counting those in flight)."""
        return self.num_tokens - self.num_prompt < self.prepared.max_tokens
