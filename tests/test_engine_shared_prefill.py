"""Requests that arrive together with the same prefix compute it once (issue 33): the
followers wait while the leader computes the shared blocks, then take them by reference."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.engine.scheduler import Scheduler
from mlx_cairn.engine.sequence import Sequence
from mlx_cairn.kv import BlockPool, PrefixCache
from mlx_cairn.testing.engine_checks import (
    bare_sequence,
    closing_at_rest,
    greedy_base,
    greedy_reference,
    submit_together,
)
from mlx_cairn.testing.tiny_configs import HYBRID_CONFIGS
from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_model, tiny_zoo_model
from mlx_cairn.types import Done, Error

TIMEOUT = 120.0
SALT = "model\x00tenant"

# ------------------------------------------------------- scheduler, no model

BS = 4
PREFIX = [(7 * i) % 90 + 10 for i in range(40)]  # 10 full blocks


def _sched(budget: int) -> Scheduler:
    pool = BlockPool(num_blocks=128, block_size=BS)
    sched = Scheduler(pool, PrefixCache(pool, seed=3), max_batch=8, step_token_budget=budget)
    sched.join_min_tokens = 2 * BS
    return sched


def _group(n: int = 4, tail: int = 5) -> list[Sequence]:
    return [
        bare_sequence(i + 1, [*PREFIX, *range(200 + 10 * i, 200 + 10 * i + tail)], salt=SALT,
                      max_tokens=2)
        for i in range(n)
    ]  # fmt: skip


def _step(sched: Scheduler) -> dict[int, tuple[int, int]]:
    """One step as the engine runs it (blocks registered at launch, a sample appended
    once read back): each planned row's (start, n) by request id."""
    plan = sched.schedule()
    for r in plan.rows:
        r.seq.num_computed = r.start + r.n
        sched.register(r.seq)
    for seq in plan.sequences():
        if seq.num_computed == seq.num_tokens:
            seq.tokens.append(1)
            sched.register(seq)
            if not seq.wants_more:
                sched.finish(seq)
    return {r.seq.request_id: (r.start, r.n) for r in plan.rows}


def test_followers_wait_for_a_prefix_planned_in_the_same_step():
    sched = _sched(budget=512)
    seqs = _group()
    for s in seqs:
        sched.add(s)
    first = _step(sched)
    assert first == {1: (0, 45)}  # the budget had room for all: the others wait
    assert sched.join_waits == 3 and all(s.block_ids == [] for s in seqs[1:])
    leader_blocks = seqs[0].block_ids[:10]
    second = _step(sched)
    # Each follower takes the 10 prefix blocks by reference and computes its tail.
    for s in seqs[1:]:
        assert second[s.request_id] == (40, 5)
        assert s.cached_tokens == 40 and s.block_ids[:10] == leader_blocks
    while sched.has_work():
        _step(sched)
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1


def test_followers_join_a_chunked_prefill_chunk_by_chunk():
    sched = _sched(budget=16)
    seqs = _group()
    for s in seqs:
        sched.add(s)
    computed = {s.request_id: 0 for s in seqs}
    while sched.has_work():
        for rid, (start, n) in _step(sched).items():
            seq = next(s for s in seqs if s.request_id == rid)
            computed[rid] += max(0, min(start + n, seq.num_prompt) - start)
    assert computed == {1: 45, 2: 5, 3: 5, 4: 5}
    assert [s.cached_tokens for s in seqs] == [0, 40, 40, 40]
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1


def test_a_leader_that_leaves_releases_the_waiters():
    sched = _sched(budget=16)
    a, b, c = _group(3)
    for s in (a, b, c):
        sched.add(s)
    assert _step(sched) == {1: (0, 16)}
    assert _step(sched) == {1: (16, 16)}
    sched.remove(a)  # cancelled mid-prefill: its 8 computed blocks stay cached
    got = _step(sched)
    assert got == {2: (32, 13)}  # b takes them and computes the rest; c waits for b
    assert b.cached_tokens == 32 and c.block_ids == []
    while sched.has_work():
        _step(sched)
    assert c.cached_tokens == 40
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1


def test_a_preempted_leader_claims_nothing_until_readmitted():
    sched = _sched(budget=512)
    a, b = _group(2)
    sched.add(a)
    sched.add(b)
    assert {r.seq.request_id for r in sched.schedule().rows} == {1}
    sched.preempt(a)  # before its step launched: nothing of it is cached
    assert a.admit_hashes is None and sched.join_waits == 1
    # a is older: readmitted first, and b waits for it again.
    assert [(r.seq.request_id, r.start, r.n) for r in sched.schedule().rows] == [(1, 0, 45)]
    assert b.block_ids == [] and sched.join_waits == 2
    sched.remove(a)  # then cancelled: b computes the prefix itself
    assert [(r.seq.request_id, r.start, r.n) for r in sched.schedule().rows] == [(2, 0, 45)]
    sched.remove(b)
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1


def test_short_shared_prefixes_are_not_waited_for():
    sched = _sched(budget=512)
    sched.join_min_tokens = 64  # more than the 40 shared tokens
    seqs = _group(2)
    for s in seqs:
        sched.add(s)
    assert _step(sched) == {1: (0, 45), 2: (0, 45)}
    assert sched.join_waits == 0


# ------------------------------------------------------------ real engine

SHARED = [(11 * i) % 230 + 7 for i in range(200)]  # 12 blocks of 16, and 8 tokens
TAILS = [[(13 * i + 5 * k) % 200 + 20 for i in range(18 + 3 * k)] for k in range(4)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=9)


def _prepared(engine: Engine, prompt: list[int], **kw: object) -> PreparedRequest:
    base = greedy_base(engine, MAX_TOKENS)
    return dataclasses.replace(base, prompt_ids=list(prompt), **kw)


def _together(engine: Engine, prepared: list[PreparedRequest]) -> list[list]:
    streams = submit_together(engine, prepared)  # planned in the same steps
    events = [list(s.iter_sync(timeout=TIMEOUT)) for s in streams]
    return [[*ev, list(s.output_ids)] for ev, s in zip(events, streams, strict=True)]


@pytest.mark.parametrize(("budget", "shared"), [(512, 200), (64, 192)])
def test_four_together_compute_the_prefix_once(lm, budget, shared):
    prompts = [[*SHARED[:shared], *t] for t in TAILS]
    with closing_at_rest(
        Engine(lm, EngineConfig(num_blocks=128, block_size=16, step_token_budget=budget))
    ) as e:
        got = _together(e, [_prepared(e, p) for p in prompts])
        st = e.stats()
        for p, res in zip(prompts, got, strict=True):
            assert isinstance(res[-2], Done), res[-2]
            assert res[-1] == greedy_reference(lm, p, MAX_TOKENS)
        cached = [res[-2].usage.cached_tokens for res in got]
    # The leader computes all of its prompt; each follower takes the 12 shared blocks
    # (and, unchunked, copies the 8 shared rows of the 13th from the leader's: partial
    # reuse), then computes its own part. Unchunked, the followers wait a step for the
    # leader's blocks; chunked (the leader's prompt takes four steps), its chunks join
    # the cache as each launches, so the followers, admitted with its last one, find
    # them. (A shared part ending inside a block may cost a follower admitted in the
    # step that plans the leader's last shared block those few rows: fewer than
    # JOIN_MIN_TOKENS, not worth a wait; hence 192 here.)
    assert cached == [0] + [shared] * 3
    assert st.prefill_tokens == shared + sum(len(t) for t in TAILS)
    assert (st.prefix_join_waits >= 3) == (budget == 512)


def test_leader_cancelled_mid_prefill_leaves_followers_correct(lm):
    shared = [(17 * i) % 230 + 9 for i in range(320)]  # 20 blocks: five chunks of 64
    prompts = [[*shared, *t] for t in TAILS]
    with closing_at_rest(
        Engine(lm, EngineConfig(num_blocks=128, block_size=16, step_token_budget=64))
    ) as e:
        prepared = [_prepared(e, p) for p in prompts]
        leader: list[Sequence] = []

        def hook(phase: str, seq: Sequence) -> None:
            # Runs on the engine thread; the cancel applies before the next step.
            mine = phase == "schedule" and seq.request_id == leader_id
            if mine and not leader and seq.num_computed >= 128:
                leader.append(seq)
                e._cancel(seq.request_id)

        with e._lock:
            streams = [e.submit(p) for p in prepared]
            leader_id = e._inbox[0].request_id  # not taken by the engine while locked
            e._row_fault_hook = hook
        events = [list(s.iter_sync(timeout=TIMEOUT)) for s in streams]
        st = e.stats()
        e._row_fault_hook = None
        assert leader and isinstance(events[0][-1], Error) and events[0][-1].kind == "cancelled"
        for p, ev, s in zip(prompts[1:], events[1:], streams[1:], strict=True):
            assert isinstance(ev[-1], Done), ev[-1]
            assert list(s.output_ids) == greedy_reference(lm, p, MAX_TOKENS)
        # The leader computed 192 positions (the chunk planned with the cancel
        # included); the first follower takes them and computes the rest of the
        # prefix, the other two join it.
        assert [ev[-1].usage.cached_tokens for ev in events[1:]] == [192, 320, 320]
        assert st.prefill_tokens == len(shared) + sum(len(t) for t in TAILS[1:])


def test_leader_failing_mid_prefill_lets_the_waiter_compute_the_rest(lm):
    shared = [(19 * i) % 230 + 8 for i in range(700)]  # 43 blocks of 16, and 12 tokens
    prompts = [[*shared, *t] for t in TAILS]
    with closing_at_rest(
        Engine(lm, EngineConfig(num_blocks=256, block_size=16, step_token_budget=512))
    ) as e:
        prepared = [_prepared(e, p) for p in prompts]

        def hook(phase: str, seq: Sequence) -> None:
            # The leader's second chunk (the one the followers wait for) never launches.
            if phase == "launch" and seq.request_id == leader_id and seq.num_computed >= 512:
                raise RuntimeError("injected")

        with e._lock:
            streams = [e.submit(p) for p in prepared]
            leader_id = e._inbox[0].request_id
            e._row_fault_hook = hook
        events = [list(s.iter_sync(timeout=TIMEOUT)) for s in streams]
        st = e.stats()
        e._row_fault_hook = None
        assert isinstance(events[0][-1], Error), events[0][-1]
        for p, ev, s in zip(prompts[1:], events[1:], streams[1:], strict=True):
            assert isinstance(ev[-1], Done), ev[-1]
            assert list(s.output_ids) == greedy_reference(lm, p, MAX_TOKENS)
        # The first follower waited for the leader's second chunk, then computed it
        # itself past the leader's first 512 positions; the other two joined it.
        assert [ev[-1].usage.cached_tokens for ev in events[1:]] == [512, 700, 700]
        assert st.prefill_tokens == len(shared) + sum(len(t) for t in TAILS[1:])
        assert st.prefix_join_waits >= 3


def test_hybrid_followers_join_at_the_snapshot(lm):
    hy = tiny_zoo_model(next(iter(HYBRID_CONFIGS)), seed=4)
    shared = SHARED[:192]  # 12 blocks; the last user message starts there (a snapshot)
    prompts = [[*shared, *t] for t in TAILS]
    with closing_at_rest(
        Engine(hy, EngineConfig(num_blocks=128, block_size=16, step_token_budget=512))
    ) as e:
        got = _together(e, [_prepared(e, p, last_user_at=len(shared)) for p in prompts])
        st = e.stats()
    eos = set(hy.eos_token_ids)
    for p, res in zip(prompts, got, strict=True):
        assert isinstance(res[-2], Done), res[-2]
        assert res[-1] == mlx_lm_greedy(hy.model.inner, p, MAX_TOKENS, eos)
    assert [res[-2].usage.cached_tokens for res in got] == [0, 192, 192, 192]
    assert st.prefill_tokens == len(shared) + sum(len(t) for t in TAILS)
    assert st.state_snapshot_hits == 3 and st.prefix_join_waits >= 3
