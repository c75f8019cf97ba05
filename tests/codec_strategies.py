"""Hypothesis strategies for the codec property tests (no tests here): engine
Events as a generation sends them, and the helper that runs them through a codec."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from mlx_cairn.types import Done, Event, TokenLogprob, ToolCall, TopLogprob, Usage

texts = st.text(alphabet=st.sampled_from(list('ab \n{}"é😀')), max_size=6)
tool_calls = st.builds(
    ToolCall,
    id=st.sampled_from(["x", "call_fixed"]),
    name=st.sampled_from(["f", "get_weather"]),
    arguments=st.sampled_from(['{"a": 1}', "{}", '{"s": "b\\n"}', "[1]", "not json"]),
)
usages = st.builds(Usage, st.integers(1, 99), st.integers(0, 99), st.integers(0, 50))
stop_reasons = st.sampled_from(["end_turn", "max_tokens", "stop_sequence", "tool_use"])
dones = st.builds(Done, stop_reason=stop_reasons, usage=usages)
_NO_BYTES: st.SearchStrategy[tuple[int, ...]] = st.just(())


def token_logprobs(
    logprobs: st.SearchStrategy[float],
    *,
    texts: st.SearchStrategy[str] = texts,
    raw: st.SearchStrategy[tuple[int, ...]] = _NO_BYTES,
    max_top: int = 3,
) -> st.SearchStrategy[TokenLogprob]:
    """TokenLogprobs (token id 3, alternatives id 4) with these log-probabilities."""
    return st.builds(
        lambda tok, lp, raw, top: TokenLogprob(tok, 3, lp, raw, tuple(top)),
        texts,
        logprobs,
        raw,
        st.lists(st.builds(TopLogprob, texts, st.just(4), logprobs), max_size=max_top),
    )


def run(codec: Any, evs: list[Event]) -> list[Any]:
    """The wire events of ``codec.open()`` and then each event fed."""
    wire = codec.open()
    for ev in evs:
        wire += codec.feed(ev)
    return wire
