"""Tokenizers built from GGUF metadata read by our header reader: SentencePiece (Gemma-style).

The oracle is llama.cpp's own SentencePiece algorithm (tests/spm_reference.py)
over the same vocabulary, scores and token types.
"""

from __future__ import annotations

import numpy as np
import pytest

from gguf_fixtures import write_gguf
from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_header
from mlx_cairn.models.gguf_check import read_header
from spm_reference import spm_encode_gguf

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
#: Gemma keeps whitespace runs as user-defined pieces, spelled with real spaces/newlines.
USER = ["\n", "\n\n", "  ", "   ", "\t"]
PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "a",
    "c",
    "s",
    "i",
    "n",
    "o",
    "l",
    "r",
    "é",
    "▁t",
    "he",
    "▁the",
    "at",
    "▁c",
    "▁cat",
    "▁a",
    "in",
    "▁in",
    "is",
    "▁is",
    "lo",
    "ll",
    "▁h",
    "▁he",
    "ch",
    "▁ch",
    "▁s",
    "▁sh",
]


def _meta() -> dict:
    tokens = SPECIAL + USER + [f"<0x{i:02X}>" for i in range(256)] + PIECES
    types = [3] * len(SPECIAL) + [4] * len(USER) + [6] * 256 + [1] * len(PIECES)
    # Gemma's scores: -1000 for special and user-defined, 0 for bytes, -rank for pieces.
    scores = (
        [-1000.0] * (len(SPECIAL) + len(USER))
        + [0.0] * 256
        + [-float(i) for i in range(len(PIECES))]
    )
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("t") / "spm.gguf", "gemma3", _meta(), {})
    meta = read_header(path).metadata
    return tokenizer_from_header(meta), meta


TEXTS = [
    "the cat is in the hall",
    "the  cat\n\nis   in\tthe hall\n",
    "héllo chés",  # é is a piece; ñ and 😀 are not: byte fallback
    "ñ 😀 x",
    "<start_of_turn>user\nthe cat<end_of_turn>\n",
    "  leading and trailing  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_encoding_is_what_the_vocabulary_implies(spm, text):
    tok, meta = spm
    want = spm_encode_gguf(text, meta)
    assert tok.encode(text) == want
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    detok = tok.detokenizer(skip_special_tokens=False)
    assert "".join(detok.add(i) for i in tok.encode(text)) + detok.flush() == text


def test_sentencepiece_special_tokens(spm):
    tok, _ = spm
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<bos>",
        "<eos>",
        "<pad>",
        "<unk>",
    )
    assert tok.add_bos and tok.bos_token_id == 2 and tok.eos_token_id == 1
    assert tok.encode("<start_of_turn>") == [4]
    # Request text is data: markup spelled in it is not the control token.
    assert 4 not in tok.encode_plain("<start_of_turn>")
    assert tok.decode(tok.encode("<start_of_turn>the")) == "the"  # specials skipped by default
    assert [tok.id_to_token(i) for i in tok.encode("the cat")] == ["t", "he", "\u2581cat"]
    assert "<0xF0>" in [tok.id_to_token(i) for i in tok.encode("😀")]
