"""llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``), naively, as a test oracle.

What a GGUF ``llama``-model vocabulary implies: control and user-defined
tokens are matched whole first (leftmost, longest); in the text between them
spaces become ``▁``, and adjacent symbols merge while some pair concatenates
to a vocabulary piece, the highest-scoring pair first (ties: leftmost);
symbols left outside the vocabulary fall back to ``<0xNN>`` byte tokens.
No prefix space (Gemma's ``add_space_prefix = false``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_CONTROL, _USER_DEFINED = 3, 4


def spm_encode(
    text: str, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    whole = sorted(
        {t for t, ty in zip(tokens, types, strict=True) if ty in (_CONTROL, _USER_DEFINED) and t},
        key=len,
        reverse=True,
    )
    out: list[int] = []
    start = i = 0
    while i < len(text):
        match = next((w for w in whole if text.startswith(w, i)), None)
        if match is None:
            i += 1
            continue
        out += _fragment(text[start:i], vocab, scores)
        out.append(vocab[match])
        i += len(match)
        start = i
    return out + _fragment(text[start:], vocab, scores)


def _fragment(text: str, vocab: dict[str, int], scores: Sequence[float]) -> list[int]:
    symbols = list(text.replace(" ", "\u2581"))
    while True:
        best: tuple[float, int] | None = None
        for j in range(len(symbols) - 1):
            piece = symbols[j] + symbols[j + 1]
            if piece in vocab and (best is None or scores[vocab[piece]] > best[0]):
                best = (scores[vocab[piece]], j)
        if best is None:
            break
        j = best[1]
        symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in vocab:
            ids.append(vocab[s])
        else:
            ids += [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids


def spm_encode_gguf(text: str, meta: Mapping[str, Any]) -> list[int]:
    """:func:`spm_encode` with the vocabulary of a GGUF file's metadata."""
    return spm_encode(
        text,
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"].tolist(),
        meta["tokenizer.ggml.token_type"].tolist(),
    )
