"""OutputParser / parse_output: must-hold cases, families, and properties."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _text_helpers import FRAGMENTS, chunked, chunks_of, model_text, run_parser
from mlx_cairn.text import FAMILIES, Family, OutputParser, Segment, coalesce, parse_output

SIZES = (1, 2, 3, 5, 8)
WEATHER = '{"name": "get_weather", "arguments": {"city": "NYC"}}'
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
MARKERS = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"]


def parse_all_sizes(text: str, **kw: object) -> list[Segment]:
    """Parses with every chunk size; all must agree with the one-shot form."""
    want = parse_output(text, **kw)  # type: ignore[arg-type]
    for n in SIZES:
        assert run_parser(chunks_of(text, n), **kw) == want, n
    return want


def calls(segs: list[Segment]) -> list[tuple[str | None, object]]:
    return [(s.name, json.loads(s.arguments or "")) for s in segs if s.kind == "tool_call"]


def test_must_hold_weather_call() -> None:
    segs = parse_all_sizes(
        f"Sure, let me check the weather.<tool_call>{WEATHER}</tool_call>", family="hermes"
    )
    assert [s.kind for s in segs] == ["text", "tool_call"]
    assert segs[0].text == "Sure, let me check the weather."
    assert calls(segs) == [("get_weather", {"city": "NYC"})]


def test_must_hold_two_calls_back_to_back() -> None:
    a = '{"name": "a", "arguments": {"x": 1}}'
    b = '{"name": "b", "arguments": {"y": [true]}}'
    for text in (
        f"<tool_call>{a}</tool_call><tool_call>{b}</tool_call>",
        f"<tool_call>\n{a}\n</tool_call>\n<tool_call>\n{b}\n</tool_call>\n",
    ):
        segs = parse_all_sizes(text, family="hermes")
        assert [s.kind for s in segs] == ["tool_call", "tool_call"]
        assert calls(segs) == [("a", {"x": 1}), ("b", {"y": [True]})]


def test_must_hold_reasoning() -> None:
    segs = parse_all_sizes("<think>plan</think>Answer", family="hermes", reasoning=True)
    assert segs == [Segment("reasoning", "plan"), Segment("text", "Answer")]


def test_starts_in_reasoning() -> None:
    segs = parse_all_sizes(
        "plan</think>\n\nAnswer<|im_end|>", reasoning=True, starts_in_reasoning=True
    )
    assert segs == [Segment("reasoning", "plan"), Segment("text", "Answer")]
    with pytest.raises(ValueError, match="starts_in_reasoning"):
        OutputParser(starts_in_reasoning=True)


def test_reasoning_off_and_family_none_keep_tags_as_text() -> None:
    text = f"<think>x</think>y<tool_call>{WEATHER}</tool_call>"
    assert parse_all_sizes(text) == [Segment("text", text)]
    assert parse_all_sizes(text, reasoning=True) == [
        Segment("reasoning", "x"),
        Segment("text", f"y<tool_call>{WEATHER}</tool_call>"),
    ]


@pytest.mark.parametrize("marker", MARKERS)
def test_end_markers_never_leak(marker: str) -> None:
    assert parse_all_sizes(f"Hi{marker}", family="hermes") == [Segment("text", "Hi")]
    assert parse_all_sizes(f"<think>r{marker}</think>t{marker}", reasoning=True) == [
        Segment("reasoning", "r"),
        Segment("text", "t"),
    ]


def test_false_alarms_released() -> None:
    text = "if a < b then <b>x</b> <tool and <think"
    assert parse_all_sizes(text, family="hermes", reasoning=True) == [Segment("text", text)]


def test_malformed_calls_come_back_as_text() -> None:
    for body in ('{"name": "f", "arguments": {', '{"arguments": {}}', "not json", '{"name": ""}'):
        text = f"x<tool_call>{body}</tool_call>y"
        assert parse_all_sizes(text, family="hermes") == [Segment("text", text)], body


def test_unclosed_call_at_flush() -> None:
    segs = parse_all_sizes(f"ok<tool_call>{WEATHER}", family="hermes")
    assert calls(segs) == [("get_weather", {"city": "NYC"})]
    text = 'ok<tool_call>{"name": "get_weather", "argu'
    assert parse_all_sizes(text, family="hermes") == [Segment("text", text)]


def test_qwen3_coder() -> None:
    text = (
        "Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nrust <pyo3>\n</parameter>\n"
        '<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{"lang": "en"}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    segs = parse_all_sizes(text, family="qwen3_coder")
    assert segs[0] == Segment("text", "Let me look.\n")
    assert calls(segs) == [
        ("search", {"query": "rust <pyo3>", "limit": 5, "filters": {"lang": "en"}})
    ]


def test_llama3() -> None:
    body = '{"name": "search", "parameters": {"q": "x"}}'
    for text in (f"<|python_tag|>{body}<|eom_id|>", f"\n{body}", f"{body}; {body}"):
        segs = parse_all_sizes(text, family="llama3")
        assert {s.kind for s in segs} == {"tool_call"}
        assert calls(segs)[0] == ("search", {"q": "x"})
    text = '{"answer": 42} is the JSON'
    assert parse_all_sizes(text, family="llama3") == [Segment("text", text)]


def test_mistral() -> None:
    text = 'Checking.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    segs = parse_all_sizes(text, family="mistral")
    assert segs[0] == Segment("text", "Checking.")
    assert calls(segs) == [("a", {"x": 1}), ("b", {})]
    segs = parse_all_sizes('[TOOL_CALLS]f[ARGS]{"k": "v"}', family="mistral")
    assert calls(segs) == [("f", {"k": "v"})]


def test_segment_api() -> None:
    t = Segment("text", "hi")
    assert (t.kind, t.text, t.name, t.arguments, t.raw) == ("text", "hi", None, None, "")
    assert t == Segment("text", "hi") and t != Segment("reasoning", "hi") and t != "hi"
    assert hash(t) == hash(Segment("text", "hi"))
    c = Segment("tool_call", name="f", arguments="{}")
    assert (c.kind, c.text, c.name, c.arguments) == ("tool_call", "", "f", "{}")
    assert repr(c) == "Segment('tool_call', name='f', arguments='{}')"
    assert repr(Segment("reasoning", "it's")) == "Segment('reasoning', \"it's\")"
    for bad in (
        lambda: Segment("image", "x"),
        lambda: Segment("text", "x", name="f"),
        lambda: Segment("tool_call", "x", name="f", arguments="{}"),
        lambda: Segment("tool_call", name="f"),
    ):
        with pytest.raises(ValueError):
            bad()
    assert coalesce([Segment("text", "a"), Segment("text", ""), Segment("text", "b")]) == [
        Segment("text", "ab")
    ]


def test_lone_surrogates_are_a_clear_error() -> None:
    with pytest.raises(UnicodeEncodeError):
        OutputParser().push("a\ud800")
    with pytest.raises(UnicodeEncodeError):
        parse_output("\udfff")


def test_parser_api_errors() -> None:
    with pytest.raises(ValueError, match="unknown tool-call family"):
        OutputParser(family="gpt")
    with pytest.raises(ValueError, match="unknown tool-call family"):
        parse_output("x", family="")
    assert set(FAMILIES) == {
        "hermes",
        "qwen3_coder",
        "llama3",
        "mistral",
        "harmony",
        "glm45",
        "deepseek_v3",
        "kimi_k2",
        "gemma4",
        "minimax_m2",
        "pythonic",
    }
    assert set(get_args(Family)) == set(FAMILIES)  # the typed names are the parser's
    p = OutputParser(family="llama3", reasoning=True)
    assert (p.family, p.reasoning, p.starts_in_reasoning) == ("llama3", True, False)


families = st.sampled_from([None, *FAMILIES])


@given(text=model_text(), family=families, reasoning=st.booleans(), data=st.data())
def test_chunking_invariance(
    text: str, family: str | None, reasoning: bool, data: st.DataObject
) -> None:
    sir = reasoning and data.draw(st.booleans())
    kw = {"family": family, "reasoning": reasoning, "starts_in_reasoning": sir}
    assert run_parser(data.draw(chunked(text)), **kw) == parse_output(text, **kw)  # type: ignore[arg-type]


def strip(s: str) -> str:
    """Tags and markers removed until none is left (one can hide inside another)."""
    while True:
        t = s
        for tag in [*TAGS, *MARKERS, "<|python_tag|>", "[TOOL_CALLS]"]:
            t = t.replace(tag, "")
        if t == s:
            return "".join(s.split())
        s = t


@given(text=model_text(), family=st.sampled_from([None, "hermes", "qwen3_coder"]))
def test_every_character_is_accounted_for(text: str, family: str | None) -> None:
    # Apart from tags, markers and whitespace after blocks, text + reasoning +
    # tool-call bodies give back the input.
    segs = parse_output(text, family=family, reasoning=True)
    assert strip("".join(s.text + s.raw for s in segs)) == strip(text)


# Well-formed output: plain text and whole blocks; no tag may reach the text.
PLAIN = st.text(
    alphabet=st.characters(exclude_characters="<>", exclude_categories=["Cs"]), max_size=8
)
BLOCKS = st.sampled_from(
    [
        f"<tool_call>{WEATHER}</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\nx < y\n</parameter>\n</function>\n</tool_call>",
        "<think>why <b> not</think>",
        "<|im_end|>",
        "a<b",
    ]
)


@given(parts=st.lists(st.one_of(PLAIN, BLOCKS), max_size=8), data=st.data())
def test_no_tag_leaks_into_text(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    segs = run_parser(data.draw(chunked(text)), family="hermes", reasoning=True)
    for s in segs:
        for tag in [*TAGS, *MARKERS]:
            assert tag not in s.text
    assert len([s for s in segs if s.kind == "tool_call"]) == sum(
        p.startswith("<tool_call>") for p in parts
    )


def test_marker_spelled_around_a_marker() -> None:
    # Dropping the inner marker joins the outer one's halves; that is text.
    text = "<tool_<|im_end|>call>x"
    assert parse_all_sizes(text, family="hermes") == [Segment("text", "<tool_call>x")]
    assert strip(text) == strip("".join(s.text for s in parse_output(text, family="hermes")))


def test_fragments_cover_all_families() -> None:
    # Guards the property tests above against losing their interesting inputs.
    assert {"<|python_tag|>", "[TOOL_CALLS]", "<think>", "<tool_call>"} <= set(FRAGMENTS)
