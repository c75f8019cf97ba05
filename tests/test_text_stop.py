"""StopScanner: must-hold cases, errors, and properties against a reference."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _text_helpers import chunked, chunks_of, ref_holdback, ref_stop_scan, run_scanner
from mlx_cairn.text import StopScanner

CASES = [
    (["###"], ["Hello #", "#", "# world"], "Hello ", "###"),
    (["###"], ["a ##", "x"], "a ##x", None),
    (["a", "is"], [" The user is a"], " The user ", "is"),
    (["abc", "b"], ["abc"], "a", "b"),
    # "organization" contains "gani": the visible text stops before it.
    (["gani"], ["VLLM is a 100% volunteer organization"], "VLLM is a 100% volunteer or", "gani"),
]


@pytest.mark.parametrize(("stops", "chunks", "visible", "stop"), CASES)
def test_must_hold_cases(
    stops: list[str], chunks: list[str], visible: str, stop: str | None
) -> None:
    assert run_scanner(stops, chunks) == (visible, stop)
    whole = "".join(chunks)
    for n in (1, 2, 3, 5, 8):
        assert run_scanner(stops, chunks_of(whole, n)) == (visible, stop)


def test_hold_back_and_release() -> None:
    s = StopScanner(["###"])
    assert s.push("a ##") == ("a ", None)
    assert s.push("x") == ("##x", None)
    assert s.flush() == ("", None)


def test_nothing_after_match_and_flush_resets() -> None:
    s = StopScanner(["END", "STOP"])
    assert s.push("abcEN") == ("abc", None)
    assert s.push("Dxyz") == ("", "END")
    assert s.push("more STOP") == ("", None)
    assert s.flush() == ("", None)
    assert s.push("again STOP") == ("again ", "STOP")


def test_ties_go_to_list_order() -> None:
    assert run_scanner(["c", "abc"], ["xabc"]) == ("xab", "c")
    assert run_scanner(["abc", "c"], ["xabc"]) == ("x", "abc")


def test_unicode() -> None:
    assert run_scanner(["✓ e"], list("héllo ✓ ende")) == ("héllo ", "✓ e")
    assert run_scanner(["🙂"], ["a🙂b"]) == ("a", "🙂")


def test_errors_and_pass_through() -> None:
    with pytest.raises(ValueError, match="index 1 is empty"):
        StopScanner(["a", ""])
    with pytest.raises(TypeError):
        StopScanner("###")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StopScanner(["a", 3])  # type: ignore[list-item]
    s = StopScanner([])
    assert s.push("any ### text") == ("any ### text", None)
    assert s.stops == []
    assert repr(StopScanner(["a", "b'"])) == "StopScanner(['a', \"b'\"])"


stops_st = st.lists(st.text(alphabet="ab#é🙂 ", min_size=1, max_size=4), min_size=1, max_size=4)
text_st = st.text(alphabet="ab#é🙂 x", max_size=40)


@given(stops=stops_st, text=text_st, data=st.data())
def test_matches_reference_for_any_chunking(
    stops: list[str], text: str, data: st.DataObject
) -> None:
    chunks = data.draw(chunked(text))
    assert run_scanner(stops, chunks) == ref_stop_scan(stops, text)


@given(stops=stops_st, text=text_st, data=st.data())
def test_holds_back_exactly_the_possible_stop_prefix(
    stops: list[str], text: str, data: st.DataObject
) -> None:
    s = StopScanner(stops)
    seen, out = "", ""
    for c in data.draw(chunked(text)):
        seen += c
        vis, m = s.push(c)
        out += vis
        if m is not None:
            break
        assert out == seen[: len(seen) - ref_holdback(stops, seen)]


@given(stops=stops_st, text=st.text(max_size=30), data=st.data())
def test_chunking_invariance_any_unicode(stops: list[str], text: str, data: st.DataObject) -> None:
    text = text + "".join(data.draw(st.lists(st.sampled_from(stops), max_size=2)))
    assert run_scanner(stops, data.draw(chunked(text))) == run_scanner(stops, [text])
