"""Shared strategies and references for the tests/test_text_*.py files."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from mlx_cairn.text import OutputParser, Segment, StopScanner, TextPipeline, coalesce

FRAGMENTS = [
    "a",
    "b",
    " ",
    "\n",
    "<",
    ">",
    "{",
    "}",
    "#",
    "é",
    "🙂",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<|im_end|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    '{"name": "f", "arguments": {"q": "x<y"}}',
    "<function=g><parameter=p>\n1\n</parameter></function>",
]


def model_text(fragments: list[str] = FRAGMENTS, max_size: int = 16) -> st.SearchStrategy[str]:
    """Text built from structural fragments and arbitrary characters."""
    piece = st.one_of(st.sampled_from(fragments), st.text(max_size=4))
    return st.lists(piece, max_size=max_size).map("".join)


@st.composite
def chunked(draw: st.DrawFn, text: str) -> list[str]:
    """`text` cut at random character boundaries (possibly empty chunks)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[i:j] for i, j in itertools.pairwise(bounds)]


def chunks_of(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def ref_stop_scan(stops: list[str], text: str) -> tuple[str, str | None]:
    """The obvious definition: the first end position where a stop ends wins."""
    for end in range(1, len(text) + 1):
        for s in stops:
            if text.endswith(s, 0, end):
                return text[: end - len(s)], s
    return text, None


def ref_holdback(stops: list[str], text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop."""
    return max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )


def run_scanner(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    s = StopScanner(stops)
    out, stop = [], None
    for c in chunks:
        vis, m = s.push(c)
        out.append(vis)
        if m is not None:
            assert stop is None
            stop = m
    vis, m = s.flush()
    assert m is None
    out.append(vis)
    return "".join(out), stop


def run_parser(chunks: list[str], **kw: object) -> list[Segment]:
    p = OutputParser(**kw)  # type: ignore[arg-type]
    segs: list[Segment] = []
    for c in chunks:
        segs += p.push(c)
    segs += p.flush()
    return coalesce(segs)


def run_pipeline(
    stops: list[str], chunks: list[str], *, cut: bool = False, **kw: object
) -> tuple[list[Segment], str | None]:
    """``chunks`` through a pipeline, ended by ``flush`` (``cut``: generation was cut)."""
    p = TextPipeline(stops, **kw)  # type: ignore[arg-type]
    segs: list[Segment] = []
    stop = None
    for c in chunks:
        got, m = p.push(c)
        segs += got
        if m is not None:
            assert stop is None
            stop = m
    segs += p.flush(cut=cut)
    return coalesce(segs), stop
