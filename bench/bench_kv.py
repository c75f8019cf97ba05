"""KV bookkeeping per request: mlx_cairn.kv (Rust) vs a plain-Python block pool.

One request = prefix lookup + allocate + insert + free for an 8,192-token prompt
(16-token blocks) whose first 4,096 tokens are cached; every prompt has its own
4,096-token tail, so the pool keeps evicting old tails (steady state). The
Python reference has the same semantics in the style of vLLM's block pool:
block objects in an intrusive doubly linked LRU free list, a dict of block
hashes, and hashlib.sha256 chained over each block's token bytes.

Usage: .venv/bin/python bench/bench_kv.py [--requests N]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import time
from array import array
from collections.abc import Callable

import numpy as np

from mlx_cairn.kv import BlockPool, PrefixCache

BLOCK = 16
PROMPT = 8192
CACHED = 4096
NUM_BLOCKS = 2048


# --------------------------------------------------------------------------- Python reference
class _Block:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None


class PyPool:
    """Plain-Python BlockPool + PrefixCache with the semantics of mlx_cairn.kv."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.head, self.tail = _Block(-1), _Block(-1)  # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        self.table: dict[bytes, _Block] = {}
        self.root = hashlib.sha256(b"root").digest()
        for b in self.blocks[1:]:
            self._push(b)

    def _push(self, b: _Block) -> None:
        last = self.tail.prev
        assert last is not None
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_free += 1

    def _unlink(self, b: _Block) -> None:
        assert b.prev is not None and b.next is not None
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def hash_blocks(self, tokens: list[int], salt: bytes | None = None) -> list[bytes]:
        bs, parent, out = self.block_size, self.root, []
        for i in range(len(tokens) // bs):
            extra = (b"\x01" + salt) if (i == 0 and salt is not None) else b""
            data = parent + extra + array("i", tokens[i * bs : (i + 1) * bs]).tobytes()
            parent = hashlib.sha256(data).digest()
            out.append(parent)
        return out

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            b = self.head.next
            assert b is not None
            self._unlink(b)
            if b.block_hash is not None:
                del self.table[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b.block_id)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not 0 < i < len(self.blocks) or self.blocks[i].ref_cnt == 0:
                raise ValueError(f"bad free of block {i}")
        for i in reversed(ids):
            b = self.blocks[i]
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._push(b)

    def lookup(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        out = []
        for h in hashes[: max(num_tokens - 1, 0) // self.block_size]:
            b = self.table.get(h)
            if b is None:
                break
            if b.ref_cnt == 0:
                self._unlink(b)
            b.ref_cnt += 1
            out.append(b.block_id)
        return out

    def insert(self, hashes: list[bytes], ids: list[int]) -> int:
        added = 0
        for h, i in zip(hashes, ids, strict=False):
            b = self.blocks[i]
            if b.block_hash is not None or h in self.table:
                continue
            self.table[h] = b
            b.block_hash = h
            added += 1
        return added


# --------------------------------------------------------------------------- workloads
def prompts(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 49152, CACHED, dtype=np.int32)
    return [
        np.concatenate([prefix, rng.integers(0, 49152, PROMPT - CACHED, dtype=np.int32)])
        for _ in range(n)
    ]


def rust_request(pool: BlockPool, cache: PrefixCache, tokens: object) -> int:
    h = cache.hash_blocks(tokens)  # hashed once, reused by lookup and insert
    hit = cache.lookup(h)
    new = pool.allocate(PROMPT // BLOCK - len(hit))
    assert new is not None
    blocks = hit + new
    cache.insert(h, blocks)
    pool.free(blocks)
    return len(hit)


def rust_request_plain(pool: BlockPool, cache: PrefixCache, tokens: object) -> int:
    hit = cache.lookup(tokens)  # tokens passed twice: hashed twice
    new = pool.allocate(PROMPT // BLOCK - len(hit))
    assert new is not None
    blocks = hit + new
    cache.insert(tokens, blocks)
    pool.free(blocks)
    return len(hit)


def python_request(pool: PyPool, tokens: list[int]) -> int:
    h = pool.hash_blocks(tokens)
    hit = pool.lookup(h, len(tokens))
    new = pool.allocate(PROMPT // BLOCK - len(hit))
    assert new is not None
    blocks = hit + new
    pool.insert(h, blocks)
    pool.free(blocks)
    return len(hit)


def timed(run: Callable[[object], int], inputs: list) -> float:
    """Mean µs per request over ``inputs``; checks every request hits the 4k prefix."""
    t0 = time.perf_counter()
    for x in inputs:
        assert run(x) == CACHED // BLOCK
    return (time.perf_counter() - t0) / len(inputs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="distinct prompts per round")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median reported)")
    args = ap.parse_args()
    arrays = prompts(args.requests)
    lists = [a.tolist() for a in arrays]
    py_inputs = lists[: max(10, args.requests // 5)]

    def warm_rust() -> tuple[BlockPool, PrefixCache]:
        pool = BlockPool(NUM_BLOCKS, BLOCK)
        cache = PrefixCache(pool, seed=0)
        first = pool.allocate(CACHED // BLOCK)
        assert first is not None
        cache.insert(arrays[0][:CACHED], first)
        pool.free(first)
        return pool, cache

    py = PyPool(NUM_BLOCKS, BLOCK)
    first = py.allocate(CACHED // BLOCK)
    assert first is not None
    py.insert(py.hash_blocks(lists[0][:CACHED]), first)
    py.free(first)

    rust = [warm_rust() for _ in range(3)]
    variants: list[tuple[str, Callable[[object], int], list]] = [
        ("Rust, int32 array, hash_blocks once",
         lambda t: rust_request(*rust[0], t), arrays),
        ("Rust, Python list, hash_blocks once",
         lambda t: rust_request(*rust[1], t), lists),
        ("Rust, Python list, tokens to lookup+insert",
         lambda t: rust_request_plain(*rust[2], t), lists),
        ("plain Python (hashlib.sha256, vLLM style)",
         lambda t: python_request(py, t), py_inputs),  # type: ignore[arg-type]
    ]  # fmt: skip
    # Interleave the implementations round by round so that load on a shared
    # machine hits all of them alike; report medians and per-round ratios.
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(args.rounds):
        for i, (_, run, inputs) in enumerate(variants):
            times[i].append(timed(run, inputs))
    py_times = times[-1]

    print(f"KV request: {PROMPT} tokens, {CACHED} cached, block {BLOCK}, pool {NUM_BLOCKS} blocks")
    print(f"{platform.machine()}, Python {platform.python_version()}, {args.rounds} rounds")
    print(f"{'implementation':<46}{'µs/request':>12}{'vs Python':>11}")
    for (name, _, _), ts in zip(variants, times, strict=True):
        ratio = statistics.median(p / t for p, t in zip(py_times, ts, strict=True))
        print(f"{name:<46}{statistics.median(ts):>12.1f}{ratio:>10.1f}x")
    print(f"(evictions in the int32 run: {rust[0][1].stats()['evictions']})")


if __name__ == "__main__":
    main()
