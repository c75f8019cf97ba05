"""Rebuild a ``tokenizers.Tokenizer`` from GGUF metadata (``tokenizer.ggml.*``).

Two GGUF tokenizer models are supported, mirroring what Hugging Face's GGUF
converters build:

- ``gpt2``: byte-level BPE; the pre-tokenizer split follows
  ``tokenizer.ggml.pre`` (smollm, llama-bpe, qwen2, gpt-2, ...);
- ``llama``: SentencePiece-style BPE with byte fallback, merges derived from
  the token scores.

Control tokens (type 3) become special added tokens, user-defined ones
(type 4) non-special added tokens, so chat markup in a rendered prompt maps
to single ids.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.errors import ModelLoadError

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3 = {"llama-bpe", "llama3", "dbrx", "smaug-bpe", "falcon3"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen", "qwen35"}
_GPT2 = {"gpt-2", "gpt2", "default", "phi-2", "jina-es", "jina-de"}


def _byte_level_pre(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """Pre-tokenizer for a GGUF ``pre`` name, and whether BPE should ignore merges."""
    split_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGIT_FIRST:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), False
    if pre in _LLAMA3:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, split_only]), True
    if pre in _QWEN2:
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, split_only]), False
    if pre not in _GPT2 and pre is not None:
        log.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary (as HF's SentencePieceExtractor)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(a, b) for *_, a, b in found]


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer described by GGUF metadata; unknown models are a clear error."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens")
    types_raw = meta.get("tokenizer.ggml.token_type")
    types = types_raw.tolist() if types_raw is not None else [1] * len(tokens)

    def tid(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else int(v.item() if hasattr(v, "item") else v)

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre, ignore_merges = _byte_level_pre(meta.get("tokenizer.ggml.pre"))
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            ignore_merges=ignore_merges,
        )
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre
        hf.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores_raw = meta.get("tokenizer.ggml.scores")
        scores = scores_raw.tolist() if scores_raw is not None else [0.0] * len(tokens)
        unk = tid("unknown_token_id")
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_spm_merges(tokens, scores),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
        hf = HFTokenizer(bpe)
        add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        norms: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
        if add_space:
            norms.insert(0, normalizers.Prepend("\u2581"))
        hf.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space:
            decs.append(decoders.Strip(content=" ", left=1, right=0))
        hf.decoder = decoders.Sequence(decs)
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    hf.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    hf.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
    )

    def text(key: str) -> str | None:
        i = tid(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos: Any = meta.get("tokenizer.ggml.add_bos_token")
    return Tokenizer(
        hf,
        bos_token=text("bos_token_id"),
        eos_token=text("eos_token_id"),
        pad_token=text("padding_token_id"),
        unk_token=text("unknown_token_id"),
        add_bos=bool(add_bos.item() if hasattr(add_bos, "item") else (add_bos or False)),
    )


def tokenizer_from_header(meta: Mapping[str, Any]) -> Tokenizer:
    """Tokenizer from GGUF metadata as :func:`~mlx_cairn.models.gguf_check.read_header` returns it."""
    return tokenizer_from_gguf(dict(meta))
