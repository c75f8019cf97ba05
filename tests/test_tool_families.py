"""The table of tool-call families (mlx_cairn.tool_families) agrees with the Rust parser
and with every module that reads it."""

from __future__ import annotations

import doctest
import json
from typing import get_args

import pytest

import mlx_cairn.tool_families as tf
from mlx_cairn import _core, text
from mlx_cairn.chat import detect_parser_family, detect_reasoning
from mlx_cairn.constrain import GRAMMAR_FAMILIES, OPEN_TAGS, tool_grammars
from mlx_cairn.tool_families import FAMILIES, FAMILY, SIGNS, ToolFamily

ENTRIES = [pytest.param(f, id=f.name) for f in FAMILIES]


def test_one_entry_per_rust_family() -> None:
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names)), "a family has two entries"
    assert set(names) == set(_core.FAMILIES), "the table and rust/text Family::NAMES differ"
    assert set(get_args(text.Family)) == set(names)  # the typed names too


def test_readers_cover_the_table() -> None:
    assert set(GRAMMAR_FAMILIES) == set(tool_grammars.SYNTAXES) == set(FAMILY)
    assert {f.name: f.calls.open for f in FAMILIES if f.calls.open is not None} == OPEN_TAGS
    assert {f.name for f in FAMILIES if f.special_tokens} == text.SPECIAL_TOKEN_FAMILIES
    assert {f.name for f in FAMILIES if f.structural} == text.STRUCTURAL_FAMILIES
    assert {f.name for f in FAMILIES if f.schema_typed} == text.SCHEMA_FAMILIES


def test_every_writer_is_used() -> None:
    used = {f.calls.writer for f in FAMILIES}
    assert used <= set(tool_grammars.WRITERS), used - set(tool_grammars.WRITERS)
    assert set(tool_grammars.WRITERS) <= used, "a grammar writer no family names"


@pytest.mark.parametrize("fam", ENTRIES)
def test_example_is_one_call(fam: ToolFamily) -> None:
    """The entry's example is what its Rust parser reads as one call."""
    segs = text.parse_output(fam.example, family=fam.name)
    assert [(s.kind, s.name, json.loads(s.arguments or "")) for s in segs] == [
        ("tool_call", "f", {"a": 1})
    ]


@pytest.mark.parametrize("fam", ENTRIES)
def test_schema_typed_is_the_parsers(fam: ToolFamily) -> None:
    """``schema_typed``: the parser keeps a string parameter's raw value as text."""
    schemas = json.dumps({"f": {"properties": {"a": {"type": "string"}}}})
    (seg,) = text.parse_output(fam.example, family=fam.name, tool_schemas=schemas)
    assert json.loads(seg.arguments or "") == ({"a": "1"} if fam.schema_typed else {"a": 1})


@pytest.mark.parametrize("fam", ENTRIES)
def test_grammar_tags_reach_the_parser(fam: ToolFamily) -> None:
    """Output is decoded keeping only the special tokens the parser reads
    (text.decode_skips), so every tag a grammar writes must be one of them."""
    tags = set(_core.parser_tags(fam.name, True))
    wanted = {*fam.calls.markers, *([fam.calls.open] if fam.calls.open else [])}
    assert wanted <= tags, wanted - tags


@pytest.mark.parametrize(
    "fam", [pytest.param(f, id=f.name) for f in FAMILIES if f.reasoning is not None]
)
def test_reasoning_tags_are_the_parsers(fam: ToolFamily) -> None:
    r = fam.reasoning
    assert r is not None
    segs = text.parse_output(f"{r.open_tag}x{r.close_tag}hi", family=fam.name, reasoning=True)
    assert [(s.kind, s.text) for s in segs] == [("reasoning", "x"), ("text", "hi")]
    for m in r.markers:  # a template with the marker reasons this family's way
        info = detect_reasoning(m)
        assert (info.open_tag, info.close_tag) == (r.open_tag, r.close_tag), m


@pytest.mark.parametrize("family,sign", SIGNS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(SIGNS)])
def test_each_sign_alone_detects_its_family(family: str, sign: tf.Sign) -> None:
    """No sign is shadowed by another family's that detection tries first."""
    source = " ".join(sign.template)
    vocab = {sign.token} if sign.token else set()
    assert detect_parser_family(source + " tools", vocab) == family
    if sign.strength == "own":  # calls rendered without a tools list: the Hermes fallback
        assert detect_parser_family(source + " tool_calls", vocab) is None


def test_detection_order() -> None:
    strengths = [s.strength for _, s in SIGNS]
    assert strengths == sorted(strengths, key=["own", "shared", "hint"].index)
    # Families that share <tool_call> with Hermes are tried before it.
    order = [f for f, _ in SIGNS]
    assert order.index("glm45") < order.index("qwen3_coder") < order.index("hermes")
    assert set(tf.VOCAB_TOKENS) == {s.token for _, s in SIGNS if s.token}
    assert tf.TEMPLATE_FALLBACK in FAMILY


def test_docstring_examples() -> None:
    failed, _ = doctest.testmod(tf)
    assert failed == 0
