"""Prefill chunking: a prompt's last sliver rides along instead of taking a step of its own."""

from __future__ import annotations

from mlx_cairn.engine.scheduler import TAIL_FRACTION, Scheduler
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import bare_sequence

BS = 16
BUDGET = 64
SLIVER = BUDGET // TAIL_FRACTION


def _sched() -> Scheduler:
    pool = BlockPool(num_blocks=64, block_size=BS)
    return Scheduler(pool, PrefixCache(pool, seed=1), max_batch=8, step_token_budget=BUDGET)


def _chunks(sched: Scheduler, *lengths: int) -> list[dict[int, int]]:
    """Submit prompts of ``lengths`` at once; each step's prefill chunk per prompt until
    all are prefilled (steps computed as the runner would)."""
    seqs = [bare_sequence(i + 1, list(range(1000 * i, 1000 * i + n)), salt="s", max_tokens=4)
            for i, n in enumerate(lengths)]  # fmt: skip
    for s in seqs:
        sched.add(s)
    steps = []
    while any(s.num_computed < len(s.tokens) for s in seqs):
        plan = sched.schedule()
        steps.append(
            {
                seqs.index(r.seq): r.n
                for r in plan.rows
                if r.n > 1 or r.start < len(r.seq.tokens) - 1
            }
        )
        for r in plan.rows:
            r.seq.num_computed = r.start + r.n
            sched.register(r.seq)
    return steps


def test_a_prompt_a_sliver_over_the_budget_is_prefilled_in_one_step():
    assert _chunks(_sched(), BUDGET + SLIVER) == [{0: BUDGET + SLIVER}]


def test_a_longer_rest_waits_for_the_next_step():
    assert _chunks(_sched(), BUDGET + SLIVER + 1) == [{0: BUDGET}, {0: SLIVER + 1}]


def test_in_a_burst_the_last_prompt_takes_its_sliver_along():
    # 40 + 30 tokens: the second has 24 of budget left, and 6 would remain.
    assert _chunks(_sched(), 40, 30) == [{0: 40, 1: 30}]
    # 40 + 40: 16 would remain (more than a sliver): cut at the budget.
    assert _chunks(_sched(), 40, 40) == [{0: 40, 1: 24}, {1: 16}]
