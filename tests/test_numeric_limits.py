"""Every numeric field is range-checked at parse time against what the engine can represent.

Values at a limit are accepted (and the engine runs them); values past it are
a 400 naming the field; nothing a request sends reaches the sampler unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dialect_parsers import LIMIT, anthropic_request, chat_request, responses_request
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.types import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_SEED,
    MAX_TOP_K,
    MIN_SEED,
    ChatRequest,
    Message,
    SamplingParams,
    TextDelta,
)
from scripted_model import say, scripted_model


def anthropic(**kw: Any) -> Any:
    return anthropic_request(**kw).chat


def chat(**kw: Any) -> Any:
    return chat_request(**kw).chat


def responses(**kw: Any) -> Any:
    return responses_request(**kw).chat


Parse = Callable[..., Any]
#: (parser, field, accepted values at the edges, refused values just past them)
EDGES: list[tuple[str, Parse, str, list[Any], list[Any]]] = [
    ("anthropic", anthropic, "temperature", [0, 1, 1e-38], [-1e-9, 1.0000001, math.inf]),
    ("anthropic", anthropic, "top_p", [1e-38, 1], [0, 1.0000001]),
    ("anthropic", anthropic, "top_k", [0, MAX_TOP_K], [-1, MAX_TOP_K + 1, 2**63, 1.5]),
    ("anthropic", anthropic, "max_tokens", [1, LIMIT], [0, LIMIT + 1, 2**31, 2**64]),
    ("chat", chat, "temperature", [0, 2, 1e-38], [-1e-9, 2.0000001]),
    ("chat", chat, "top_p", [1e-38, 1], [0, 1.5]),
    ("chat", chat, "seed", [MIN_SEED, MAX_SEED, 0], [MIN_SEED - 1, MAX_SEED + 1, 2**100]),
    ("chat", chat, "max_completion_tokens", [1, LIMIT], [0, LIMIT + 1, 2**40]),
    ("chat", chat, "max_tokens", [1, LIMIT], [0, LIMIT + 1]),
    ("responses", responses, "temperature", [0, 2], [-0.5, 2.5]),
    ("responses", responses, "top_p", [1e-38, 1], [0, 2]),
    ("responses", responses, "max_output_tokens", [1, LIMIT], [0, LIMIT + 1, 2**40]),
]


@pytest.mark.parametrize(
    ("dialect", "parse", "field", "ok", "bad"), EDGES, ids=[f"{d}-{f}" for d, _, f, _, _ in EDGES]
)
def test_edges_of_every_numeric_field(
    dialect: str, parse: Parse, field: str, ok: list[Any], bad: list[Any]
) -> None:
    for v in ok:
        parse(**{field: v})
    for v in bad:
        with pytest.raises(InvalidRequest) as ei:
            parse(**{field: v})
        assert ei.value.param == field and field in ei.value.message, (v, ei.value.message)


@given(st.integers(min_value=-(2**80), max_value=2**80))
def test_any_top_k_is_refused_or_representable(k: int) -> None:
    try:
        c = anthropic(top_k=k)
    except InvalidRequest as e:
        assert e.param == "top_k"
        assert k < 0 or k > MAX_TOP_K
    else:
        assert 0 <= c.sampling.top_k <= MAX_TOP_K


@given(st.integers(min_value=-(2**80), max_value=2**80))
def test_any_seed_is_refused_or_64_bit(seed: int) -> None:
    try:
        c = chat(seed=seed)
    except InvalidRequest as e:
        assert e.param == "seed"
    else:
        assert MIN_SEED <= c.sampling.seed <= MAX_SEED


def test_tiny_temperatures_are_greedy_and_edge_values_run() -> None:
    """1e-38 used to overflow the softmax into empty output; it now samples greedily,
    and values at every accepted edge run in one batch without failing any row."""
    with closing_at_rest(
        Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=8))
    ) as engine:

        def run(sampling: SamplingParams) -> str:
            req = ChatRequest([Message("user", say("edge cases"))], 16, sampling=sampling)
            events = list(engine.generate_sync(req, timeout=60))
            return "".join(e.text for e in events if isinstance(e, TextDelta))

        assert run(SamplingParams(temperature=1e-38)) == run(SamplingParams(temperature=0.0))
        assert run(SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2)) == "edge cases"
        streams = [
            engine.submit(ChatRequest([Message("user", say("edge cases"))], 16, sampling=s))
            for s in (
                SamplingParams(temperature=1.0, top_k=MAX_TOP_K, seed=MAX_SEED),
                SamplingParams(temperature=2.0, top_p=1e-38, seed=MIN_SEED),
                SamplingParams(temperature=1e-38, top_k=1),
            )
        ]
        for s in streams:
            events = list(s.iter_sync(60))
            assert type(events[-1]).__name__ == "Done", events[-1]
