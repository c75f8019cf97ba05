"""TextPipeline: stop scan on raw text, then parsing, in one call per chunk."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _text_helpers import chunked, chunks_of, model_text, ref_stop_scan, run_pipeline
from mlx_cairn.text import FAMILIES, OutputParser, Segment, TextPipeline, coalesce, parse_output

WEATHER = '{"name": "get_weather", "arguments": {"city": "NYC"}}'


def test_docstring_example() -> None:
    pipe = TextPipeline(["###"], family="hermes", reasoning=True)
    out: list[Segment] = []
    for chunk in [
        "<think>pl",
        "an</think>Sure.",
        '<tool_call>{"name": "f", ',
        '"arguments": {"x": 1}}</tool_call>',
    ]:
        segs, stop = pipe.push(chunk)
        assert stop is None
        out += segs
    out = coalesce(out + pipe.flush())
    assert out[:2] == [Segment("reasoning", "plan"), Segment("text", "Sure.")]
    assert (out[2].name, json.loads(out[2].arguments or "")) == ("f", {"x": 1})


def test_stop_cuts_and_drops_later_tool_calls() -> None:
    text = f"Answer. STOP<tool_call>{WEATHER}</tool_call>"
    for n in (1, 2, 3, 5, 8):
        assert run_pipeline(["STOP"], chunks_of(text, n), family="hermes") == (
            [Segment("text", "Answer. ")],
            "STOP",
        )


def test_stop_inside_reasoning_and_unclosed_call() -> None:
    assert run_pipeline(["END"], ["<think>a E", "ND b</think>c"], reasoning=True) == (
        [Segment("reasoning", "a ")],
        "END",
    )
    # The stop ends generation: the open call is parsed as at end of stream.
    segs, stop = run_pipeline(["\n\n"], [f"<tool_call>{WEATHER}", "\n\nmore"], family="hermes")
    assert stop == "\n\n" and [s.name for s in segs] == ["get_weather"]


def test_after_stop_nothing_until_flush_resets() -> None:
    p = TextPipeline(["###"], family="hermes")
    assert p.push("a###b") == ([Segment("text", "a")], "###")
    assert p.push("more") == ([], None)
    assert p.flush() == []
    assert p.push("again") == ([Segment("text", "again")], None)


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="empty"):
        TextPipeline([""])
    with pytest.raises(ValueError, match="family"):
        TextPipeline([], family="nope")
    with pytest.raises(ValueError, match="starts_in_reasoning"):
        TextPipeline([], starts_in_reasoning=True)
    p = TextPipeline(["a"], family="mistral", reasoning=True)
    assert (
        repr(p)
        == "TextPipeline(['a'], family='mistral', reasoning=True, starts_in_reasoning=False)"
    )
    assert (p.stops, p.family, p.reasoning, p.starts_in_reasoning) == (
        ["a"],
        "mistral",
        True,
        False,
    )


def test_large_input_releases_the_gil_and_still_works() -> None:
    text = "x" * 100_000 + "<think>r</think>" + "y" * 50_000 + " STOP tail"
    segs, stop = run_pipeline(["STOP"], [text], reasoning=True)
    assert stop == "STOP"
    assert segs == [
        Segment("text", "x" * 100_000),
        Segment("reasoning", "r"),
        Segment("text", "y" * 50_000 + " "),
    ]


stops_st = st.lists(st.sampled_from(["###", "</tool_call>", "END", "é🙂", "\n\n", "}"]), max_size=3)


@given(
    text=model_text(),
    stops=stops_st,
    family=st.sampled_from([None, *FAMILIES]),
    reasoning=st.booleans(),
    cut=st.booleans(),
    data=st.data(),
)
def test_equals_scan_then_parse_for_any_chunking(
    text: str, stops: list[str], family: str | None, reasoning: bool, cut: bool, data: st.DataObject
) -> None:
    """The pipeline is the reference stop scan then the parser, for any chunking; ended
    by a cut (max_tokens), the parser's cut, which is the flushed result up to the call
    left open. A stop ends the stream as the model's own end does."""
    visible, stop = ref_stop_scan(stops, text)
    flushed = parse_output(visible, family=family, reasoning=reasoning)
    cut_off = cut and stop is None
    want = parse_cut(visible, family=family, reasoning=reasoning) if cut_off else flushed
    chunks = data.draw(chunked(text))
    got = run_pipeline(stops, chunks, cut=cut, family=family, reasoning=reasoning)
    assert got == (want, stop)
    if cut_off and want:
        *init, last = want
        assert flushed[: len(init)] == init
        at = flushed[len(init)]
        if last.kind == "text" and at.kind == "text":
            assert at.text.startswith(last.text)
        else:
            assert at == last


# ---- a stream cut by max_tokens: flush(cut=True) ------------------------------

OPEN_CALL = '<tool_call>{"name": "get_weather", "argu'


def run_cut(stops: list[str], chunks: list[str], **kw: object) -> tuple[list[Segment], str | None]:
    """Like run_pipeline, but generation was cut: the stream ends with flush(cut=True)."""
    return run_pipeline(stops, chunks, cut=True, **kw)


def parse_cut(text: str, **kw: object) -> list[Segment]:
    """The one-shot parse of `text` as a stream cut by max_tokens."""
    p = OutputParser(**kw)  # type: ignore[arg-type]
    return coalesce([*p.push(text), *p.flush(cut=True)])


def test_cut_drops_the_open_call_and_keeps_held_text() -> None:
    text = f"<think>hm</think>Sure.{OPEN_CALL}"
    head = [Segment("reasoning", "hm"), Segment("text", "Sure.")]
    for n in (1, 2, 3, 5, 8):
        assert run_cut(["###"], chunks_of(text, n), family="hermes", reasoning=True) == (
            head,
            None,
        )
    # The stream ended instead: the unfinished call comes back as text, as before.
    assert run_pipeline([], [text], family="hermes", reasoning=True) == (
        [head[0], Segment("text", f"Sure.{OPEN_CALL}")],
        None,
    )
    # Held text is text: a partial stop match, a lone `<`; the start of the tag
    # that opens a call is the call being written, and goes with it.
    assert run_cut(["###"], ["Hi ##"]) == ([Segment("text", "Hi ##")], None)
    assert run_cut([], ["a <"], family="hermes") == ([Segment("text", "a <")], None)
    assert run_cut([], ["a <tool_ca"], family="hermes") == ([Segment("text", "a ")], None)
    # A closed call stays; after a stop the cut adds nothing.
    segs, _ = run_cut([], [f"<tool_call>{WEATHER}</tool_call>{OPEN_CALL}"], family="hermes")
    assert [s.name for s in segs] == ["get_weather"]
    p = TextPipeline(["###"], family="hermes")
    assert p.push(f"a###{OPEN_CALL}") == ([Segment("text", "a")], "###")
    assert p.flush(cut=True) == []
    # OutputParser: a bare llama3 reply that looks like a call goes, other JSON stays.
    assert parse_cut('{"name": "f", "parameters": {"q": "x', family="llama3") == []
    assert parse_cut('{"answer": 4', family="llama3") == [Segment("text", '{"answer": 4')]
