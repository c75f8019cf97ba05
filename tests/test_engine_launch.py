"""Engine: the order of a step's halves, mixed steps' pool updates, and gathering a burst.

- ``apply_first`` (the CPU default): step n is read back and its tokens sent
  before step n+1 is queued; launch-first queues n+1 before reading n back.
  Both give the reference tokens.
- A step with several forward calls (decode rows and prefill chunks) updates
  the KV pools in place: their buffers never move (a copy of every pool made
  such a step ~4x slower on this CPU).
- ``announce``: an idle engine's first step waits for announced requests, so a
  burst is prefilled in one step; handles are idempotent and never leak.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine import model_runner as runner_mod
from mlx_cairn.testing.engine_checks import engines_at_rest, greedy_reference
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=0)


def greedy(text: str, max_tokens: int = 12) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", text)],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def drain(stream) -> list:
    events = list(stream.iter_sync(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1:]
    return events


@pytest.fixture
def make_engine(lm):
    with engines_at_rest(lm, num_blocks=128, block_size=4) as make:
        yield make


def record_plans(engine: Engine) -> list[tuple[int, int]]:
    """(decode rows, prefill chunks) of every step the engine executes from now on."""
    plans: list[tuple[int, int]] = []
    execute = engine._runner.execute

    def wrapped(plan):
        plans.append((len(plan.decode), len(plan.prefill)))
        return execute(plan)

    engine._runner.execute = wrapped  # type: ignore[method-assign]
    return plans


def test_apply_first_is_the_cpu_default(make_engine):
    assert mx.default_device().type == mx.DeviceType.cpu
    assert make_engine().apply_first is True
    assert make_engine(apply_first=False).apply_first is False


class _QueueLog:
    """``mlx.core`` as runner.py sees it, logging each ``async_eval``."""

    def __init__(self, log: list[str]) -> None:
        self._log = log

    def async_eval(self, *arrays: Any) -> None:
        self._log.append("queue")
        mx.async_eval(*arrays)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


@pytest.mark.parametrize("apply_first", [True, False])
def test_step_order(lm, make_engine, monkeypatch, apply_first):
    """Apply first: queue(1) apply(1) queue(2) apply(2) ...; launch first: queue(1)
    queue(2) apply(1) queue(3) apply(2) ... Same tokens either way."""
    log: list[str] = []
    monkeypatch.setattr(runner_mod, "mx", _QueueLog(log))
    engine = make_engine(apply_first=apply_first)
    apply = engine._apply

    def logged_apply(out):
        log.append("apply")
        apply(out)

    engine._apply = logged_apply  # type: ignore[method-assign]
    req = greedy("Hello world, how are you today?", max_tokens=6)
    stream = engine.submit(req)
    drain(stream)
    ids = engine.prepare(req).prompt_ids
    assert stream.output_ids == greedy_reference(lm, ids, 6)
    assert log.count("queue") >= 3 and log.count("apply") >= 3, log
    doubled = any(a == b == "queue" for a, b in itertools.pairwise(log))
    if apply_first:
        assert log[:4] == ["queue", "apply", "queue", "apply"], log
        assert not doubled, log
    else:
        assert log[:3] == ["queue", "queue", "apply"], log


def _addresses(arrays: list[mx.array]) -> tuple[int, ...]:
    out = []
    for a in arrays:
        view = np.asarray(memoryview(a))  # evaluates it; dropped at once (a live view pins it)
        out.append(view.ctypes.data)
        del view
    return tuple(out)


@pytest.mark.parametrize("apply_first", [True, False])
def test_mixed_steps_update_the_pools_in_place(lm, make_engine, apply_first):
    """Decode rows and new prompts in one step: both forward calls write the pools in place."""
    engine = make_engine(apply_first=apply_first)
    seen: list[tuple[int, ...]] = []
    pools = engine._pools
    engine._fault_hook = lambda: seen.append(_addresses([*pools.k, *pools.v]))
    plans = record_plans(engine)
    late = [
        greedy("Hello world, how are you today? I am fine"),
        greedy("def add(x, y):\n    return x + y"),
    ]
    ready = [engine.prepare(r) for r in late]  # templated now: submitted in a moment below
    first = engine.submit(greedy("A first request that decodes for a while", max_tokens=16))
    it = first.iter_sync(timeout=TIMEOUT)
    next(it)  # it is decoding now
    streams = [engine.submit(r) for r in ready]
    assert isinstance(list(it)[-1], Done)
    for r, s in zip(late, streams, strict=True):
        drain(s)
        assert s.output_ids == greedy_reference(lm, engine.prepare(r).prompt_ids, r.max_tokens)
    assert any(d and p for d, p in plans), f"no step mixed decode and prefill: {plans}"
    assert len(set(seen)) == 1, "a step moved the KV pools (copied them) instead of updating them"


@pytest.mark.parametrize("apply_first", [True, False])
def test_decode_steps_write_their_mirror_in_place(lm, make_engine, apply_first):
    """Consecutive decode steps of the same rows attend over one mirror, written in place."""
    engine = make_engine(apply_first=apply_first)
    pools = engine._pools
    pools.mirror_min_positions = 0  # the default spares short rows the mirror
    seen: list[tuple[int, tuple[int, ...]]] = []

    def hook() -> None:  # before each step's forward calls: the last step's mirror
        if (m := pools.mirror) is not None:
            seen.append((id(m), _addresses(m.arrays())))

    engine._fault_hook = hook
    req = greedy("Tell me a story about a cat", max_tokens=24)
    stream = engine.submit(req)
    drain(stream)
    assert stream.output_ids == greedy_reference(lm, engine.prepare(req).prompt_ids, 24)
    assert len(seen) >= 20, seen
    assert len(set(seen)) == 1, "a decode step rebuilt or copied its mirror"
    assert pools.mirror is None  # dropped once the engine went idle


def test_rows_that_leave_and_join_rebuild_the_mirror(lm, make_engine):
    """A decode mirror follows its rows: one ending or arriving makes the next call rebuild it."""
    engine = make_engine()
    pools = engine._pools
    pools.mirror_min_positions = 0
    built: list[int] = []
    mirror_for = pools.mirror_for

    def recording(rows, starts):
        before = pools.mirror
        got = mirror_for(rows, starts)
        if got is not None and got is not before:
            built.append(len(rows))
        return got

    pools.mirror_for = recording
    reqs = [
        greedy(f"Request number {i} says hello", max_tokens=n) for i, n in enumerate((4, 9, 14))
    ]
    streams = [engine.submit(r) for r in reqs]
    it = streams[0].iter_sync(timeout=TIMEOUT)
    next(it)  # decoding now
    late = greedy("A late one, joining the others", max_tokens=8)
    streams.append(engine.submit(late))
    assert isinstance(list(it)[-1], Done)
    for r, s in zip([*reqs, late], streams, strict=True):
        if s is not streams[0]:
            drain(s)
        assert s.output_ids == greedy_reference(lm, engine.prepare(r).prompt_ids, r.max_tokens)
    assert len(built) >= 3, built  # at least: first rows, a row leaving, the late one joining
    assert pools.mirror is None


def test_an_idle_engine_gathers_announced_requests(make_engine):
    engine = make_engine(gather_s=10.0)
    plans = record_plans(engine)
    done_a, done_b = engine.announce(), engine.announce()
    a = engine.submit(greedy("The first of a burst"))
    done_a()
    time.sleep(0.2)  # the engine is waiting for b, which is still being "prepared"
    assert plans == []
    b = engine.submit(greedy("The second of a burst, a little later"))
    done_b()
    drain(a)
    drain(b)
    assert plans[0] == (0, 2), plans  # both prompts in the first step


def test_gathering_is_bounded_and_handles_never_leak(make_engine):
    engine = make_engine(gather_s=0.05)
    stuck = engine.announce()  # announced, never submitted: the engine waits 50 ms, not forever
    drain(engine.submit(greedy("Alone")))
    assert engine._announced == 1
    stuck()
    stuck()  # idempotent
    assert engine._announced == 0
    dropped = engine.announce()
    assert engine._announced == 1
    del dropped
    gc.collect()
    assert engine._announced == 0
    handles = [engine.announce() for _ in range(64)]
    threads = [threading.Thread(target=h) for h in handles for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine._announced == 0


@pytest.mark.parametrize("bad", [-1, 11, "1", None])
def test_gather_s_is_checked(lm, bad):
    with pytest.raises(ValueError, match="gather_s"):
        Engine(lm, EngineConfig(num_blocks=16, gather_s=bad))
