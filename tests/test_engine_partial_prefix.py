"""Partial-block prefix reuse: a prompt whose cached prefix ends inside a block copies
that block's leading rows instead of computing them, and answers as if it had not."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.engine.scheduler import MIN_PARTIAL_ROWS, Scheduler
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import (
    bare_sequence,
    closing_at_rest,
    greedy_base,
    greedy_reference_at,
)
from mlx_cairn.testing.tiny_configs import HYBRID_CONFIGS
from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_model, tiny_zoo_model
from mlx_cairn.types import Done

TIMEOUT = 60.0
SALT = "model\x00tenant"
BS = 16


def _seq(rid: int, prompt: list[int], salt: str = SALT) -> Sequence:
    return bare_sequence(rid, prompt, salt=salt, max_tokens=4)


def _compute(sched: Scheduler) -> list:
    """One planned step, done as the runner would: returns the plan's rows."""
    plan = sched.schedule()
    for r in plan.rows:
        r.seq.num_computed = r.start + r.n
        sched.register(r.seq)
    return list(plan.rows)


def _run_prompt(sched: Scheduler, seq: Sequence) -> list:
    sched.add(seq)
    rows = []
    while seq.num_computed < len(seq.tokens):
        rows += [r for r in _compute(sched) if r.seq is seq]
    return rows


@pytest.fixture
def sched():
    pool = BlockPool(num_blocks=32, block_size=BS)
    return Scheduler(pool, PrefixCache(pool, seed=1), max_batch=4, step_token_budget=64)


def test_next_block_starting_like_a_cached_one_is_copied(sched):
    a = _seq(1, list(range(100, 140)))  # blocks [100..115] [116..131] + 8
    _run_prompt(sched, a)
    sched.finish(a)
    # Same first block, then 9 tokens of a's second block, then different ones.
    b = _seq(2, [*range(100, 125), 1, 2, 3, 4, 5, 6])
    rows = _run_prompt(sched, b)
    first = rows[0]
    assert first.copy is not None
    src, dst, n = first.copy
    assert n == 9 and first.start == BS + 9
    assert dst == b.block_ids[1] and src not in b.block_ids
    assert sched.cache.block_hash(src) is not None  # a's block, still cached
    assert b.cached_tokens == BS + 9 and sched.partial_hit_tokens == 9
    assert all(r.copy is None for r in rows[1:])


def test_a_token_is_always_left_to_compute(sched):
    a = _seq(1, list(range(100, 140)))
    _run_prompt(sched, a)
    sched.finish(a)
    b = _seq(2, list(range(100, 126)))  # all of it cached: the last token is computed
    rows = _run_prompt(sched, b)
    assert rows[0].copy is not None and rows[0].copy[2] == 9
    assert rows[0].start == 25 and rows[0].n == 1


def test_short_overlaps_other_salts_and_evicted_sources_are_not_used(sched):
    a = _seq(1, list(range(100, 140)))
    _run_prompt(sched, a)
    sched.finish(a)
    few = _seq(2, [*range(100, 100 + BS + MIN_PARTIAL_ROWS - 1), 1, 2, 3, 4, 5, 6])
    assert _run_prompt(sched, few)[0].copy is None
    sched.finish(few)
    other = _seq(3, [*range(100, 129), 1, 2, 3], salt="another model")
    assert _run_prompt(sched, other)[0].copy is None
    sched.finish(other)
    # Fill the pool with fresh content: a's blocks are evicted and reused.
    for i in range(7):
        s = _seq(10 + i, [7000 + 100 * i + j for j in range(80)])
        _run_prompt(sched, s)
        sched.finish(s)
    b = _seq(4, [*range(100, 129), 1, 2, 3, 4])
    assert all(r.copy is None for r in _run_prompt(sched, b))
    assert b.cached_tokens == 0


def test_a_preempted_row_starts_over_without_its_copy():
    pool = BlockPool(num_blocks=6, block_size=BS)  # 5 usable blocks
    sched = Scheduler(pool, PrefixCache(pool, seed=1), max_batch=4, step_token_budget=64)
    a = _seq(1, list(range(100, 140)))
    _run_prompt(sched, a)
    sched.finish(a)
    b = _seq(2, [*range(100, 129), 1, 2, 3])
    sched.add(b)
    plan = sched.schedule()
    assert [r.copy is not None for r in plan.rows] == [True]
    # Preempted, b holds nothing and will look its prefix up again.
    sched.preempt(b)
    assert b.block_ids == [] and b.num_computed == 0


# ------------------------------------------------------------ real engine


@pytest.fixture(scope="module", params=[None, 8], ids=["full", "kv8"])
def kv(request):
    """KV settings: full precision, and 8-bit blocks (issue 39: copied rows are packed
    rows with their scales and biases)."""
    return {} if request.param is None else {"kv_bits": 8, "kv_group_size": 32}


@pytest.fixture(scope="module")
def lm(kv):
    # The llama's head_dim (16) is below the smallest quantization group: the 8-bit
    # run takes the qwen3 (head_dim 32).
    return tiny_model("qwen3" if kv else "llama", seed=5)


def greedy(prompt: list[int], max_tokens: int, prepared: PreparedRequest) -> PreparedRequest:
    return dataclasses.replace(prepared, prompt_ids=list(prompt), max_tokens=max_tokens)


def _base(engine: Engine) -> PreparedRequest:
    return greedy_base(engine, 8)


def _answer(engine: Engine, prepared: PreparedRequest) -> tuple[list[int], Done]:
    s = engine.submit(prepared)
    done = list(s.iter_sync(timeout=TIMEOUT))[-1]
    assert isinstance(done, Done), done
    return list(s.output_ids), done


def test_engine_answers_equal_the_reference_with_copied_rows(lm, kv):
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=128, block_size=16, **kv))) as e:
        base = _base(e)
        shared = [(7 * i) % 200 + 3 for i in range(16 + 11)]
        a = [*shared, *range(40, 60)]
        out_a, _ = _answer(e, greedy(a, 12, base))
        assert out_a == greedy_reference_at(lm, a, 12, **kv)
        # Two prompts, each continuing the shared 27 tokens differently: one block
        # is a full hit, 11 rows of the next are copied from a's second block.
        for tail in ([90, 91, 92, 93, 94, 95], [61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]):
            prompt = [*shared, *tail]
            out, done = _answer(e, greedy(prompt, 12, base))
            assert out == greedy_reference_at(lm, prompt, 12, **kv)
            assert done.usage.cached_tokens == 27
        assert e.stats().partial_hit_tokens == 22
        # Batched: several rows copy in the same step, from the same source.
        prompts = [[*shared, 100 + i, 101 + i, 102 + i, 103 + i] for i in range(4)]
        streams = [e.submit(greedy(p, 10, base)) for p in prompts]
        for p, s in zip(prompts, streams, strict=True):
            assert isinstance(list(s.iter_sync(timeout=TIMEOUT))[-1], Done)
            assert list(s.output_ids) == greedy_reference_at(lm, p, 10, **kv)


def test_engine_source_evicted_meanwhile_is_never_read(lm, kv):
    # A pool so small that every new prompt evicts the cached blocks of the last.
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=8, block_size=16, **kv))) as e:
        base = _base(e)
        shared = [(11 * i) % 150 + 5 for i in range(16 + 9)]
        for round_ in range(4):
            filler = [(13 * i + round_) % 180 + 4 for i in range(60)]
            out, _ = _answer(e, greedy(filler, 8, base))
            assert out == greedy_reference_at(lm, filler, 8, **kv)
            prompt = [*shared, 30 + round_, 31, 32]
            out, _ = _answer(e, greedy(prompt, 8, base))
            assert out == greedy_reference_at(lm, prompt, 8, **kv)


def test_hybrid_models_copy_nothing():
    lm = tiny_zoo_model(next(iter(HYBRID_CONFIGS)), seed=2)
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16))) as e:
        base = _base(e)
        shared = [(7 * i) % 200 + 3 for i in range(16 + 11)]
        _answer(e, greedy([*shared, 1, 2, 3], 4, base))
        prompt = [*shared, 4, 5, 6]
        out, _ = _answer(e, greedy(prompt, 6, base))
        assert e.stats().partial_hit_tokens == 0
        assert out == mlx_lm_greedy(lm.model.inner, prompt, 6, set(lm.eos_token_ids))
