"""Hypothesis: random arrival / cancel schedules never leak blocks, hang, or change tokens."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import ContextLengthExceeded, QueueFull
from mlx_cairn.testing.engine_checks import assert_at_rest, greedy_reference
from mlx_cairn.testing.tiny_models import tiny_model, tiny_zoo_model
from mlx_cairn.types import ChatRequest, Done, Error, Message, SamplingParams

#: Seconds a stream may stay silent before the test calls it a hang.
HANG = 30.0
MAX_TOKENS = 16
PROMPTS = [
    "Hi",
    "Hello world, how are you today?",
    "What is the capital of France? " * 2,
    "def add(x, y):\n    return x + y",
    # Repeated text: prompt lookup proposes drafts (and some are accepted).
    "one two three four five six seven eight nine ten. one two three four five six",
]


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "llama-ngram", "llama-draft"])
def case(request):
    # An attention model, a hybrid whose recurrent state lives in state slots, and
    # the attention model with speculative decoding (verify rows and rollbacks) by
    # prompt lookup and by a draft model (its weights with noise: some drafts rejected).
    if request.param == "llama":
        return tiny_model("llama", seed=3), {}
    if request.param == "llama-ngram":
        return tiny_model("llama", seed=3), {"speculative": "ngram"}
    if request.param == "llama-draft":
        return tiny_model("llama", seed=3), {"draft_model": tiny_model("llama", seed=3, noise=0.05)}
    return tiny_zoo_model(request.param, seed=3), {}


@pytest.fixture(scope="module")
def lm(case):
    return case[0]


_refs: dict[tuple[str, int], list[int]] = {}


def expected(lm, prompt: int, max_tokens: int) -> list[int]:
    key = (lm.name, prompt)
    if key not in _refs:
        ids = lm.prompt(request(prompt, MAX_TOKENS)).ids
        _refs[key] = greedy_reference(lm, ids, MAX_TOKENS)
    return _refs[key][:max_tokens]


def request(prompt: int, max_tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", PROMPTS[prompt])],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


PHASES = ["schedule", "launch", "sample", "finalize", "update", "detokenize", "push"]

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS)),
    st.tuples(st.just("cancel"), st.integers(0, 15), st.just(0)),
    st.tuples(st.just("sleep"), st.sampled_from([0, 1, 3]), st.just(0)),
)
#: (phase, request index, which call of that phase for that request fails)
fault = st.tuples(st.sampled_from(PHASES), st.integers(0, 15), st.integers(0, 6))


class HostMask:
    """A row mask that needs each token on the host and allows everything (the
    grammar path without changing any token)."""

    needs_host_token = True

    def mask(self, seq, vocab):
        assert not seq.inflight
        return None


class Faults:
    """A row fault hook: the n-th call of a phase for a given request raises, once."""

    def __init__(self, plan: list[tuple[str, int, int]]) -> None:
        self.plan = plan
        self.ids: list[int] = []  # request id per submitted index
        self.calls: dict[tuple[str, int], int] = {}
        self.hit: set[int] = set()  # request ids that got a fault

    def __call__(self, phase: str, seq) -> None:
        key = (phase, seq.request_id)
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        for p, i, k in self.plan:
            if p == phase and i < len(self.ids) and self.ids[i] == seq.request_id and k == n:
                self.hit.add(seq.request_id)
                raise RuntimeError(f"injected {phase} fault")


config = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(6, 40),
        "block_size": st.sampled_from([2, 4, 8]),
        "max_batch": st.integers(1, 4),
        "max_queue": st.integers(1, 6),
        "step_token_budget": st.integers(1, 32),
    }
)


@given(
    cfg=config,
    ops=st.lists(op, min_size=1, max_size=14),
    faults=st.lists(fault, max_size=4),
)
def test_random_schedules_never_leak_or_hang(case, lm, cfg, ops, faults):
    """Random arrivals, cancels and faults in any phase of any row: faulted rows end
    with an internal error, every other row gets exactly the reference tokens."""
    engine = Engine(lm, EngineConfig(**cfg, **case[1]))
    hook = Faults(faults)
    engine._row_fault_hook = hook
    try:
        streams = []  # (stream, prompt, max_tokens)
        cancelled: set[int] = set()
        for kind, a, b in ops:
            if kind == "submit":
                with contextlib.suppress(QueueFull, ContextLengthExceeded):
                    with engine._lock:  # its id is known before the engine sees it
                        s = engine.submit(request(a, b))
                        hook.ids.append(s.request_id)
                        if (a + b) % 2 == 0:  # half the rows sample after a host read
                            engine._inbox[-1].row_masks.append(HostMask())
                    streams.append((s, a, b))
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
                faulted = s.request_id in hook.hit and last.kind == "internal"
                assert faulted or (i in cancelled and last.kind == "cancelled"), last
            else:
                assert isinstance(last, Done)
                assert s.output_ids == expected(lm, prompt, max_tokens)
        assert_at_rest(engine, timeout=HANG)
    finally:
        engine.close()
