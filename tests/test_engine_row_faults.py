"""A fault tied to one request fails that request only, at every engine phase."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.plan import StepPlan
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.types import ChatRequest, Done, Error, Message, SamplingParams, TextDelta
from scripted_model import say, scripted_model

TIMEOUT = 60.0
PHASES = ["schedule", "launch", "finalize", "update"]


def req(text: str) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", say(text))],
        max_tokens=64,
        sampling=SamplingParams(temperature=0.0),
    )


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("after", [0, 3], ids=["first-step", "mid-decode"])
def test_a_fault_tied_to_one_row_fails_that_row_only(phase: str, after: int) -> None:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=8))
    seen: dict[int, int] = {}

    def hook(at: str, seq: Any) -> None:
        if at == phase and seq.request_id == victim_id:
            seen[at] = seen.get(at, 0) + 1
            if seen[at] > after:
                raise RuntimeError(f"injected {phase} fault")

    try:
        texts = ["alpha beta gamma delta", "the victim row", "one two three four five"]
        with engine._lock:  # all three land in the same step
            streams = [engine.submit(req(t)) for t in texts]
        victim_id = streams[1].request_id
        engine._row_fault_hook = hook
        results = [list(s.iter_sync(TIMEOUT)) for s in streams]
        victim = results.pop(1)
        assert isinstance(victim[-1], Error) and f"injected {phase} fault" in victim[-1].message
        for events, text in zip(results, [texts[0], texts[2]], strict=True):
            assert isinstance(events[-1], Done), events[-1]
            assert text_of(events) == text
        assert engine.stats().requests_failed == 1
        engine._row_fault_hook = None
        again = list(engine.generate_sync(req("still serving"), timeout=TIMEOUT))
        assert isinstance(again[-1], Done) and text_of(again) == "still serving"
        assert_at_rest(engine)
    finally:
        engine.close()


def test_a_failing_launch_is_retried_row_by_row() -> None:
    """The runner itself raising for a batch: rows that run alone go on."""
    engine = Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=8))
    runner = engine._runner
    real = runner.execute

    def launch(plan: Any) -> Any:
        if any(s.request_id == victim_id for s in plan.sequences()):
            raise ValueError("Python integer out of bounds for int32")
        return real(plan)

    try:
        with engine._lock:
            streams = [engine.submit(req(t)) for t in ("first", "victim", "third")]
        victim_id = streams[1].request_id
        runner.execute = launch  # type: ignore[method-assign]
        results = [list(s.iter_sync(TIMEOUT)) for s in streams]
        assert isinstance(results[1][-1], Error)
        assert [text_of(results[0]), text_of(results[2])] == ["first", "third"]
        assert_at_rest(engine)
    finally:
        engine.close()


def test_a_failed_read_back_never_leaves_a_request_stuck() -> None:
    """The read-back of a step fails whole (a device failure) just after the next
    step admitted a second request: the second request's first token, still in
    flight, is lost with it. Every request still ends, and the engine goes on."""
    engine = Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=8))
    runner = engine._runner
    real = runner.read
    ids: dict[str, int] = {}

    def finalize(step: Any) -> Any:
        second = engine._seqs.get(ids.get("second", -1))
        rows = {r.seq.request_id for r in step.rows}
        if second is not None and second.t_admit > 0 and ids["first"] in rows - {second.request_id}:
            ids["second"] = -1  # once
            step.sampled = None  # nothing can be read back, not even row by row
            raise RuntimeError("device lost the step")
        return real(step)

    try:
        runner.read = finalize  # type: ignore[method-assign]
        first = engine.submit(req("word " * 60))
        ids["first"] = first.request_id
        while engine.stats().generated_tokens < 3:
            pass
        second = engine.submit(req("second request"))
        ids["second"] = second.request_id
        assert isinstance(list(first.iter_sync(TIMEOUT))[-1], Error)
        last = list(second.iter_sync(TIMEOUT))[-1]
        assert isinstance(last, Done), last
        assert ids["second"] == -1  # the fault did fire
        after = list(engine.generate_sync(req("after the fault"), timeout=TIMEOUT))
        assert text_of(after) == "after the fault"
        assert_at_rest(engine)
    finally:
        engine.close()


def test_a_plan_that_cannot_progress_waits_instead_of_spinning() -> None:
    """Queued work that no rule can plan or end: the loop sleeps until an event
    (here a cancel) instead of planning again and again."""
    engine = Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=8))
    sched = engine._scheduler
    real = sched.schedule
    calls = {"n": 0}

    def schedule(check=None):
        calls["n"] += 1
        return StepPlan()  # nothing can run

    try:
        sched.schedule = schedule  # type: ignore[method-assign]
        engine._update.unstick = lambda: None  # type: ignore[method-assign]
        stream = engine.submit(req("never planned"))
        deadline = time.monotonic() + TIMEOUT
        while calls["n"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert calls["n"] <= 2, f"the engine planned {calls['n']} times with nothing to run"
        stream.cancel()
        assert isinstance(list(stream.iter_sync(TIMEOUT))[-1], Error)
        sched.schedule = real  # type: ignore[method-assign]
        assert (
            text_of(list(engine.generate_sync(req("runs again"), timeout=TIMEOUT))) == "runs again"
        )
        assert_at_rest(engine)
    finally:
        engine.close()
