"""Tiny models and tokenizers with fill-in-the-middle tokens, and mlx-lm's own greedy loop.

The tiny tokenizer (:func:`mlx_cairn.testing.tiny_models.tiny_tokenizer`) plus the
special tokens of one FIM family, as a code model's tokenizer has them::

    tok = fim_tokenizer("qwen")            # <|fim_prefix|>, <|fim_suffix|>, ...
    lm = fim_model("qwen")                 # mlx-lm's qwen2 class, random weights
    ids = mlx_lm_generate(lm, prompt, 8)   # mlx_lm.generate.generate_step, argmax
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from tokenizers import AddedToken

from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.testing.tiny_models import tiny_tokenizer, tiny_zoo_model

#: Each family's special tokens, as the real checkpoints' tokenizers name them.
FAMILY_TOKENS: dict[str, list[str]] = {
    "qwen": [
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ],
    "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<file_sep>"],
    "santacoder": ["<fim-prefix>", "<fim-suffix>", "<fim-middle>", "<fim-pad>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
    "codellama": ["<s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
    "codestral": ["<s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"],
}
#: The BOS of the families whose prompts start with one.
FAMILY_BOS = {"deepseek": "<｜begin▁of▁sentence｜>", "codellama": "<s>", "codestral": "<s>"}


def fim_tokenizer(family: str | None) -> Tokenizer:
    """The tiny tokenizer with ``family``'s FIM tokens (None: none, a chat model's)."""
    tok = tiny_tokenizer()
    add_fim_tokens(tok, family)
    return tok


def add_fim_tokens(tok: Tokenizer, family: str | None) -> None:
    """Add ``family``'s special tokens to ``tok`` in place (BOS too, where it has one)."""
    if family is None:
        return
    tok.hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in FAMILY_TOKENS[family]]
    )
    if family in FAMILY_BOS:
        tok.bos_token = FAMILY_BOS[family]
        tok.bos_token_id = tok.token_to_id(tok.bos_token)
        tok.add_bos = True


def fim_model(family: str | None = "qwen", seed: int = 0) -> Any:
    """A random-weight mlx-lm ``qwen2`` LoadedModel whose tokenizer has ``family``'s FIM tokens."""
    lm = tiny_zoo_model("qwen2", seed=seed)
    add_fim_tokens(lm.tokenizer, family)
    lm.name = f"tiny-coder-{family}"
    return lm


def qwen_fim_ids(tok: Tokenizer, prefix: str, suffix: str) -> list[int]:
    """Qwen's prefix-suffix-middle prompt, built by hand from the tokens."""
    tid = tok.token_to_id
    return [
        tid("<|fim_prefix|>"),
        *tok.encode_plain(prefix),
        tid("<|fim_suffix|>"),
        *tok.encode_plain(suffix),
        tid("<|fim_middle|>"),
    ]


def mlx_lm_generate(lm: Any, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """mlx-lm's own greedy generation (``generate_step`` with an argmax sampler) on
    ``prompt``, up to and including the first ``stop`` token."""
    from mlx_lm.generate import generate_step

    from mlx_cairn.backends.cpu import attention as cpu_attention

    out: list[int] = []
    with cpu_attention.disabled():  # mlx-lm's own attention, even in patched modules
        steps = generate_step(
            mx.array(prompt, dtype=mx.int32),
            lm.model.inner,
            max_tokens=max_tokens,
            sampler=lambda logits: mx.argmax(logits, axis=-1),
        )
        for tok, _ in steps:
            out.append(int(tok))
            if out[-1] in stop:
                break
    return out
