"""The reasoning budget: after N reasoning tokens the engine closes the block itself."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.reasoning import ReasoningBudget
from mlx_cairn.protocol.anthropic import EFFORT_REASONING, parse_messages_request
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.types import (
    Admitted,
    ChatRequest,
    Done,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
)
from scripted_model import say, scripted_model

TIMEOUT = 60.0
LONG_THOUGHT = "<think>" + "step " * 40 + "</think>The answer."


@pytest.fixture(scope="module")
def engine() -> Any:
    with closing_at_rest(Engine(scripted_model(), EngineConfig(num_blocks=512, block_size=8))) as e:
        yield e


def run(engine: Engine, text: str, **kw: Any) -> tuple[list[Any], Done, list[int]]:
    kw.setdefault("max_tokens", 200)
    req = ChatRequest(
        messages=[Message("user", say(text))], sampling=SamplingParams(temperature=0.0), **kw
    )
    stream = engine.submit(req)
    events = list(stream.iter_sync(TIMEOUT))
    assert isinstance(events[0], Admitted)
    assert isinstance(events[-1], Done), events[-1]
    return events[1:-1], events[-1], stream.output_ids


def texts(events: list[Any], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_tracker_counts_inside_the_block_only() -> None:
    rb = ReasoningBudget(budget=3, open_ids=[7], close_ids=[8, 9], in_reasoning=False)
    assert [rb.push(t) for t in (1, 2, 7, 4, 5)] == [None] * 5
    assert rb.push(6) == [8, 9]  # three tokens inside the block
    assert rb.closed and rb.push(4) is None
    own = ReasoningBudget(budget=3, open_ids=[7], close_ids=[8, 9], in_reasoning=True)
    assert [own.push(t) for t in (4, 8, 9, 5, 5, 5)] == [None] * 6  # the model closed it


@pytest.mark.parametrize("budget", [1, 5, 17])
def test_budget_closes_reasoning_and_the_answer_follows(engine: Engine, budget: int) -> None:
    tok = engine.loaded.tokenizer
    close = tok.encode("</think>")
    free, _, free_ids = run(engine, LONG_THOUGHT, reasoning=True)
    events, done, ids = run(engine, LONG_THOUGHT, reasoning=True, reasoning_budget=budget)
    # The open tag, then exactly `budget` reasoning tokens, then the forced close.
    assert ids[: 1 + budget] == free_ids[: 1 + budget]
    assert ids[1 + budget : 1 + budget + len(close)] == close
    assert texts(events, ReasoningDelta) == tok.decode(ids[1 : 1 + budget])
    assert texts(free, ReasoningDelta).startswith(texts(events, ReasoningDelta))
    assert texts(events, TextDelta)  # the answer came after the forced close
    assert done.stop_reason == "end_turn"
    assert done.usage.output_tokens == len(ids)


def test_budget_larger_than_the_thought_changes_nothing(engine: Engine) -> None:
    free, _, free_ids = run(engine, LONG_THOUGHT, reasoning=True)
    events, _, ids = run(engine, LONG_THOUGHT, reasoning=True, reasoning_budget=1000)
    assert ids == free_ids and events == free


def test_budget_without_reasoning_is_ignored(engine: Engine) -> None:
    events, _, _ = run(engine, "plain answer", reasoning=False, reasoning_budget=2)
    assert texts(events, TextDelta) == "plain answer"


def test_budget_never_overruns_max_tokens(engine: Engine) -> None:
    _, done, ids = run(engine, LONG_THOUGHT, reasoning=True, reasoning_budget=5, max_tokens=6)
    assert done.stop_reason == "max_tokens" and len(ids) == 6


def anthropic(**body: Any) -> Any:
    base = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    return parse_messages_request(base | body, max_tokens_limit=128000)


def test_anthropic_thinking_and_effort_mapping() -> None:
    r = anthropic(thinking={"type": "enabled", "budget_tokens": 1024})
    assert (r.chat.reasoning, r.show_thinking, r.chat.reasoning_budget) == (True, True, 1024)
    r = anthropic(thinking={"type": "adaptive", "display": "summarized"})
    assert (r.chat.reasoning, r.show_thinking, r.chat.reasoning_budget) == (None, True, None)
    r = anthropic(thinking={"type": "adaptive", "display": "omitted"})
    assert (r.chat.reasoning, r.show_thinking) == (None, False)
    for effort, (on, budget) in EFFORT_REASONING.items():
        r = anthropic(thinking={"type": "adaptive"}, output_config={"effort": effort})
        assert (r.chat.reasoning, r.chat.reasoning_budget) == (on, budget)
    assert anthropic(output_config={"effort": "high"}).chat.reasoning is False  # no thinking
    assert anthropic(thinking={"type": "disabled"}).chat.reasoning is False
    r = anthropic(thinking={"type": "adaptive"}, output_config={"effort": "some-new-level"})
    assert (r.chat.reasoning, r.chat.reasoning_budget) == (None, None)  # the model's default
