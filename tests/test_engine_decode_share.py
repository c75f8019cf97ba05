"""Decode share: after a step that prefilled beside decoding rows, the next steps
decode only until the decoding rows have had their share of the time."""

from __future__ import annotations

import pytest

from mlx_cairn.engine.scheduler import MAX_DECODE_OWED_S, Scheduler
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import bare_sequence

BS = 16
BUDGET = 64


def _sched(share: float = 0.5) -> Scheduler:
    pool = BlockPool(num_blocks=64, block_size=BS)
    s = Scheduler(pool, PrefixCache(pool, seed=1), max_batch=8, step_token_budget=BUDGET)
    s.decode_share = share
    return s


def _run(sched: Scheduler, plan) -> None:
    """Compute ``plan`` as the runner would: every row whose prompt is done samples a token."""
    for r in plan.rows:
        r.seq.num_computed = r.start + r.n
        sched.register(r.seq)
        if r.seq.num_computed == len(r.seq.tokens):
            r.seq.tokens.append(7)


def _decoding(sched: Scheduler):
    """One sequence prefilled and decoding, and a 200-token prompt queued behind it."""
    a = bare_sequence(1, list(range(20)), salt="s", max_tokens=50)
    sched.add(a)
    first = sched.schedule()
    _run(sched, first)
    sched.step_done(first, 1.0)  # nobody was decoding: nothing owed
    b = bare_sequence(2, list(range(1000, 1200)), salt="s", max_tokens=4)
    sched.add(b)
    return a, b


def _prefilled(plan) -> int:
    return sum(r.n for r in plan.prefill)


def test_decoding_rows_get_their_share_after_a_mixed_step():
    sched = _sched()
    a, b = _decoding(sched)
    mixed = sched.schedule()
    assert [r.seq for r in mixed.decode] == [a] and _prefilled(mixed) == BUDGET - 1
    # Launched, not read back yet: the next plan (computed meanwhile) decodes only.
    _run(sched, mixed)
    held = sched.schedule()
    assert held.decode and not held.prefill and sched.prefill_holds == 1
    sched.step_done(mixed, 3.0)  # the chunk made decoding wait 3 s: 3 s owed
    _run(sched, held)
    sched.step_done(held, 1.0)
    for _ in range(2):  # 2 s still owed
        plan = sched.schedule()
        assert not plan.prefill
        _run(sched, plan)
        sched.step_done(plan, 1.0)
    plan = sched.schedule()  # paid: the prompt goes on
    assert plan.decode and _prefilled(plan) > 0 and sched.prefill_holds == 3
    # All of the prompt was prefilled in the end, in the same chunks.
    total = _prefilled(mixed)
    while plan.prefill:
        total += _prefilled(plan)
        _run(sched, plan)
        sched.step_done(plan, 0.0)
        plan = sched.schedule()
    assert total == b.num_prompt == 200


def test_a_long_chunk_owes_a_bounded_time():
    sched = _sched()
    _decoding(sched)
    mixed = sched.schedule()
    _run(sched, mixed)
    sched.step_done(mixed, 1000.0)
    assert sched._owed_s == MAX_DECODE_OWED_S


def test_share_zero_mixes_every_step():
    sched = _sched(0.0)
    _decoding(sched)
    for _ in range(3):
        plan = sched.schedule()
        assert plan.decode and plan.prefill
        _run(sched, plan)
        sched.step_done(plan, 5.0)
    assert sched.prefill_holds == 0


def test_prefill_alone_is_never_held():
    sched = _sched()
    a = bare_sequence(1, list(range(300)), salt="s", max_tokens=4)
    sched.add(a)
    for _ in range(4):
        plan = sched.schedule()
        assert _prefilled(plan) > 0 and not plan.decode
        _run(sched, plan)
        sched.step_done(plan, 5.0)
    assert sched.prefill_holds == 0


# ------------------------------------------------------------------ engine


@pytest.mark.parametrize("share", [None, 0.0])
def test_engine_holds_prefill_for_a_decoding_stream_and_answers_stay_greedy(share):
    import dataclasses

    from mlx_cairn.engine import Engine, EngineConfig
    from mlx_cairn.testing.engine_checks import closing_at_rest, greedy_reference
    from mlx_cairn.testing.tiny_models import tiny_model
    from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

    lm = tiny_model("llama", seed=9)
    short = [(11 * i) % 200 + 20 for i in range(12)]
    long = [(7 * i) % 230 + 9 for i in range(320)]  # five chunks of 64

    engine = Engine(
        lm, EngineConfig(num_blocks=128, block_size=16, step_token_budget=64, decode_share=share)
    )
    with closing_at_rest(engine) as e:
        base = e.prepare(
            ChatRequest(messages=[Message("user", "x")], sampling=SamplingParams(temperature=0.0))
        )
        a = e.submit(dataclasses.replace(base, prompt_ids=short, max_tokens=40))
        events = a.iter_sync(timeout=120.0)
        first = next(events)  # decoding now
        b = e.submit(dataclasses.replace(base, prompt_ids=long, max_tokens=4))
        rest_a = [first, *events]
        rest_b = list(b.iter_sync(timeout=120.0))
        assert isinstance(rest_a[-1], Done) and isinstance(rest_b[-1], Done)
        assert list(a.output_ids) == greedy_reference(lm, short, 40)
        assert list(b.output_ids) == greedy_reference(lm, long, 4)
        st = e.stats()
    assert (st.prefill_holds > 0) == (share is None)  # on by default; 0 turns it off
    assert st.prefill_tokens == len(short) + len(long)


@pytest.mark.parametrize("bad", [-0.1, 0.95, float("nan"), "0.5"])
def test_engine_refuses_a_share_out_of_range(bad):
    from mlx_cairn.engine import Engine, EngineConfig
    from mlx_cairn.testing.tiny_models import tiny_model

    with pytest.raises(ValueError, match="decode_share"):
        Engine(tiny_model("llama", seed=9), EngineConfig(num_blocks=16, decode_share=bad))
