"""The tokenizer described by a GGUF file's ``tokenizer.ggml.*`` metadata.

Both vocabularies llama.cpp writes build through
:func:`mlx_cairn.chat.gguf_tokenizer.tokenizer_from_gguf`: ``gpt2`` (byte-level
BPE with merges) and ``llama`` (SentencePiece: BPE merges derived from the
piece scores, byte fallback, control tokens special, user-defined tokens
matched whole), which is Gemma's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_gguf
from mlx_cairn.chat.tokenizer import Tokenizer


def tokenizer_from_header(meta: Mapping[str, Any]) -> Tokenizer:
    """Tokenizer from GGUF metadata as :func:`~mlx_cairn.models.gguf_check.read_header` returns it."""
    return tokenizer_from_gguf(dict(meta))
