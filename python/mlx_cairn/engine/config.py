"""The serving engine's settings: one frozen :class:`EngineConfig`, checked when built.

Example::

    from mlx_cairn.engine import Engine, EngineConfig
    engine = Engine(loaded_model, EngineConfig(kv_cache_gb=1.0, max_batch=8))

Every option has its default here, and every check that needs only the option
itself runs here (``EngineConfig(decode_share=2)`` raises ``ValueError`` at once).
Checks that need the model (a ``kv_group_size`` that must divide its head
dimension, a KV budget its blocks must fit) run when the engine is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_cairn.engine.hybrid_state import DEFAULT_INTERVAL_BLOCKS
from mlx_cairn.types import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_NUM_SPECULATIVE,
    MAX_NUM_SPECULATIVE,
    SPECULATIVE_MODES,
)

if TYPE_CHECKING:
    import mlx.core as mx

    from mlx_cairn.engine.kv_events import KVEventPublisher

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

#: Default memory for the state snapshots of a hybrid model.
DEFAULT_SNAPSHOT_BYTES = 1 << 30
#: Default size of the disk tier (GiB, the whole directory).
DEFAULT_DISK_GB = 16.0
#: The largest ``decode_share`` (prefill always keeps a tenth of the time).
MAX_DECODE_SHARE = 0.9


@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`~mlx_cairn.engine.Engine` sizes its cache and schedules its steps.

    Attributes:
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
        kv_disk_gb: the disk tier's size (only read with ``kv_disk_dir``).
        speculative: ``"ngram"``: speculative decoding by prompt lookup
            (engine/speculate.py); greedy output is unchanged, sampled output keeps
            the model's distribution. Rows with logits processors, grammars or
            logprobs, and models with recurrent layers, decode without it.
        num_speculative_tokens: most draft tokens per step and row (default
            :data:`~mlx_cairn.types.DEFAULT_NUM_SPECULATIVE`), adapted
            per row to its acceptance.
        draft_model: a ``LoadedModel`` with the same tokenizer that proposes the
            drafts instead (engine/draft.py), on KV pools of its own that share the
            model's block tables (their memory comes out of the KV budget).
        apply_first: the order of a step's two halves. Step n+1 is always planned
            and built before step n is read back (n's tokens enter it as lazy
            placeholders). Launch first (a GPU): queue n+1, then read n back, so
            the device never idles. Apply first (default on the CPU): read n back
            and send its tokens, then queue n+1. On the CPU ``mx.async_eval``
            returns only once nearly all of a step has run, so launching first
            delivers every token one step late (bench/RESULTS.md, issue 17).
        gather_s: when the engine is idle and requests arrive while others are
            announced (``Engine.announce``: being templated and tokenized), the
            first step waits up to this long for them (and
            ``core.GATHER_SETTLE_S`` for one more after the last), so that a burst
            is prefilled in one step rather than its first request alone. Only
            engines that have had an announcement wait.
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

    Raises:
        ValueError: an option out of its range, or two that exclude each other.
    """

    kv_cache_gb: float | None = None
    num_blocks: int | None = None
    block_size: int = 16
    max_queue: int = 64
    max_batch: int | None = None
    step_token_budget: int = 512
    kv_dtype: mx.Dtype | None = None
    state_snapshots: int | None = None
    snapshot_interval: int = DEFAULT_INTERVAL_BLOCKS
    kv_disk_dir: str | os.PathLike[str] | None = None
    kv_disk_gb: float | None = None
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    # A LoadedModel (not an option as such, but what the engine is built with).
    draft_model: Any = field(default=None, repr=False, compare=False)
    apply_first: bool | None = None
    gather_s: float = DEFAULT_GATHER_S
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    decode_share: float | None = None
    kv_events: str | KVEventPublisher | None = None

    def __post_init__(self) -> None:
        share = self.decode_share
        if share is not None and not (
            isinstance(share, (int, float)) and 0 <= share <= MAX_DECODE_SHARE
        ):
            raise ValueError(
                f"decode_share must be between 0 and {MAX_DECODE_SHARE}, got {share!r}"
            )
        for name, val in (
            ("block_size", self.block_size),
            ("max_queue", self.max_queue),
            ("max_batch", 1 if self.max_batch is None else self.max_batch),
            ("step_token_budget", self.step_token_budget),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        gather = self.gather_s
        if not (isinstance(gather, (int, float)) and 0 <= gather <= 10):
            raise ValueError(f"gather_s must be between 0 and 10 seconds, got {gather!r}")
        if self.draft_model is not None and self.speculative is not None:
            raise ValueError("speculative and draft_model are two ways to speculate: pick one")
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"got {self.speculative!r}"
            )
        k = self.speculative_tokens
        if not isinstance(k, int) or not 0 <= k <= MAX_NUM_SPECULATIVE:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 0..{MAX_NUM_SPECULATIVE}, got {k!r}"
            )
        snaps = self.state_snapshots
        if snaps is not None and (not isinstance(snaps, int) or snaps < 0):
            raise ValueError(f"state_snapshots must be >= 0, got {snaps!r}")
        if self.kv_disk_dir is not None:
            gb = self.disk_gb
            if not (isinstance(gb, (int, float)) and gb > 0):
                raise ValueError(f"kv_disk_gb must be positive, got {gb!r}")

    @property
    def speculative_tokens(self) -> int:
        """``num_speculative_tokens`` with its default filled in."""
        k = self.num_speculative_tokens
        return DEFAULT_NUM_SPECULATIVE if k is None else k

    @property
    def disk_gb(self) -> float:
        """``kv_disk_gb`` with its default filled in."""
        return DEFAULT_DISK_GB if self.kv_disk_gb is None else self.kv_disk_gb
