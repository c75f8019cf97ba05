"""``prepare_generation``: the cap in effect lives on the prepared request; the client's
ChatRequest is never written back (one writer for each kind of state)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mlx_cairn.api.respond import prepare_generation
from mlx_cairn.engine import Engine
from mlx_cairn.errors import ContextLengthExceeded
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message, SamplingParams

ASKED = 10**9


@pytest.fixture(scope="module")
def served():
    with closing_at_rest(Engine(tiny_model("qwen3", seed=1))) as engine:
        yield SimpleNamespace(engine=engine)


def chat(max_tokens: int = ASKED) -> ChatRequest:
    return ChatRequest(
        [Message("user", "Hello world")],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
    )


def test_a_clamped_cap_stays_on_the_prepared_request(served) -> None:
    c = chat()
    prepared = asyncio.run(prepare_generation(served, c, clamp_max_tokens=True))
    assert 1 <= prepared.max_tokens < ASKED  # the room the prompt leaves
    assert c.max_tokens == ASKED


def test_a_request_context_clamps_the_prepared_request_only(served) -> None:
    c = chat()
    prepared = asyncio.run(prepare_generation(served, c, clamp_max_tokens=True, context_limit=64))
    assert prepared.max_tokens == 64 - int(prepared.num_prompt_tokens)
    assert c.max_tokens == ASKED
    with pytest.raises(ContextLengthExceeded):  # unclamped, the same cap is refused
        asyncio.run(prepare_generation(served, chat(), context_limit=64))
