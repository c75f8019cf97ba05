"""Tokenizer wrapper and the incremental detokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.models.testing import tiny_tokenizer

TOK = tiny_tokenizer()


def _stream(ids, skip=True):
    detok = TOK.detokenizer(skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


def test_multibyte_characters_are_never_split():
    text = "日本語 😀 ok"
    ids = TOK.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces span several tokens
    deltas, tail = _stream(ids)
    assert "".join(deltas) + tail == text
    assert all("\ufffd" not in d for d in deltas)


def test_truncated_character_is_flushed_as_replacement():
    ids = TOK.encode("a😀")
    deltas, tail = _stream(ids[:-1])
    assert "".join(deltas) == "a" and tail == "\ufffd"


def test_special_tokens_skipped_or_kept():
    ids = TOK.encode("<|im_start|>hi<|im_end|>")
    assert "".join(_stream(ids)[0]) == "hi"
    deltas, tail = _stream(ids, skip=False)
    assert "".join(deltas) + tail == "<|im_start|>hi<|im_end|>"


@given(st.text(max_size=60))
def test_stream_equals_full_decode_for_text(text):
    ids = TOK.encode(text)
    deltas, tail = _stream(ids)
    assert "".join(deltas) + tail == TOK.decode(ids) == text


@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40))
def test_stream_equals_full_decode_for_any_ids(ids):
    """Even invalid byte sequences: nothing repeated, nothing lost."""
    deltas, tail = _stream(ids, skip=False)
    assert "".join(deltas) + tail == TOK.decode(ids, skip_special_tokens=False)
    assert all(not d.endswith("\ufffd") for d in deltas)
