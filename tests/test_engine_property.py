"""Hypothesis: random arrival / cancel schedules never leak blocks, hang, or change tokens."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.engine import Engine
from mlx_cairn.engine.testing import assert_at_rest, greedy_reference
from mlx_cairn.errors import ContextLengthExceeded, QueueFull
from mlx_cairn.models.testing import tiny_model
from mlx_cairn.types import ChatRequest, Done, Error, Message, SamplingParams

#: Seconds a stream may stay silent before the test calls it a hang.
HANG = 30.0
MAX_TOKENS = 16
PROMPTS = [
    "Hi",
    "Hello world, how are you today?",
    "What is the capital of France? " * 2,
    "def add(x, y):\n    return x + y",
]


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=3)


_refs: dict[int, list[int]] = {}


def expected(lm, prompt: int, max_tokens: int) -> list[int]:
    if prompt not in _refs:
        ids = lm.prompt(request(prompt, MAX_TOKENS)).ids
        _refs[prompt] = greedy_reference(lm, ids, MAX_TOKENS)
    return _refs[prompt][:max_tokens]


def request(prompt: int, max_tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", PROMPTS[prompt])],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS)),
    st.tuples(st.just("cancel"), st.integers(0, 15), st.just(0)),
    st.tuples(st.just("sleep"), st.sampled_from([0, 1, 3]), st.just(0)),
)
config = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(6, 40),
        "block_size": st.sampled_from([2, 4, 8]),
        "max_batch": st.integers(1, 4),
        "max_queue": st.integers(1, 6),
        "step_token_budget": st.integers(1, 32),
    }
)


@given(cfg=config, ops=st.lists(op, min_size=1, max_size=14))
def test_random_schedules_never_leak_or_hang(lm, cfg, ops):
    engine = Engine(lm, **cfg)
    try:
        streams = []  # (stream, prompt, max_tokens)
        cancelled: set[int] = set()
        for kind, a, b in ops:
            if kind == "submit":
                with contextlib.suppress(QueueFull, ContextLengthExceeded):
                    streams.append((engine.submit(request(a, b)), a, b))
            elif kind == "cancel" and streams:
                i = a % len(streams)
                streams[i][0].cancel()
                cancelled.add(i)
            elif kind == "sleep":
                time.sleep(a / 1000)
        for i, (s, prompt, max_tokens) in enumerate(streams):
            events = list(s.iter_sync(timeout=HANG))
            last = events[-1]
            if isinstance(last, Error):
                assert i in cancelled and last.kind == "cancelled", last
            else:
                assert isinstance(last, Done)
                assert s.output_ids == expected(lm, prompt, max_tokens)
        assert_at_rest(engine, timeout=HANG)
    finally:
        engine.close()
