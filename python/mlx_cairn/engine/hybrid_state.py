"""Recurrent-state slots and prefix snapshots of hybrid models (issue 15, docs/design.md §4).

Pure bookkeeping (no MLX): the arrays live in ``KVPools.state``. A model with
recurrent layers (Gated DeltaNet, Mamba, short convolutions) keeps, per
sequence, a fixed-size state that cannot be trimmed back to a shared prefix
the way KV blocks can. So the state is *snapshotted* at block boundaries and a
snapshot is stored under the chained hash of the block it ends::

    prompt   | b0 | b1 | ... | b(k-1) | b(k) ...
    snapshot:  the state after exactly the tokens of b0 .. b(k-1),
               keyed by hash(b(k-1)) (the chain hash covers the whole prefix
               and the salt), valid while block b(k-1) still carries that hash

A lookup takes the longest prefix hit whose last block has a valid snapshot;
the sequence reads its first state from the snapshot slot and prefills the
rest. Slots::

    slot 0                     zeros: what a fresh sequence reads
    2 per admitted sequence    its live state, and its last block boundary
                               (the state after its last full block: at the
                               end of a request it becomes a snapshot, so the
                               next turn that re-sends the conversation hits
                               past the answer)
    snapshots                  at most ``capacity``, least recently used evicted;
                               one whose block was evicted or reused is dropped
                               at the next trim (they never outlive their prefix)

Snapshot points of a prompt of P tokens (block size bs, in blocks): every
``interval`` blocks; the last full block before the prompt's last token,
``(P - 1) // bs`` (the longest prefix a later request can reuse: the next
turn of a conversation); the last block before the last user message (the
same history with another question); and the branch point, where the prompt's prefix hit
in the KV cache went past its longest snapshot: two prompts shared the
prefix up to there, so a third likely does (a shared system prompt and tools
with another question, a regenerated answer). Prefill chunks are cut at
these points so the state there exists.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Default snapshot points: every this many blocks of a prompt (2,048 tokens at 16).
DEFAULT_INTERVAL_BLOCKS = 128


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state after the first ``num_blocks`` blocks of a prefix, in ``slot``."""

    slot: int
    #: The block the snapshot ends with; valid while it still has the snapshot's hash.
    block_id: int
    num_blocks: int


class StateSlots:
    """Free slots and the snapshot store of one engine (engine thread only).

    Args:
        num_slots: slots in the pools, slot 0 included.
        capacity: snapshots kept at most (the rest of the slots serve sequences).
        interval: snapshot points every this many blocks of a prompt.
        slot_bytes: bytes of one slot (for stats).
    """

    def __init__(self, num_slots: int, *, capacity: int, interval: int, slot_bytes: int) -> None:
        if num_slots < 2:
            raise ValueError(f"need at least 2 state slots, got {num_slots}")
        self.num_slots = num_slots
        self.capacity = capacity
        self.interval = max(1, interval)
        self.slot_bytes = slot_bytes
        self._free = list(range(num_slots - 1, 0, -1))
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self.hits = 0
        self.hit_tokens = 0
        #: Called with (hash, snapshot) for each snapshot trimmed, before its slot is
        #: freed (the disk tier keeps it: engine/disk.py); None: they are just lost.
        self.on_drop: Callable[[int, Snapshot], None] | None = None

    # ------------------------------------------------------------- slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot > 0:
            self._free.append(slot)

    # ------------------------------------------------------------- snapshots

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def snapshot_bytes(self) -> int:
        return len(self._snapshots) * self.slot_bytes

    def has(self, block_hash: int) -> bool:
        return block_hash in self._snapshots

    def find(self, hashes: Any, hit: list[int], cache: Any) -> Snapshot | None:
        """The longest valid snapshot within the prefix hit ``hit`` (block ids whose
        chain hashes are ``hashes[:len(hit)]``), or None."""
        for k in range(len(hit), 0, -1):
            snap = self._snapshots.get(int(hashes[k - 1]))
            if snap is None:
                continue
            if snap.block_id == hit[k - 1] and cache.block_hash(snap.block_id) == int(
                hashes[k - 1]
            ):
                self._snapshots.move_to_end(int(hashes[k - 1]))
                return snap
        return None

    def add(self, block_hash: int, block_id: int, num_blocks: int, slot: int) -> None:
        """Store ``slot`` as the snapshot ending with ``block_id`` (hash ``block_hash``).

        A snapshot already stored for that prefix stays (and ``slot`` is freed).
        """
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            self.release(slot)
            return
        self._snapshots[block_hash] = Snapshot(slot, block_id, num_blocks)

    def trim(self, cache: Any, headroom: int = 0) -> None:
        """Drop snapshots whose block no longer carries their hash, then the least
        recently used ones beyond ``capacity - headroom``."""
        for h, snap in list(self._snapshots.items()):
            if cache.block_hash(snap.block_id) != h:
                del self._snapshots[h]
                self._dropped(h, snap)
        keep = max(0, self.capacity - headroom)
        while len(self._snapshots) > keep:
            h, snap = self._snapshots.popitem(last=False)
            self._dropped(h, snap)

    def _dropped(self, block_hash: int, snap: Snapshot) -> None:
        if self.on_drop is not None:
            self.on_drop(block_hash, snap)
        self.release(snap.slot)

    def snapshots(self) -> list[tuple[int, Snapshot]]:
        """Every stored snapshot, with its hash."""
        return list(self._snapshots.items())

    def drop_all(self) -> None:
        """Forget every snapshot (after a step whose writes may not have happened)."""
        for snap in self._snapshots.values():
            self.release(snap.slot)
        self._snapshots.clear()

    # ------------------------------------------------------------- policy

    def points(self, num_prompt: int, block_size: int, branch: int = 0, turn: int = 0) -> list[int]:
        """Snapshot points of a prompt, in blocks (ascending); ``branch``: where its
        prefix hit in the KV cache ended, past its longest snapshot; ``turn``: the
        last full block before its last user message (0: none)."""
        last = (num_prompt - 1) // block_size
        pts = set(range(self.interval, last, self.interval))
        pts.update(p for p in (last, branch, turn) if 0 < p <= last)
        return sorted(pts)
