"""mlx_cairn.kv through its Python API: exact ids, input forms, and bad input."""

from __future__ import annotations

import array
import threading

import numpy as np
import pytest

from mlx_cairn.kv import BlockHashes, BlockPool, PrefixCache

BS = 4


def snapshot(pool: BlockPool) -> tuple[list[int], list[int]]:
    return pool.free_list(), [pool.refcount(i) for i in range(pool.num_blocks)]


def test_allocate_free_exact_ids() -> None:
    pool = BlockPool(num_blocks=6, block_size=BS)
    assert (pool.num_blocks, pool.block_size, pool.num_free_blocks) == (6, BS, 5)
    a = pool.allocate(2)
    assert a == [1, 2]
    assert pool.allocate(4) is None  # never a partial allocation
    assert pool.num_free_blocks == 3
    assert pool.allocate(0) == []
    assert pool.refcount(1) == 1 and pool.refcount(0) == 0
    pool.free(a)
    assert pool.free_list() == [3, 4, 5, 2, 1]  # reverse order: chain tail first
    pool.check_invariants()


def test_shared_prefix_shares_blocks_and_stops_one_block_short() -> None:
    pool = BlockPool(32, BS)
    cache = PrefixCache(pool, seed=1)
    prompt = list(range(12))  # exactly three full blocks
    assert cache.lookup(prompt) == []
    blocks = pool.allocate(3)
    assert blocks == [1, 2, 3]
    assert cache.insert(prompt, blocks) == 3
    assert cache.insert(prompt, blocks) == 0  # idempotent
    # The whole prompt is cached, but the last block is left to compute.
    assert cache.lookup(prompt) == [1, 2]
    assert cache.lookup([*prompt, 99]) == [1, 2, 3]
    assert [pool.refcount(b) for b in blocks] == [3, 3, 2]
    other = [*range(8), 7, 7, 7, 7, 7]
    assert cache.lookup(other) == [1, 2]
    st = cache.stats()
    assert st["blocks_total"] == 31
    assert st["blocks_free"] + st["blocks_in_use"] == st["blocks_total"]
    assert (st["blocks_cached"], st["lookups"], st["hit_tokens"]) == (3, 4, 8 + 12 + 8)
    assert st["miss_tokens"] == 12 + 4 + 1 + 5
    assert st["evictions"] == 0


def test_eviction_happens_at_reallocation_oldest_first() -> None:
    pool = BlockPool(5, BS)  # usable 1..4
    cache = PrefixCache(pool, seed=2)
    p = list(range(8))
    b = pool.allocate(2)
    cache.insert(p, b)
    pool.free(b)
    assert pool.free_list() == [3, 4, 2, 1]
    assert pool.allocate(3) == [3, 4, 2]  # block 2 (chain tail) evicted, 1 survives
    assert cache.stats()["evictions"] == 1
    assert cache.block_hash(2) is None
    assert cache.block_hash(1) == cache.hash_blocks(p)[0]
    assert cache.lookup([*p, 0]) == [1]


def test_salt_and_seed() -> None:
    pool = BlockPool(64, BS)
    c1, c2, r = PrefixCache(pool, seed=7), PrefixCache(pool, seed=7), PrefixCache(pool)
    p = list(range(9))
    assert list(c1.hash_blocks(p)) == list(c2.hash_blocks(p))
    assert list(c1.hash_blocks(p)) != list(r.hash_blocks(p))
    assert list(c1.hash_blocks(p, "m")) == list(c1.hash_blocks(p, b"m"))
    assert c1.hash_blocks(p, "a")[1] != c1.hash_blocks(p, "b")[1]
    assert c1.hash_blocks(p, "")[0] != c1.hash_blocks(p)[0]
    blocks = pool.allocate(3)
    c1.insert(p, blocks, salt="tenant-a")
    assert c1.lookup(p, salt="tenant-b") == []
    assert c1.lookup(p) == []
    assert c2.lookup(p, salt="tenant-a") == blocks[:2]  # same seed, same pool
    assert r.lookup(p, salt="tenant-a") == []
    assert PrefixCache(pool, seed=-1).hash_blocks(p)[0] > 0
    assert c1.pool is pool and c1.block_size == BS


def test_block_hashes_handle() -> None:
    pool = BlockPool(64, BS)
    cache = PrefixCache(pool, seed=3)
    h = cache.hash_blocks(list(range(10)), salt="s")
    assert isinstance(h, BlockHashes)
    assert (len(h), h.num_tokens) == (2, 10)
    assert h[-1] == h[1] and 0 < h[0] < 2**128
    with pytest.raises(IndexError):
        h[2]
    blocks = pool.allocate(3)
    assert cache.insert(h, blocks) == 2
    assert cache.lookup(h) == blocks[:2]
    assert cache.lookup(list(range(10)), salt="s") == blocks[:2]
    with pytest.raises(ValueError, match="salt"):
        cache.lookup(h, salt="s")
    with pytest.raises(ValueError, match="different PrefixCache"):
        PrefixCache(pool, seed=4).lookup(h)
    with pytest.raises(ValueError, match="different PrefixCache"):
        PrefixCache(BlockPool(8, 8), seed=3).lookup(h)


def test_hash_blocks_extends_a_prefix() -> None:
    cache = PrefixCache(BlockPool(8, BS), seed=6)
    toks = list(range(23))
    for salt in (None, "s"):
        whole = cache.hash_blocks(toks, salt)
        for cut in (0, 4, 8, 20):
            head = cache.hash_blocks(toks[:cut], salt)
            ext = cache.hash_blocks(np.asarray(toks[cut:], dtype=np.int32), prefix=head)
            assert list(ext) == list(whole) and ext.num_tokens == 23
    head = cache.hash_blocks(toks[:6])
    with pytest.raises(ValueError, match="whole number"):
        cache.hash_blocks(toks[6:], prefix=head)
    with pytest.raises(ValueError, match="salt"):
        cache.hash_blocks(toks[8:], "s", prefix=cache.hash_blocks(toks[:8]))
    with pytest.raises(ValueError, match="different PrefixCache"):
        PrefixCache(BlockPool(8, BS), seed=7).hash_blocks(toks, prefix=head)
    with pytest.raises(TypeError):
        cache.hash_blocks(toks, prefix=toks)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: np.asarray(t, dtype=np.int32),
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: np.asarray(t, dtype=np.uint32),
        lambda t: np.repeat(np.asarray(t, dtype=np.int32), 2)[::2],  # strided view
        lambda t: array.array("i", t),
        lambda t: array.array("q", t),
        iter,
    ],
)
def test_token_input_forms_hash_alike(make: object) -> None:
    cache = PrefixCache(BlockPool(8, BS), seed=5)
    toks = [5, 0, 2**31 - 1, 17, 3, 3, 3, 3, 9]
    assert list(cache.hash_blocks(make(toks))) == list(cache.hash_blocks(toks))  # type: ignore[operator]
    assert cache.hash_blocks(make(toks)).num_tokens == 9  # type: ignore[operator]


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [
        ([1, -1], ValueError),
        ([2**31], ValueError),
        ([2**80], ValueError),
        ([1, "2"], TypeError),
        ([1.0], TypeError),
        ("abc", TypeError),
        (b"abcd", TypeError),
        (np.zeros((2, 4), dtype=np.int32), ValueError),
        (np.zeros(4, dtype=np.float32), TypeError),
        (np.array([-5], dtype=np.int32), ValueError),
        (np.array([2**40], dtype=np.int64), ValueError),
        (5, TypeError),
        (None, TypeError),
    ],
)
def test_bad_tokens_raise_and_change_nothing(tokens: object, exc: type[Exception]) -> None:
    pool = BlockPool(8, BS)
    cache = PrefixCache(pool, seed=0)
    before = snapshot(pool), cache.stats()
    for call in (
        lambda: cache.lookup(tokens),  # type: ignore[arg-type]
        lambda: cache.hash_blocks(tokens),  # type: ignore[arg-type]
        lambda: cache.insert(tokens, [1, 2]),  # type: ignore[arg-type]
    ):
        with pytest.raises(exc):
            call()
    assert (snapshot(pool), cache.stats()) == before


@pytest.mark.parametrize(
    "ids",
    [[0], [8], [-1], [2**64], [1, 1], [3], ["1"], [1.5], "12", None, [1, 2, 2]],
)
def test_bad_frees_raise_and_change_nothing(ids: object) -> None:
    pool = BlockPool(8, BS)
    held = pool.allocate(2)  # [1, 2], refcount 1 each
    before = snapshot(pool)
    with pytest.raises((ValueError, TypeError)):
        pool.free(ids)  # type: ignore[arg-type]
    assert snapshot(pool) == before
    pool.free(held)
    with pytest.raises(ValueError, match="no reference"):
        pool.free(held)
    pool.check_invariants()


def test_bad_numbers() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, 16)
    with pytest.raises(ValueError):
        BlockPool(2**40, 16)
    with pytest.raises(ValueError):
        BlockPool(-3, 16)
    with pytest.raises(ValueError):
        BlockPool(8, 0)
    with pytest.raises(ValueError):
        BlockPool(8, 2**100)
    with pytest.raises(TypeError):
        BlockPool(8.0, 16)  # type: ignore[arg-type]
    pool = BlockPool(8, BS)
    for n in (-1, 2**63, 2**200):
        with pytest.raises(ValueError):
            pool.allocate(n)
    assert pool.allocate(2**40) is None
    for b in (-1, 8, 2**70):
        with pytest.raises(ValueError):
            pool.refcount(b)
    with pytest.raises(ValueError):
        PrefixCache(pool, seed=2**70)
    with pytest.raises(TypeError):
        PrefixCache(pool, seed=0).lookup([1, 2, 3, 4, 5], salt=5)  # type: ignore[arg-type]
    assert pool.num_free_blocks == 7


def test_bad_inserts_change_nothing() -> None:
    pool = BlockPool(10, BS)
    cache = PrefixCache(pool, seed=0)
    p, q = list(range(8)), list(range(100, 108))
    x = pool.allocate(2)
    before = snapshot(pool), cache.stats()
    cases = [
        (p, x[:1], "only 1 block id"),
        (p, [x[0], x[0]], "listed twice"),
        (p, [x[0], 9], "is free"),
        (p, [x[0], 10], "not a usable block"),
        (p, [x[0], 0], "not a usable block"),
        (p, [x[0], -2], "out of range"),
    ]
    for toks, ids, msg in cases:
        with pytest.raises(ValueError, match=msg):
            cache.insert(toks, ids)
        assert (snapshot(pool), cache.stats()) == before
    assert cache.insert(p, [*x, 9]) == 2  # extra ids (partial block) are ignored
    with pytest.raises(ValueError, match="different content"):
        cache.insert(q, x)
    pool.check_invariants()


def test_threads_share_one_pool() -> None:
    pool = BlockPool(200, BS)
    cache = PrefixCache(pool, seed=11)
    system = list(range(600))  # a long shared prefix: hashed with the GIL released
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(30):
                prompt = np.asarray([*system, k, i, *range(i % 9)], dtype=np.int32)
                h = cache.hash_blocks(prompt)
                hit = cache.lookup(h)
                need = -(-len(prompt) // BS) - len(hit)
                new = pool.allocate(need)
                if new is None:
                    pool.free(hit)
                    continue
                cache.insert(h, hit + new)
                pool.free(hit + new)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check_invariants()
    st = cache.stats()
    assert st["blocks_in_use"] == 0 and st["blocks_free"] == 199
    assert st["hit_tokens"] > 0
