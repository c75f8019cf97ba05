"""The cheap lower bound on a prompt's token count never exceeds the real count.

Sound on every tokenizer family it accepts (byte-level BPE, SentencePiece-style
BPE with byte fallback, a Unicode normalizer first), for any text
(hypothesis), including special-token text and the template's markup; the
tokenizers it cannot bound are recognised and get no bound at all.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.engine.prompt_bound import Measures, vocab_bound
from mlx_cairn.testing.tiny_models import tiny_tokenizer

_PIECES = [
    "hello",
    "world",
    " the",
    " a",
    "ing",
    "123",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "\n\n",
    "    ",
    "=====",
    "é",
    "naïve",
    "中文",
    "😀",
    "\u00a0",
    "\u3000",
    "e\u0301",
    "Ａ",
    "ﬁ",
    "x,y",
    "a-b",
    ".",
    "'s",
    "\t",
    "\ufffd",
    "\u2581",
]
TEXTS = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=6)), max_size=40).map("".join)


def _spm_tokenizer(extra: list[str] = ()) -> Tokenizer:  # type: ignore[assignment]
    """A SentencePiece-style BPE as cairn builds one from GGUF (▁ for spaces, byte fallback)."""
    pieces = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "at", "\u2581c", "\u2581cat"]
    pieces += ["s", "t", "h", "e", "a", "c", "\u2581\u2581", "\u2581\u2581\u2581\u2581", *extra]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = []
    for p in pieces:
        for cut in range(1, len(p)):
            a, b = p[:cut], p[cut:]
            if a in vocab and b in vocab:
                merges.append((a, b))
                break
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    hf.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    hf.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>", add_bos=True)


def _nfkc_tokenizer() -> Tokenizer:
    tok = tiny_tokenizer()
    tok.hf.normalizer = normalizers.NFKC()
    return tok


def _smollm_like() -> Tokenizer:
    """The tiny byte-level vocabulary behind SmolLM2's pre-tokenizer (digits one by one)."""
    tok = tiny_tokenizer()
    tok.hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


TOKENIZERS = {
    "byte-level": tiny_tokenizer(),
    "byte-level, digits split": _smollm_like(),
    "sentencepiece": _spm_tokenizer(),
    "sentencepiece, a token across a space": _spm_tokenizer(extra=["t\u2581c"]),
    "nfkc first": _nfkc_tokenizer(),
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
@given(text=TEXTS)
@example(text="\u2581\u2581\u2581")  # SentencePiece reads a "▁" as a space
def test_bound_never_exceeds_the_count(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    bound = vocab_bound(tok)
    assert bound is not None
    assert bound.lower_bound(text) <= len(tok.encode(text)), ascii(text)
    assert bound.lower_bound(text) <= len(tok.encode_plain(text))


def test_a_token_across_two_words_is_seen() -> None:
    assert vocab_bound(TOKENIZERS["sentencepiece"]).max_runs == 1  # type: ignore[union-attr]
    assert vocab_bound(TOKENIZERS["sentencepiece, a token across a space"]).max_runs == 2  # type: ignore[union-attr]


def test_added_tokens_are_charged_their_extra_runs() -> None:
    tok = tiny_tokenizer()
    bound = vocab_bound(tok)
    assert bound is not None
    # "<|im_start|>" is 1 token but 2 letter runs ("im", "start").
    text = "<|im_start|>user\nhi<|im_end|>\n" * 50
    assert bound.lower_bound(text) <= len(tok.encode(text)), ascii(text)
    assert Measures.of("<|im_start|>").runs == 2


def test_prose_is_bounded_within_a_small_factor() -> None:
    tok = tiny_tokenizer()
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 2000
    bound = vocab_bound(tok)
    assert bound is not None
    n = len(tok.encode(text))
    assert n / 8 <= bound.lower_bound(text) <= n


@pytest.mark.slow
@given(text=TEXTS)
@example(text="\x16")  # a byte SmolLM2's vocabulary lacks: dropped, no token at all
def test_default_model_bound_is_sound(default_model, text: str) -> None:  # type: ignore[no-untyped-def]
    tok = default_model.tokenizer
    bound = vocab_bound(tok)
    assert bound is not None and bound.max_digits == 1  # SmolLM2 splits digits one by one
    assert b"\x16" in bound.dropped
    assert bound.lower_bound(text) <= len(tok.encode(text)), ascii(text)


def _with(tok: Tokenizer, **parts: object) -> Tokenizer:
    for key, value in parts.items():
        setattr(tok.hf, key, value)
    return tok


@pytest.mark.parametrize(
    "make",
    [
        lambda: Tokenizer(
            HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        ),  # one unk per word: any length
        lambda: Tokenizer(
            HFTokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
        ),  # unknown runs fused into one unk
        lambda: _with(tiny_tokenizer(), normalizer=normalizers.Lowercase()),
        lambda: _with(tiny_tokenizer(), normalizer=normalizers.Replace("a", "")),
        lambda: _with(
            tiny_tokenizer(),
            pre_tokenizer=pre_tokenizers.Split(Regex("[a-z]"), behavior="removed"),
        ),
        lambda: _with(tiny_tokenizer(), pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
        lambda: _with(tiny_tokenizer(), decoder=decoders.WordPiece()),
        lambda: _with(tiny_tokenizer(), decoder=None),  # byte-level tokens left as "Ġthe"
        lambda: _with(_spm_tokenizer(), decoder=decoders.ByteFallback()),  # "▁" stays a letter
        lambda: Tokenizer(HFTokenizer(models.BPE({"a": 0}, []))),  # drops what it does not know
    ],
)
def test_tokenizers_that_cannot_be_bounded_get_none(make) -> None:  # type: ignore[no-untyped-def]
    assert vocab_bound(make()) is None


def test_added_token_that_swallows_spaces_drops_the_byte_measure() -> None:
    tok = tiny_tokenizer()
    tok.hf.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    bound = vocab_bound(tok)
    assert bound is not None and bound.max_bytes == 0
    text = "a" + " " * 500 + "<sep>" + " " * 500 + "b"
    assert bound.lower_bound(text) <= len(tok.encode(text)), ascii(text)


def test_bound_follows_a_vocabulary_that_grew() -> None:
    tok = tiny_tokenizer()
    first = vocab_bound(tok)
    tok.hf.add_tokens(["supercalifragilistic"])
    second = vocab_bound(tok)
    assert first is not None and second is not None
    assert second.max_nonspace >= len("supercalifragilistic") > first.max_nonspace
