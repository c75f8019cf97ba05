"""Engine statistics: one typed snapshot, read by /health and /metrics.

A field that is renamed or removed breaks its readers loudly (an attribute
error, a type check) instead of silently reading as 0.

Example::

    st = engine.stats()
    print(st.running, st.blocks_free, st.requests_completed)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot taken after the engine's last step (``queue_depth`` is live)."""

    #: Submitted, not yet admitted (the ``max_queue`` cap counts these).
    queue_depth: int = 0
    #: Admitted sequences (holding blocks).
    running: int = 0
    #: Queued sequences, preempted ones included.
    waiting: int = 0
    #: Usable KV blocks (block 0 is reserved), and how they are split.
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_in_use: int = 0
    #: Blocks registered in the prefix cache (free or in use).
    blocks_cached: int = 0
    block_size: int = 0
    kv_cache_bytes: int = 0
    #: Tokens the KV pool holds (``blocks_total * block_size``), and its width:
    #: 8 or 4 for quantized pools (``kv_bits``), 0 for full precision.
    kv_pool_tokens: int = 0
    kv_bits: int = 0
    prefix_hit_tokens: int = 0
    #: Of those, tokens copied from the leading rows of a cached block (partial-block reuse).
    partial_hit_tokens: int = 0
    #: Prompt positions computed (not taken from the cache); a prompt computed
    #: again after a preemption counts again.
    prefill_tokens: int = 0
    #: Admissions put off while another request computed their prefix (joined).
    prefix_join_waits: int = 0
    #: Steps that decoded only, their prefill held back for decoding rows
    #: (scheduler.DECODE_SHARE).
    prefill_holds: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    requests_total: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    #: Recurrent-state slots (hybrid models; all 0 otherwise): slots in all,
    #: prefix snapshots stored and their bytes, admissions that restored one
    #: and the prompt tokens those skipped.
    state_slots_total: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    state_cache_bytes: int = 0
    state_snapshot_hits: int = 0
    state_snapshot_hit_tokens: int = 0
    #: The disk tier (``kv_disk_dir``; all 0 without one; engine/disk.py DiskStats):
    #: blocks and bytes held, blocks read back for prefix hits and written on
    #: eviction, the bytes and seconds of its reads and writes (throughput = bytes
    #: / seconds), files dropped (foreign, cut short, over budget) and blocks that
    #: failed their checksum.
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_hit_blocks: int = 0
    disk_written_blocks: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    disk_dropped_files: int = 0
    disk_corrupt_blocks: int = 0
    #: Speculative decoding (all 0 when off): verify rows run, the draft tokens
    #: they scored, and those accepted (acceptance rate = accepted / draft).
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    #: KV-cache events (``kv_events``; 0 without): batches sent to the router's
    #: socket, and batches dropped because the sender fell behind.
    kv_events_batches: int = 0
    kv_events_dropped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
