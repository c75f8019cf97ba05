"""Blocks between the KV pool and the disk tier, on the engine thread (engine/disk.py).

``save_resident`` hands every cached block (and a hybrid's state snapshots) to
the tier when the engine closes; ``load_resident`` puts the blocks a waiting
request read back from disk into fresh pool blocks and registers them in the
prefix cache, so that its admission finds them. The tier itself (files, the
writer thread, the index) is engine/disk.py; these are the engine's side.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from mlx_cairn.engine.disk import DiskTier
from mlx_cairn.engine.paged import KVPools
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.engine.sequence import Sequence

log = logging.getLogger("mlx_cairn.engine")


def save_resident(disk: DiskTier, scheduler: Scheduler, pools: KVPools) -> None:
    """At close every cached block leaves the pool: the disk tier keeps them (and a
    hybrid's state snapshots); then the tier is closed. Never raises."""
    pool, cache = scheduler.pool, scheduler.cache
    try:
        cached = [
            (b, h) for b in range(1, pool.num_blocks) if (h := cache.block_hash(b)) is not None
        ]
        if cached:
            disk.capture(cached, pools)
        if (states := scheduler.states) is not None:
            for h, snap in states.snapshots():
                disk.capture_state(h, snap.num_blocks, snap.slot, pools)
        disk.flush()
        if not disk.drain(timeout=60.0):
            log.warning("disk tier: writes still pending at close")
    except Exception:  # the tier is a cache: never fail a close on it
        log.exception("disk tier: saving the cached blocks failed")
    finally:
        disk.close()


def load_resident(seq: Sequence, disk: DiskTier, scheduler: Scheduler, pools: KVPools) -> None:
    """A waiting request's blocks (and a hybrid's state snapshot) came back from disk:
    put them in fresh pool blocks (and a state slot) and register them, so its
    admission finds them (engine thread; a failed or stale read only loses the hit)."""
    try:
        loaded = seq.disk_read.result()
    except Exception as e:
        log.warning("disk tier: a read failed: %s", e)
        return
    cache, pool_ids = scheduler.cache, scheduler.pool
    bs, p = pools.block_size, pools
    start, k = seq.disk_start, len(loaded.hashes)
    if k:
        hashes = cache.hash_blocks(seq.hash_tokens(0, (start + k) * bs), salt=seq.prepared.salt)
        hit = list(cache.lookup(hashes)) if start else []
        ids = scheduler._allocate(k) if len(hit) == start else None
        if ids is None:
            if hit:
                pool_ids.free(hit)
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
        cache.insert(hashes, hit + list(ids))
        if scheduler.events is not None:
            scheduler.publish_stored(seq, hashes, hit + list(ids), start, start + k)
        pool_ids.free(hit + list(ids))
    states = scheduler.states
    nb = seq.disk_snap_blocks
    if states is None or loaded.state is None or not nb:
        return
    hashes = cache.hash_blocks(seq.hash_tokens(0, nb * bs), salt=seq.prepared.salt)
    blocks = list(cache.lookup(seq.hash_tokens(0, nb * bs + 1), salt=seq.prepared.salt))
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
        pool_ids.free(blocks)


#: Above this many runs of consecutive ids, blocks read from disk are written with one
#: indexed assignment instead of one slice per run.
_MAX_SLICE_RUNS = 16


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
