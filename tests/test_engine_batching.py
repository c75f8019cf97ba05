"""Engine: paged, batched greedy decoding equals the one-sequence reference loop."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from mlx_cairn.engine import Engine
from mlx_cairn.errors import QueueFull
from mlx_cairn.testing.engine_checks import (
    engines_at_rest,
    greedy_reference,
    reference_ids,
    submit_together,
)
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Done, Error, Message, SamplingParams, TextDelta

TIMEOUT = 60.0

PROMPTS = [
    "Hi",
    "Hello world, how are you today? I am fine",
    "What is the capital of France? " * 3,
    "def add(x, y):\n    return x + y",
    "ünïcode ✓ 日本語 😀",
]


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=0)


def greedy(text: str, max_tokens: int = 24, system: str | None = None, **kw) -> ChatRequest:
    msgs = [Message("system", system)] if system else []
    return ChatRequest(
        messages=[*msgs, Message("user", text)],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        **kw,
    )


_REFS: dict[tuple[int, ...], list[int]] = {}


def reference(lm, engine: Engine, req: ChatRequest) -> list[int]:
    ids = engine.prepare(req).prompt_ids
    key = (*ids, -1, req.max_tokens)
    if key not in _REFS:
        _REFS[key] = greedy_reference(lm, ids, req.max_tokens)
    return _REFS[key]


def drain(stream) -> list:
    events = list(stream.iter_sync(timeout=TIMEOUT))
    assert events and isinstance(events[-1], (Done, Error)), events[-1:]
    return events


def wait_for(cond, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture
def make_engine(lm):
    with engines_at_rest(lm, num_blocks=256, block_size=4) as make:
        yield make


@pytest.mark.parametrize("budget", [8, 512])
def test_mixed_length_batch_matches_reference(lm, make_engine, budget):
    engine = make_engine(step_token_budget=budget)
    reqs = [greedy(p) for p in PROMPTS]
    streams = [engine.submit(r) for r in reqs]
    for req, s in zip(reqs, streams, strict=True):
        done = drain(s)[-1]
        assert isinstance(done, Done)
        assert s.output_ids == reference(lm, engine, req)
        assert done.usage.output_tokens == len(s.output_ids)
        assert done.usage.input_tokens == engine.count_tokens(req)


def test_text_events_decode_the_tokens(lm, make_engine):
    engine = make_engine()
    req = greedy(PROMPTS[1], max_tokens=30)
    s = engine.submit(req)
    events = drain(s)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    ids = s.output_ids
    if ids and ids[-1] in lm.eos_token_ids:
        ids = ids[:-1]
    assert text == lm.tokenizer.decode(ids)


def test_prefix_hit_reports_reused_tokens_and_same_tokens(lm, make_engine):
    system = "You are a careful assistant. " * 6
    first = greedy("What is the capital of France?", system=system)
    second = greedy("Hello world, how are you?", system=system)
    engine = make_engine()
    d1 = drain(engine.submit(first))[-1]
    assert d1.usage.cached_tokens == 0
    s2 = engine.submit(second)
    d2 = drain(s2)[-1]
    shared = 0
    a, b = engine.prepare(first).prompt_ids, engine.prepare(second).prompt_ids
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert d2.usage.cached_tokens == (shared // engine.block_size) * engine.block_size
    assert d2.usage.cached_tokens >= 40
    assert engine.stats().prefix_hit_tokens >= d2.usage.cached_tokens
    assert s2.output_ids == reference(lm, engine, second)
    # The same request on a cold engine computes the same tokens.
    cold = make_engine()
    s3 = cold.submit(second)
    assert drain(s3)[-1].usage.cached_tokens == 0
    assert s3.output_ids == s2.output_ids


def test_identical_prompt_is_served_from_cache_but_computes_last_token(lm, make_engine):
    engine = make_engine()
    req = greedy(PROMPTS[2])
    s1 = engine.submit(req)
    drain(s1)
    s2 = engine.submit(req)
    d2 = drain(s2)[-1]
    n = engine.count_tokens(req)
    assert 0 < d2.usage.cached_tokens < n
    assert s1.output_ids == s2.output_ids == reference(lm, engine, req)


def test_cache_salt_separates_tenants(lm, make_engine):
    engine = make_engine()
    drain(engine.submit(greedy(PROMPTS[2], cache_salt="a")))
    other = drain(engine.submit(greedy(PROMPTS[2], cache_salt="b")))[-1]
    assert other.usage.cached_tokens == 0
    same = drain(engine.submit(greedy(PROMPTS[2], cache_salt="a")))[-1]
    assert same.usage.cached_tokens > 0


def test_arrivals_mid_decode(lm, make_engine):
    engine = make_engine(step_token_budget=16)
    first = engine.submit(greedy(PROMPTS[1], max_tokens=40))
    wait_for(lambda: engine.stats().generated_tokens >= 5)
    later = [engine.submit(greedy(p)) for p in PROMPTS[2:]]
    assert isinstance(drain(first)[-1], Done)
    assert first.output_ids == reference(lm, engine, greedy(PROMPTS[1], max_tokens=40))
    for p, s in zip(PROMPTS[2:], later, strict=True):
        drain(s)
        assert s.output_ids == reference(lm, engine, greedy(p))


def test_preemption_in_a_tiny_pool(lm, make_engine):
    # 24 usable blocks of 4 tokens: five ~40-token sequences cannot all fit.
    # No decode share: rows side by side (the share may let one finish first).
    engine = make_engine(num_blocks=25, step_token_budget=16, decode_share=0)
    reqs = [greedy(p, max_tokens=32) for p in PROMPTS]
    streams = submit_together(engine, reqs)  # they meet in the pool
    for req, s in zip(reqs, streams, strict=True):
        assert isinstance(drain(s)[-1], Done)
        assert s.output_ids == reference(lm, engine, req)
    assert engine.stats().preemptions > 0


def test_cancelled_neighbour(lm, make_engine):
    engine = make_engine()
    reqs = [greedy(p, max_tokens=40) for p in PROMPTS[:3]]
    streams = [engine.submit(r) for r in reqs]
    wait_for(lambda: engine.stats().generated_tokens >= 6)
    streams[1].cancel()
    for i in (0, 2):
        assert isinstance(drain(streams[i])[-1], Done)
        assert streams[i].output_ids == reference(lm, engine, reqs[i])
    last = drain(streams[1])[-1]
    assert isinstance(last, (Error, Done))
    if isinstance(last, Error):
        assert last.kind == "cancelled"
    assert engine.stats().requests_cancelled <= 1


def test_queue_cap_and_cancel_of_a_waiting_request(lm, make_engine):
    engine = make_engine(max_queue=2, max_batch=1)
    gate = threading.Event()
    engine._fault_hook = lambda: gate.wait(TIMEOUT)
    running = engine.submit(greedy(PROMPTS[0]))
    wait_for(lambda: engine.stats().queue_depth == 0)  # admitted, held in its first step
    queued = [engine.submit(greedy(p)) for p in PROMPTS[1:3]]
    with pytest.raises(QueueFull):
        engine.submit(greedy(PROMPTS[3]))
    # Cancels apply between steps: this one lands while queued[0] still waits.
    queued[0].cancel()
    engine._fault_hook = None
    gate.set()
    wait_for(lambda: engine.stats().queue_depth <= 1)
    extra = engine.submit(greedy(PROMPTS[3]))
    for s in (running, queued[1], extra):
        assert isinstance(drain(s)[-1], Done)
    last = drain(queued[0])[-1]
    assert isinstance(last, Error) and last.kind == "cancelled"
    assert queued[0].output_ids == []


def test_seeded_sampling_is_independent_of_batch_neighbours(lm, make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    req = ChatRequest(messages=[Message("user", PROMPTS[1])], max_tokens=24, sampling=params)
    alone = engine.submit(req)
    drain(alone)
    noisy = [
        engine.submit(
            ChatRequest(
                messages=[Message("user", p)],
                max_tokens=24,
                sampling=SamplingParams(temperature=1.0, seed=i),
            )
        )
        for i, p in enumerate(PROMPTS)
    ]
    again = engine.submit(req)
    for s in noisy:
        drain(s)
    drain(again)
    assert again.output_ids == alone.output_ids
    # ... and what the one-sequence reference loop samples with the same seed.
    ids = engine.prepare(req).prompt_ids
    assert alone.output_ids == reference_ids(lm, ids, 24, params)
    other_seed = engine.submit(
        ChatRequest(
            messages=[Message("user", PROMPTS[1])],
            max_tokens=24,
            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=99),
        )
    )
    drain(other_seed)
    assert other_seed.output_ids != alone.output_ids


def test_decode_never_stalls_behind_a_long_prefill(lm, make_engine):
    engine = make_engine(step_token_budget=16)
    trace: list[dict[int, int]] = []  # per step: request arrival -> tokens computed so far
    engine._fault_hook = lambda: trace.append(
        {s.arrival: s.num_computed for s in engine._scheduler.running}
    )
    a = engine.submit(greedy(PROMPTS[0], max_tokens=60))
    wait_for(lambda: engine.stats().generated_tokens >= 2)
    long_prompt = greedy("word " * 150, max_tokens=4)
    b = engine.submit(long_prompt)
    drain(b)
    drain(a)
    assert a.output_ids == reference(lm, engine, greedy(PROMPTS[0], max_tokens=60))
    ids_a, ids_b = a.request_id, b.request_id
    prompt_b = engine.count_tokens(long_prompt)
    prefill_steps = 0
    for before, after in itertools.pairwise(trace):
        if ids_b in before and before[ids_b] < prompt_b and ids_a in after:
            prefill_steps += 1
            assert after[ids_a] == before[ids_a] + 1  # A decoded in that step too
            assert after.get(ids_b, 0) - before[ids_b] <= 15  # B got the rest of the budget
    assert prefill_steps >= prompt_b // 15 - 1
