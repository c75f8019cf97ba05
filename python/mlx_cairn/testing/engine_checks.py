"""Helpers for engine tests: the reference loop's tokens and an at-rest check.

Example::

    ref = greedy_reference(lm, prompt_ids, max_tokens=16)   # engine/reference.py, one row
    out = [ev for ev in engine.generate_sync(req)]
    assert_at_rest(engine)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mlx_cairn.engine.reference import generate_ids
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.types import SamplingParams


def greedy_reference(lm: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the one-sequence reference loop (EOS, if sampled, is kept)."""
    return reference_ids(lm, prompt_ids, max_tokens, SamplingParams(temperature=0.0))


def greedy_reference_at(lm: Any, prompt_ids: list[int], max_tokens: int, **kv: Any) -> list[int]:
    """Greedy tokens for the KV settings ``kv`` (``kv_bits``, ``kv_group_size``): the
    reference loop at full precision; with quantized KV, which the loop does not
    model, a fresh engine's answer to the request alone, with room to spare (so
    shared, copied, preempted or speculated rows must read the same packed rows)."""
    if not kv.get("kv_bits"):
        return greedy_reference(lm, prompt_ids, max_tokens)
    import dataclasses

    from mlx_cairn.engine import Engine, EngineConfig
    from mlx_cairn.types import ChatRequest, Done, Message

    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=256, block_size=16, **kv))) as engine:
        base = engine.prepare(
            ChatRequest(messages=[Message("user", "x")], sampling=SamplingParams(0.0))
        )
        stream = engine.submit(
            dataclasses.replace(base, prompt_ids=list(prompt_ids), max_tokens=max_tokens)
        )
        assert isinstance(list(stream.iter_sync(timeout=60.0))[-1], Done)
        return list(stream.output_ids)


def reference_ids(
    lm: Any, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams
) -> list[int]:
    """Tokens of :mod:`mlx_cairn.engine.reference` (contiguous cache, one row) for ``sampling``."""
    return generate_ids(
        lm.model,
        prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        eos_token_ids=lm.eos_token_ids,
    )


def bare_sequence(rid: int, prompt: list[int], *, salt: str, max_tokens: int) -> Any:
    """A greedy :class:`~mlx_cairn.engine.sequence.Sequence` with no stream, for
    scheduler tests that run without a model (arrival order = ``rid``)."""
    from mlx_cairn.engine.request import PreparedRequest
    from mlx_cairn.engine.sequence import Sequence
    from mlx_cairn.types import ChatRequest, Message

    prepared = PreparedRequest(
        request=ChatRequest(messages=[Message("user", "x")], max_tokens=max_tokens),
        prompt_ids=list(prompt),
        parser_family=None,
        reasoning=False,
        in_reasoning=False,
        salt=salt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, seed=0),
    )
    return Sequence(
        request_id=rid,
        prepared=prepared,
        stream=None,  # type: ignore[arg-type]
        tokens=list(prompt),
        arrival=rid,
    )


def greedy_base(engine: Any, max_tokens: int = 256) -> Any:
    """A prepared greedy request on ``engine`` whose prompt ids a test replaces
    (``dataclasses.replace(base, prompt_ids=...)``)."""
    from mlx_cairn.types import ChatRequest, Message

    request = ChatRequest(
        messages=[Message("user", "x")],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )
    return engine.prepare(request)


def generate_from_ids(
    engine: Any, prompt: list[int], *, max_tokens: int, timeout: float
) -> tuple[list[int], Any]:
    """Greedy generation from the token ids ``prompt`` on a running engine (the
    request's own prompt replaced); returns (output ids, the final Done)."""
    import dataclasses

    from mlx_cairn.types import Done

    base = greedy_base(engine, max_tokens)
    s = engine.submit(dataclasses.replace(base, prompt_ids=prompt))
    done = list(s.iter_sync(timeout=timeout))[-1]
    assert isinstance(done, Done), done
    return s.output_ids, done


def submit_together(engine: Any, requests: Any) -> list[Any]:
    """Submit ``requests`` (chat or already prepared) so that the engine meets them all
    at its next step, however slow the machine: each is templated first, then all are
    queued under the engine's lock. Returns their streams."""
    from mlx_cairn.engine.request import PreparedRequest

    prepared = [r if isinstance(r, PreparedRequest) else engine.prepare(r) for r in requests]
    with engine._lock:
        return [engine.submit(p) for p in prepared]


def wait_idle(engine: Any, timeout: float = 30.0) -> EngineStats:
    """Wait until the engine has nothing queued or running; return its stats."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        if st.queue_depth == 0 and st.running == 0 and st.waiting == 0:
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not idle after {timeout}s: {st}")
        time.sleep(0.01)


def assert_at_rest(engine: Any, timeout: float = 30.0) -> EngineStats:
    """Every block is free or cached and none is referenced (checked on the engine's pool)."""
    st = wait_idle(engine, timeout)
    pool = engine._pool
    # The stats snapshot follows the last step; the engine thread is idle now,
    # so reading refcounts here races with nothing.
    if hasattr(pool, "check_invariants"):
        pool.check_invariants()
    held = [b for b in range(1, pool.num_blocks) if pool.refcount(b) != 0]
    assert not held, f"blocks still referenced at rest: {held[:20]}"
    assert pool.num_free_blocks == pool.num_blocks - 1, (pool.num_free_blocks, pool.num_blocks)
    assert st.blocks_in_use == 0, st
    announced = getattr(engine, "_announced", 0)
    assert announced == 0, f"{announced} announced request(s) never submitted nor given up"
    assert engine._pools.mirror is None, "a decode mirror outlived its rows"
    states = engine._scheduler.states
    if states is not None:  # recurrent-state slots: only snapshots hold any
        free = list(states._free)
        snaps = [s.slot for s in states._snapshots.values()]
        assert len(set(free)) == len(free), "a state slot is free twice"
        assert not set(free) & set(snaps), "a snapshot's slot is also free"
        for h, snap in states._snapshots.items():  # none outlives its prefix's blocks
            assert engine._cache.block_hash(snap.block_id) == h, ("stale snapshot", snap)
        assert sorted(free + snaps) == list(range(1, states.num_slots)), (
            "state slots still held at rest",
            sorted(set(range(1, states.num_slots)) - set(free) - set(snaps)),
        )
    return st


@contextmanager
def engines_at_rest(loaded: Any, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """A factory of engines over ``loaded`` taking ``EngineConfig`` options as keywords
    (``defaults`` for those not given);
    at exit each engine is checked at rest, then closed (a pytest fixture's body)::

        with engines_at_rest(lm, num_blocks=256, block_size=4) as make:
            yield make
    """
    from mlx_cairn.engine import Engine, EngineConfig

    engines: list[Any] = []

    def make(**kw: Any) -> Any:
        engine = Engine(loaded, EngineConfig(**{**defaults, **kw}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        try:
            assert_at_rest(engine)
        finally:
            engine.close()


@contextmanager
def closing_at_rest(engine: Any) -> Iterator[Any]:
    """Yield ``engine``; on a clean exit check it is at rest, then always close it."""
    try:
        yield engine
        assert_at_rest(engine)
    finally:
        engine.close()
