"""The disk tier under the block pool (engine/disk.py): restarts, outgrowing memory, faults.

A tiny random llama keeps its cached blocks in a tier on disk. An engine
closed and a new one opened on the same directory (a restart) hits the same
prefix from disk; a pool far smaller than the working set hits on the second
round from disk; corrupted, truncated, foreign and half-written files are
clean misses. Every output equals the engine without a disk tier.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.disk import SUFFIX
from mlx_cairn.testing.engine_checks import closing_at_rest, generate_from_ids, greedy_base
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import Done

TIMEOUT = 60.0
BS = 4
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=2)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(3, 300, size=n)]


def generate(engine: Engine, prompt: list[int]) -> tuple[list[int], Done]:
    return generate_from_ids(engine, prompt, max_tokens=MAX_TOKENS, timeout=TIMEOUT)


def cold(lm, prompt: list[int]) -> list[int]:
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=128, block_size=BS))) as e:
        return generate(e, prompt)[0]


def disk_engine(lm, tmp: Path, num_blocks: int = 96, gb: float = 1.0) -> Engine:
    return Engine(
        lm, EngineConfig(num_blocks=num_blocks, block_size=BS, kv_disk_dir=tmp, kv_disk_gb=gb)
    )


def files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"*/*{SUFFIX}"))


def test_a_restart_hits_the_prefix_from_disk(lm, tmp_path):
    rng = np.random.default_rng(1)
    system = ids(rng, 101)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        generate(e, system + ids(rng, 7))
    assert files(tmp_path), "the cached blocks were not kept at close"
    again = system + ids(rng, 9)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:  # a new process would do the same
        out, done = generate(e, again)
        st = e.stats()
    assert done.usage.cached_tokens >= 0.95 * len(system), done.usage
    assert st.disk_hit_blocks >= len(system) // BS and st.disk_read_bytes > 0
    assert out == cold(lm, again)


def test_a_working_set_larger_than_the_pool_hits_from_disk(lm, tmp_path):
    """50 distinct prefixes cycled twice through a pool that holds a few of them."""
    rng = np.random.default_rng(2)
    prefixes = [ids(rng, 40) for _ in range(50)]
    with closing_at_rest(disk_engine(lm, tmp_path, num_blocks=48)) as e:
        for p in prefixes:
            generate(e, p + ids(rng, 3))
        e._disk.drain()
        hit = total = 0
        outs = []
        for p in prefixes:
            prompt = p + ids(rng, 3)
            out, done = generate(e, prompt)
            hit += done.usage.cached_tokens
            total += len(p)
            outs.append((prompt, out))
        assert e.stats().disk_written_blocks > 0
    assert hit >= 0.9 * total, (hit, total)
    for prompt, out in outs[:5]:
        assert out == cold(lm, prompt)


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "byte":
        data[-5] ^= 0xFF  # inside the last block's payload
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "header":
        path.write_bytes(b"garbage" + bytes(data[7:]))


@pytest.mark.parametrize("how", ["byte", "truncate", "header"])
def test_a_damaged_file_is_a_clean_miss(lm, tmp_path, how):
    rng = np.random.default_rng(3)
    system = ids(rng, 61)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        generate(e, system + ids(rng, 5))
    for f in files(tmp_path):
        corrupt(f, how)
    again = system + ids(rng, 6)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        out, done = generate(e, again)
        st = e.stats()
    assert out == cold(lm, again)
    if how != "byte":  # a bad header or length is refused at start-up, and removed
        assert done.usage.cached_tokens == 0 and st.disk_hit_blocks == 0
    assert st.disk_read_bytes >= 0


def test_files_of_another_model_and_half_writes_are_ignored(lm, tmp_path):
    rng = np.random.default_rng(4)
    system = ids(rng, 61)
    other = tiny_model("llama", seed=9)  # another identity: another key
    with closing_at_rest(disk_engine(other, tmp_path)) as e:
        generate(e, system + ids(rng, 5))
    theirs = files(tmp_path)
    assert theirs
    # A file of theirs moved into our directory, and a write killed halfway.
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        ours = e._disk.dir
    (ours / theirs[0].name).write_bytes(theirs[0].read_bytes())
    (ours / ("123" + SUFFIX + ".tmp")).write_bytes(b"half a file")
    again = system + ids(rng, 6)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        out, done = generate(e, again)
    assert done.usage.cached_tokens == 0
    assert out == cold(lm, again)
    assert not list(ours.glob("*.tmp")) and not (ours / theirs[0].name).exists()


def test_the_budget_holds(lm, tmp_path):
    rng = np.random.default_rng(5)
    budget = 0.0004  # GiB: a few files
    with closing_at_rest(disk_engine(lm, tmp_path, num_blocks=32, gb=budget)) as e:
        for _ in range(20):
            generate(e, ids(rng, 40))
        e._disk.drain()
    total = sum(f.stat().st_size for f in files(tmp_path))
    assert 0 < total <= budget * (1 << 30)


def test_a_hybrid_restart_restores_its_state_snapshot_from_disk(tmp_path):
    """Hybrids keep their state snapshots in the same tier: after a restart the
    prefix hits (KV blocks and the state after them) and equals mlx-lm cold."""
    from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_zoo_model

    hybrid = tiny_zoo_model("qwen3_5", seed=1)
    rng = np.random.default_rng(6)
    p = ids(rng, 61)
    with closing_at_rest(disk_engine(hybrid, tmp_path)) as e:
        generate(e, p)
    assert list(tmp_path.glob("*/*.kvs")), "no state snapshot was kept"
    again = p + ids(rng, 6)
    with closing_at_rest(disk_engine(hybrid, tmp_path)) as e:
        out, done = generate(e, again)
        st = e.stats()
    assert done.usage.cached_tokens >= 0.9 * len(p), done.usage
    assert st.state_snapshot_hits >= 1 and st.disk_hit_blocks > 0
    assert out == mlx_lm_greedy(hybrid.model.inner, again, MAX_TOKENS, set(hybrid.eos_token_ids))


def test_a_hybrid_pool_smaller_than_its_working_set_hits_from_disk(tmp_path):
    from mlx_cairn.testing.tiny_models import tiny_zoo_model

    hybrid = tiny_zoo_model("qwen3_5", seed=1)
    rng = np.random.default_rng(7)
    prefixes = [ids(rng, 41) for _ in range(12)]
    engine = Engine(
        hybrid, EngineConfig(num_blocks=48, block_size=BS, kv_disk_dir=tmp_path, state_snapshots=4)
    )
    with closing_at_rest(engine) as e:
        for q in prefixes:
            generate(e, q)
        e._disk.drain()
        hit = 0
        for q in prefixes:
            hit += generate(e, q + ids(rng, 3))[1].usage.cached_tokens
    assert hit >= 0.9 * sum(len(q) for q in prefixes) * (40 / 41), hit


def test_a_request_reading_from_disk_holds_no_one_up(lm, tmp_path, monkeypatch):
    """While one request's blocks are being read (slowly here), another request is
    admitted, decodes and finishes first; then the first one hits from disk."""
    import threading

    from mlx_cairn.engine.disk import DiskTier

    rng = np.random.default_rng(8)
    system = ids(rng, 81)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        generate(e, system + ids(rng, 5))
    release = threading.Event()
    real = DiskTier._read

    def slow(self, hashes):
        release.wait(30)
        return real(self, hashes)

    monkeypatch.setattr(DiskTier, "_read", slow)
    with closing_at_rest(disk_engine(lm, tmp_path)) as e:
        base = greedy_base(e, MAX_TOKENS)
        waiting = e.submit(dataclasses.replace(base, prompt_ids=system + ids(rng, 4)))
        other = e.submit(dataclasses.replace(base, prompt_ids=ids(rng, 30)))
        done_other = list(other.iter_sync(timeout=TIMEOUT))[-1]
        assert isinstance(done_other, Done)
        # (The engine thread only reads it: the read is still held back.)
        assert [s.request_id for s in e._scheduler.waiting if s.disk_read is not None] == [
            waiting.request_id
        ]
        release.set()
        done_waiting = list(waiting.iter_sync(timeout=TIMEOUT))[-1]
    assert isinstance(done_waiting, Done)
    assert done_waiting.usage.cached_tokens >= 0.95 * len(system)


# ---------------------------------------------------------------- the tier alone


def tier_and_pools(tmp: Path, dtype, block_size: int, heads: int, dim: int, num_blocks: int = 160):
    """A DiskTier over three KV layers (one with other dims) and pools of random rows."""
    import mlx.core as mx

    from mlx_cairn.engine.disk import DiskTier
    from mlx_cairn.models.base import LayerSpec

    layers = [LayerSpec(heads, dim, dim), LayerSpec(0, 0, 0), LayerSpec(heads, dim, 2 * dim)]
    tier = DiskTier(
        tmp, budget_bytes=1 << 30, identity="t", block_size=block_size, dtype=dtype, layers=layers
    )
    pools = dataclasses.make_dataclass("Pools", ["k", "v"])(
        k=[
            mx.random.normal((heads, num_blocks, block_size, s.k_dim)).astype(dtype) for s in layers
        ],
        v=[
            mx.random.normal((heads, num_blocks, block_size, s.v_dim)).astype(dtype) for s in layers
        ],
    )
    return tier, pools


def host(a) -> np.ndarray:
    import mlx.core as mx

    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def file_rows(pool, lo: int, hi: int) -> np.ndarray:
    """Blocks ``lo .. hi-1`` of a head-major pool as the tier stores them: [n, bs, kvh, d]."""
    return host(pool)[:, lo:hi].transpose(1, 2, 0, 3)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("float32", (16, 2, 64)), ("bfloat16", (16, 2, 64)), ("float16", (4, 1, 6))],
    ids=["fp32-direct", "bf16-direct", "fp16-unaligned"],
)
def test_reads_across_files_and_from_inside_a_file_give_the_blocks_back(tmp_path, dtype, shape):
    """Blocks written as several files (64 blocks each) read back exactly, whole
    files and runs that start and end inside one, direct where the shapes allow."""
    import mlx.core as mx

    from mlx_cairn.engine.disk import FILE_BLOCKS, O_DIRECT

    tier, pools = tier_and_pools(tmp_path, getattr(mx, dtype), *shape)
    try:
        # Direct reads need parts of whole sectors: 48-byte parts go through the page cache.
        assert tier._direct == (bool(O_DIRECT) and dtype != "float16")
        n = FILE_BLOCKS * 2 + 10
        tier.capture([(b, 1000 + b) for b in range(n)], pools)
        tier.flush()
        assert tier.drain()
        assert len(files(tmp_path)) == 3
        for lo, hi in [(0, n), (5, 70), (64, 128), (130, n), (3, 4)]:
            got = tier.read([1000 + b for b in range(lo, hi)]).result()
            assert got.hashes == [1000 + b for b in range(lo, hi)]
            for j, layer in enumerate(tier.kv_layers):
                np.testing.assert_array_equal(got.arrays[2 * j], file_rows(pools.k[layer], lo, hi))
                np.testing.assert_array_equal(
                    got.arrays[2 * j + 1], file_rows(pools.v[layer], lo, hi)
                )
        assert tier.stats.corrupt_blocks == 0
    finally:
        tier.close()


def test_a_file_system_without_direct_reads_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    import errno

    import mlx.core as mx

    from mlx_cairn.engine.disk import DiskTier

    tier, pools = tier_and_pools(tmp_path, mx.float32, 16, 2, 64)
    try:
        assert tier._direct
        tier.capture([(b, 7 + b) for b in range(20)], pools)
        tier.flush()
        assert tier.drain()
        real = DiskTier._preadv
        calls = []

        def refuses_direct(self, fd, *args):
            calls.append(self._direct)
            if self._direct:
                raise OSError(errno.EINVAL, "no direct reads here")
            return real(self, fd, *args)

        monkeypatch.setattr(DiskTier, "_preadv", refuses_direct)
        got = tier.read([7 + b for b in range(20)]).result()
        assert len(got.hashes) == 20 and calls == [True, False] and not tier._direct
        np.testing.assert_array_equal(got.arrays[0], file_rows(pools.k[0], 0, 20))
    finally:
        tier.close()


def test_a_file_of_the_previous_format_is_a_clean_miss(tmp_path):
    """Format 1 (block-major) files: removed at start-up, nothing read from them."""
    import json
    import struct

    import mlx.core as mx

    from mlx_cairn.engine.disk import MAGIC

    tier, pools = tier_and_pools(tmp_path, mx.float32, 16, 2, 64)
    tier.capture([(b, 50 + b) for b in range(8)], pools)
    tier.flush()
    assert tier.drain()
    tier.close()
    (path,) = files(tmp_path)
    data = path.read_bytes()
    (n,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    header["format"] = 1
    raw = json.dumps(header).encode().ljust(n)
    path.write_bytes(data[: len(MAGIC) + 4] + raw + data[len(MAGIC) + 4 + n :])
    tier, _ = tier_and_pools(tmp_path, mx.float32, 16, 2, 64)
    try:
        assert tier.run_length([50 + b for b in range(8)], 0, 8) == 0
        assert tier.stats.dropped_files == 1 and not path.exists()
    finally:
        tier.close()


@pytest.mark.parametrize("preadv", [True, False], ids=["preadv", "seek-readv"])
def test_a_read_in_several_vectored_pieces_gives_the_blocks_back(tmp_path, monkeypatch, preadv):
    import os

    import mlx.core as mx

    from mlx_cairn.engine import disk

    monkeypatch.setattr(disk, "IOV_MAX", 3)  # 6 parts: two vectored reads per file
    if not preadv:
        monkeypatch.delattr(os, "preadv", raising=False)
    tier, pools = tier_and_pools(tmp_path, mx.float32, 16, 2, 64)
    try:
        tier.capture([(b, 9 + b) for b in range(70)], pools)
        tier.flush()
        assert tier.drain()
        for lo, hi in [(0, 70), (10, 20)]:
            got = tier.read([9 + b for b in range(lo, hi)]).result()
            assert len(got.hashes) == hi - lo
            for j, layer in enumerate(tier.kv_layers):
                np.testing.assert_array_equal(
                    got.arrays[2 * j + 1], file_rows(pools.v[layer], lo, hi)
                )
    finally:
        tier.close()


def quant_tier_and_pools(tmp: Path, bits: int | None, group: int = 32, num_blocks: int = 80):
    """A DiskTier of 8/4-bit (or full precision) KV over two layers of other shapes, and
    pools of quantized random rows (packed words, scales, biases) in the engine's layout."""
    import mlx.core as mx

    from mlx_cairn.engine.disk import DiskTier
    from mlx_cairn.engine.paged import KVPools
    from mlx_cairn.models.base import LayerSpec

    layers = [LayerSpec(2, 64, 64), LayerSpec(0, 0, 0), LayerSpec(1, 64, 128)]
    tier = DiskTier(
        tmp,
        budget_bytes=1 << 30,
        identity="t",
        block_size=16,
        dtype=mx.float32,
        layers=layers,
        kv_bits=bits,
        kv_group_size=group,
    )
    pools = KVPools(
        num_blocks=num_blocks, block_size=16, layers=layers, kv_bits=bits, kv_group_size=group
    )
    for lst in (pools.k, pools.v):
        for i, p in enumerate(lst):
            if isinstance(p, tuple):
                h, n, bs, w = p[0].shape
                x = mx.random.normal((h, n, bs, w * 32 // bits))
                lst[i] = tuple(mx.quantize(x, group_size=group, bits=bits))
            elif p is not None:
                lst[i] = mx.random.normal(p.shape)
    mx.eval(pools.arrays())
    return tier, pools


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blocks_are_stored_as_they_are(tmp_path, bits):
    """Packed words, scales and biases go to disk and come back bit for bit, across
    files and from inside one, and the file says what KV format it holds."""
    import json
    import struct

    from mlx_cairn.engine.disk import MAGIC

    tier, pools = quant_tier_and_pools(tmp_path, bits)
    try:
        tier.capture([(b, 300 + b) for b in range(1, 79)], pools)
        tier.flush()
        assert tier.drain()
        parts = tier.pool_arrays(pools)
        assert len(parts) == 2 * 2 * 3  # two KV layers, K and V, three arrays each
        # Packed: bits/32 of a word per value; scales and biases: one per group of 32.
        assert tier.block_bytes == 16 * sum(
            h * (4 * d * bits // 32 + 2 * 4 * d // 32)
            for h, d in [(2, 64), (2, 64), (1, 64), (1, 128)]
        )
        for lo, hi in [(1, 79), (3, 70), (64, 66)]:
            got = tier.read([300 + b for b in range(lo, hi)]).result()
            assert got.hashes == [300 + b for b in range(lo, hi)]
            assert [a.dtype for a in got.arrays[:3]] == [np.uint32, np.float32, np.float32]
            for arr, pool in zip(got.arrays, parts, strict=True):
                np.testing.assert_array_equal(arr, file_rows(pool, lo, hi))
        data = files(tmp_path)[0].read_bytes()
        (n,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
        key = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + n])["key"]
        assert (key["kv_bits"], key["kv_group_size"], key["dtype"]) == (
            bits,
            32,
            "mlx.core.float32",
        )
    finally:
        tier.close()


def test_a_tier_of_other_kv_settings_is_never_read(tmp_path):
    """8-bit files are invisible to a tier at full precision, 4 bits or another group
    size (another directory), and one moved into such a tier's directory is removed."""
    tier, pools = quant_tier_and_pools(tmp_path, 8)
    hashes = [500 + b for b in range(1, 11)]
    tier.capture([(b, h) for b, h in zip(range(1, 11), hashes, strict=True)], pools)
    tier.flush()
    assert tier.drain()
    tier.close()
    (ours,) = files(tmp_path)
    for bits, group in ((None, 32), (4, 32), (8, 64)):
        other, _ = quant_tier_and_pools(tmp_path, bits, group)
        try:
            assert other.dir != ours.parent
            assert other.run_length(hashes, 0, len(hashes)) == 0
        finally:
            other.close()
        moved = other.dir / ours.name
        moved.write_bytes(ours.read_bytes())
        other, _ = quant_tier_and_pools(tmp_path, bits, group)
        try:
            assert other.run_length(hashes, 0, len(hashes)) == 0
            assert other.stats.dropped_files == 1 and not moved.exists()
        finally:
            other.close()
    again, _ = quant_tier_and_pools(tmp_path, 8)
    try:  # the 8-bit tier itself still has them
        assert again.run_length(hashes, 0, len(hashes)) == len(hashes)
    finally:
        again.close()
