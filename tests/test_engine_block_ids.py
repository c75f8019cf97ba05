"""Exact block ids and free order through a scripted schedule (STYLE #6).

Pool: 8 usable blocks of 4 tokens (block 0 is the null block). The free
list starts 1..8; allocation takes its head (the least recently freed); a
block table is freed tail first; a freed block keeps its hash until it is
allocated again.
"""

from __future__ import annotations

from mlx_cairn.engine.plan import StepPlan
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.kv import BlockPool, PrefixCache
from test_engine_prefix_chain import _seq

A_PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4, 4, 2


def _apply(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine's update does with a plan whose rows all sample ``token``."""
    for r in plan.rows:
        r.seq.num_computed = r.start + r.n
    for r in plan.rows:
        if r.samples:
            r.seq.tokens.append(token)
            sched.register(r.seq)
            if not r.seq.wants_more:
                sched.finish(r.seq)


def _rows(plan: StepPlan) -> list[tuple[int, int, int, tuple[int, ...]]]:
    return [(r.seq.request_id, r.start, r.n, r.block_ids) for r in plan.rows]


def test_block_ids_and_free_order_through_a_scripted_schedule() -> None:
    pool = BlockPool(num_blocks=9, block_size=4)
    cache = PrefixCache(pool, seed=1)
    sched = Scheduler(pool, cache, max_batch=4, step_token_budget=64)
    a = _seq(1, A_PROMPT, 3)
    b = _seq(2, list(range(200, 206)), 2)
    sched.add(a)
    sched.add(b)

    # Step 1: both prefill whole; A takes 1-3, B takes 4-5 (ceil(6/4) = 2 blocks).
    plan = sched.schedule()
    assert _rows(plan) == [(1, 0, 10, (1, 2, 3)), (2, 0, 6, (4, 5))]
    assert all(r.samples and not r.placeholder for r in plan.rows)
    _apply(sched, plan)
    assert pool.num_free_blocks == 3  # 6, 7, 8

    # Step 2: both decode one token; positions 10 and 6 fit their last blocks.
    plan = sched.schedule()
    assert _rows(plan) == [(1, 10, 1, (1, 2, 3)), (2, 6, 1, (4, 5))]
    _apply(sched, plan)
    # B had 2 output tokens: it finished and freed 4, 5 (4 holds a full, hashed block).
    assert b not in sched.running and pool.num_free_blocks == 5

    # C shares A's first two full blocks: the lookup takes 1 and 2 (refcount 2).
    c = _seq(3, [*A_PROMPT[:8], 1, 2, 3], 1)
    sched.add(c)
    plan = sched.schedule()
    # A decodes at 11 (block 3 still has room); C reuses 1, 2 and gets the head
    # of the free list: 6, 7, 8 (never used), then B's 5, 4 (freed tail first).
    assert _rows(plan) == [(1, 11, 1, (1, 2, 3)), (3, 8, 3, (1, 2, 6))]
    assert c.cached_tokens == 8
    assert (pool.refcount(1), pool.refcount(2), pool.refcount(6)) == (2, 2, 1)
    _apply(sched, plan)
    # A (3 outputs) and C (1 output) are done: every block is free again.
    assert not sched.running and pool.num_free_blocks == 8

    # A block table is freed tail first (its end is evicted first), so the free
    # list is now 7, 8 | 5, 4 (B) | 3 (A; 1, 2 were still C's) | 6, 2, 1 (C).
    # D needs 3 blocks and hits nothing: 7, 8, 5.
    d = _seq(4, list(range(300, 310)), 1)
    sched.add(d)
    plan = sched.schedule()
    assert _rows(plan) == [(4, 0, 10, (7, 8, 5))]
    _apply(sched, plan)
    assert pool.num_free_blocks == 8
    pool.check_invariants()
