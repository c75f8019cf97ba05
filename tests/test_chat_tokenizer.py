"""Tokenizer wrapper and the incremental detokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlx_cairn.testing.tiny_models import tiny_tokenizer

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
    deltas, tail = _stream(ids, skip=False)
    assert "".join(deltas) + tail == TOK.decode(ids, skip_special_tokens=False) == text


@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40))
def test_stream_equals_full_decode_for_any_ids(ids):
    """Even invalid byte sequences: nothing repeated, nothing lost."""
    deltas, tail = _stream(ids, skip=False)
    assert "".join(deltas) + tail == TOK.decode(ids, skip_special_tokens=False)
    assert all(not d.endswith("\ufffd") for d in deltas)


def _spm_meta():
    import mlx.core as mx

    pieces = [
        "\u2581",
        "\u2581t",
        "he",
        "\u2581the",
        "\u2581a",
        "at",
        "\u2581c",
        "\u2581cat",
        "s",
        "t",
        "h",
        "e",
        "a",
        "c",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array(scores),
        "tokenizer.ggml.token_type": mx.array(types),
        "tokenizer.ggml.bos_token_id": mx.array(1),
        "tokenizer.ggml.eos_token_id": mx.array(2),
        "tokenizer.ggml.unknown_token_id": mx.array(0),
        "tokenizer.ggml.add_bos_token": mx.array(True),
    }


def test_gguf_sentencepiece_tokenizer_with_byte_fallback():
    from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(_spm_meta())
    assert tok.add_bos and tok.bos_token == "<s>" and tok.eos_token_id == 2
    ids = tok.encode("the cat")
    assert [tok.id_to_token(i) for i in ids] == ["\u2581the", "\u2581cat"]
    for text in ["the cat at a cat", "théé 😀"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        detok = tok.detokenizer()
        deltas = [detok.add(i) for i in ids]
        assert "".join(deltas) + detok.flush() == text
        assert all("\ufffd" not in d for d in deltas)
    assert "<0xF0>" in [tok.id_to_token(i) for i in tok.encode("😀")]


def test_gguf_unknown_tokenizer_model_is_clear():
    import pytest

    from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_gguf
    from mlx_cairn.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="'rwkv'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"})
