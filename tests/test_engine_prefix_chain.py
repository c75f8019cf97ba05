"""Per-sequence block-hash chains: extended block by block, equal to a fresh hash of the prefix."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import bare_sequence, closing_at_rest, greedy_reference
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

TIMEOUT = 60.0
SALT = "model\x00tenant"


# ------------------------------------------------------- scheduler, no model


def _seq(rid: int, prompt: list[int], max_tokens: int) -> Sequence:
    return bare_sequence(rid, prompt, salt=SALT, max_tokens=max_tokens)


def _step(sched: Scheduler) -> None:
    """What the runner + engine do with a plan, with token values i*7 % 101."""
    plan = sched.schedule()
    for r in plan.rows:
        r.seq.num_computed = r.start + r.n
    for seq in plan.sequences():
        if seq.num_computed == seq.num_tokens:
            seq.tokens.append(len(seq.tokens) * 7 % 101)
            sched.register(seq)
            if not seq.wants_more:
                sched.finish(seq)


def _check_chain(cache: PrefixCache, seq: Sequence) -> None:
    h = seq.block_hashes
    bs = cache.block_size
    assert h.num_tokens == len(h) * bs <= len(seq.tokens)
    assert list(h) == list(cache.hash_blocks(seq.tokens[: len(h) * bs], salt=SALT))


def test_scheduler_chain_matches_fresh_hash_through_decode_and_preemption():
    bs = 4
    pool = BlockPool(num_blocks=64, block_size=bs)
    cache = PrefixCache(pool, seed=7)
    sched = Scheduler(pool, cache, max_batch=4, step_token_budget=10)
    seq = _seq(1, list(range(1, 23)), max_tokens=120)
    sched.add(seq)
    lengths = []
    for _ in range(60):
        _step(sched)
        if seq.block_hashes is not None and seq.num_registered:
            _check_chain(cache, seq)
            # Every registered block is cached under the chain's hash of its position.
            for i in range(seq.num_registered):
                assert cache.block_hash(seq.block_ids[i]) == seq.block_hashes[i]
            lengths.append(len(seq.block_hashes))
    assert lengths[-1] >= (22 + 50) // bs - 1
    # Extended block by block, never re-hashed from scratch into something shorter.
    assert lengths == sorted(lengths)

    # Preempt it, evict the tail of its chain, and let it recompute.
    before = list(seq.block_hashes)
    sched.preempt(seq)
    cached = cache.stats()["blocks_cached"]
    grabbed = pool.allocate(pool.num_free_blocks - 6)  # evicts all but 6 cached blocks
    assert grabbed is not None
    pool.free(grabbed)
    assert 0 < cache.stats()["blocks_cached"] == 6 < cached
    _step(sched)
    assert seq.num_registered == 6  # re-admitted on the head of its chain
    while seq in sched.waiting or seq in sched.running:
        _step(sched)
        _check_chain(cache, seq)
    assert list(seq.block_hashes)[: len(before)] == before
    assert len(seq.tokens) == 22 + 120
    _check_chain(cache, seq)
    assert pool.num_free_blocks == pool.num_blocks - 1

    # A new prompt that continues the finished sequence hits every block it computed.
    follow = _seq(2, [*seq.tokens, 5, 6, 7], max_tokens=1)
    sched.add(follow)
    sched.schedule()
    assert follow.num_computed == (len(seq.tokens) - 1) // bs * bs
    sched.finish(follow)


# ------------------------------------------------------------ real engine


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=3)


@pytest.fixture
def engine(lm):
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=256, block_size=4))) as e:
        yield e


def greedy(text: str, max_tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", text)],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def test_engine_chain_and_prefix_hit_through_generated_blocks(lm, engine):
    seen: list[tuple[list[int], object, list[int], int]] = []

    def snapshot() -> None:
        for s in engine._scheduler.running:
            if s.block_hashes is not None:
                seen.append((list(s.tokens), s.block_hashes, list(s.block_ids), s.num_registered))

    engine._fault_hook = snapshot
    req = greedy("What is the capital of France? " * 3, max_tokens=80)
    prepared = engine.prepare(req)
    s1 = engine.submit(prepared)
    assert isinstance(list(s1.iter_sync(timeout=TIMEOUT))[-1], Done)
    engine._fault_hook = None
    assert s1.output_ids == greedy_reference(lm, prepared.prompt_ids, 80)
    assert len(s1.output_ids) == 80
    cache, bs = engine._cache, engine.block_size
    assert seen and len(seen[-1][1]) >= (len(prepared.prompt_ids) + 60) // bs
    for tokens, h, blocks, registered in seen[-5:]:
        assert list(h) == list(cache.hash_blocks(tokens[: len(h) * bs], salt=prepared.salt))
        assert registered == len(h)
        assert [cache.block_hash(b) for b in blocks[:registered]] == list(h)

    # The generated part was registered as it filled: a prompt continuing it hits it all.
    full = [*prepared.prompt_ids, *s1.output_ids]
    extra = [5, 6, 7, 8, 9]
    cont = dataclasses.replace(prepared, prompt_ids=full + extra, max_tokens=8)
    s2 = engine.submit(cont)
    done = list(s2.iter_sync(timeout=TIMEOUT))[-1]
    assert isinstance(done, Done)
    assert done.usage.cached_tokens == (len(full) - 1) // bs * bs
    assert s2.output_ids == greedy_reference(lm, full + extra, 8)
