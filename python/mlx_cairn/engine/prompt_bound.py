"""A lower bound on the token count of a text, from its bytes and the vocabulary alone.

A prompt of 10 MB takes seconds to tokenize; when the text alone proves that
it cannot fit the context, the engine refuses it without tokenizing it (see
:func:`mlx_cairn.engine.prepare.render`). The bound must never exceed the
real count: clients read the number in ``prompt is too long: N tokens > M
maximum`` and shorten the conversation by the excess (Claude Code does), so
an overstated N would make them throw away more than they must.

Every token of a tokenized text stands for a piece of it, and the pieces
tile the text. So for any measure of text that adds up over pieces::

    tokens >= measure(text) / (the largest measure of a single token)

Four measures, each over the text's UTF-8 bytes, and the largest result wins:

- bytes;
- bytes that are not ASCII spaces or punctuation (the longest tokens of most
  vocabularies are runs of spaces, ``#`` or ``=``);
- ASCII digits (1 per token where digits are split one by one);
- letter runs: maximal runs of ASCII letters and non-ASCII bytes. A token
  that touches ``r`` runs shows ``r`` runs in its own text, so the largest
  such ``r`` in the vocabulary (1 in the vocabularies we know: no token
  spans ``a b``) bounds them. Added tokens such as ``<|im_start|>`` (runs
  ``im``, ``start``) are left out of that maximum; instead each place the
  text may hold one is charged its extra runs.

The letter-run measure is the tight one: about one token per word of prose.
It holds only while a token's decoded text is exactly the text it stands
for, so :func:`vocab_bound` answers None (no bound: the prompt is counted
exactly) unless the tokenizer is a BPE whose normalizer, pre-tokenizer and
decoder neither drop nor invent text: the byte-level (GPT-2, Llama 3, Qwen,
SmolLM) and the SentencePiece-style (``▁``, byte fallback) families. Unicode
normalizers are applied to the text first, as the tokenizer would.

Example::

    bound = vocab_bound(tokenizer)           # None if the tokenizer is not one we can bound
    if bound is not None and bound.lower_bound(text) > limit:
        ...                                  # too long, without tokenizing
"""

from __future__ import annotations

import json
import math
import string
import threading
import unicodedata
import weakref
from dataclasses import dataclass
from typing import Any

#: Byte classes: ``a`` letter-run bytes (ASCII letters, every non-ASCII byte),
#: ``0`` ASCII digits, space for the rest of ASCII (whitespace, punctuation, controls).
_CLASSES = bytes(
    ord("a")
    if (b >= 0x80 or chr(b) in string.ascii_letters)
    else ord("0")
    if chr(b) in string.digits
    else ord(" ")
    for b in range(256)
)

_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}
_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse"}
_SPACE_MARK = "\u2581"


@dataclass(frozen=True, slots=True)
class Measures:
    """The four measures of one text (see the module doc)."""

    nbytes: int
    nonspace: int
    digits: int
    runs: int

    @classmethod
    def of(cls, text: str, dropped: bytes = b"") -> Measures:
        """The measures of ``text`` without the ``dropped`` bytes (those no token stands for)."""
        classes = text.encode("utf-8", "surrogatepass").translate(_CLASSES, dropped)
        runs = classes.count(b" a") + classes.count(b"0a") + classes.startswith(b"a")
        n = len(classes)
        return cls(n, n - classes.count(b" "), classes.count(b"0"), runs)


@dataclass(frozen=True, slots=True)
class VocabBound:
    """The largest measure of one token of a vocabulary, and the charge for added tokens."""

    #: Most bytes one token stands for; 0 when an added token may swallow
    #: whitespace around it (lstrip / rstrip), which leaves the byte measure out.
    max_bytes: int
    max_nonspace: int
    max_digits: int
    #: Most letter runs an ordinary (not added) token touches.
    max_runs: int
    #: (prefix, extra runs) per group of added tokens with two or more runs:
    #: each occurrence of the prefix may be one of them, charged its extra runs.
    added: tuple[tuple[str, int], ...]
    #: Unicode normalization the tokenizer applies first, if any.
    unicode_form: str | None = None
    #: The tokenizer writes "▁" for a space (SentencePiece style), so a
    #: "▁" in the text is a space to it, and decodes as one.
    space_mark: bool = False
    #: Bytes the tokenizer drops without a token (a byte-level vocabulary
    #: without them and no unk: SmolLM2 has no token for 0x16, for one).
    dropped: bytes = b""

    def lower_bound(self, text: str) -> int:
        """A number of tokens that ``text`` tokenizes to at least."""
        if self.unicode_form and not unicodedata.is_normalized(self.unicode_form, text):  # type: ignore[arg-type]
            text = unicodedata.normalize(self.unicode_form, text)  # type: ignore[arg-type]
        if self.space_mark:
            text = text.replace(_SPACE_MARK, " ")
        m = Measures.of(text, self.dropped)
        charged = sum(text.count(prefix) * extra for prefix, extra in self.added)
        return max(
            math.ceil(m.nbytes / self.max_bytes) if self.max_bytes else 0,
            math.ceil(m.nonspace / self.max_nonspace),
            math.ceil(m.digits / self.max_digits),
            math.ceil(max(m.runs - charged, 0) / self.max_runs),
        )


_cache: weakref.WeakKeyDictionary[Any, tuple[int, VocabBound | None]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def vocab_bound(tokenizer: Any) -> VocabBound | None:
    """The bound of ``tokenizer`` (a :class:`mlx_cairn.chat.tokenizer.Tokenizer`), or None.

    Computed once per tokenizer (a pass over the vocabulary, about 0.1 s for
    50k tokens) and kept while the tokenizer lives.
    """
    hf = tokenizer.hf
    size = int(hf.get_vocab_size(with_added_tokens=True))
    with _cache_lock:
        hit = _cache.get(tokenizer)
        if hit is not None and hit[0] == size:
            return hit[1]
        bound = _compute(hf)
        _cache[tokenizer] = (size, bound)
        return bound


def _compute(hf: Any) -> VocabBound | None:
    ok, form, strips, marks = _supported(hf)
    if not ok:
        return None
    vocab: dict[str, int] = hf.get_vocab(with_added_tokens=True)
    dropped = b""
    if hf.model.unk_token is None:
        if _is_byte_level(hf):
            dropped = bytes(b for b, ch in enumerate(_BYTE_CHARS) if ch not in vocab)
        elif not hf.model.byte_fallback or any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None  # a character it has no token for is dropped: any text may vanish
    added = hf.get_added_tokens_decoder()
    ids = sorted(vocab.values())
    texts = hf.decode_batch([[i] for i in ids], skip_special_tokens=False)
    # A Strip decoder drops a space the token stands for: its raw string
    # ("▁hello") is then the longer, true length.
    raw_len = (
        {i: len(t.encode("utf-8", "surrogatepass")) for t, i in vocab.items()} if strips else {}
    )
    # A token stands for at least 1 and at most 4 bytes of a character it
    # does not know (unk, byte fallback): the floors keep those sound.
    max_bytes, max_nonspace, max_digits, max_runs = 4, 4, 1, 1
    groups: dict[str, list[tuple[str, int]]] = {}
    swallows = False
    for i, text in zip(ids, texts, strict=True):
        m = Measures.of(text)
        max_bytes = max(max_bytes, m.nbytes, raw_len.get(i, 0))
        max_nonspace = max(max_nonspace, m.nonspace)
        max_digits = max(max_digits, m.digits)
        tok = added.get(i)
        if tok is None:
            max_runs = max(max_runs, m.runs)
            continue
        swallows = swallows or bool(tok.lstrip or tok.rstrip)
        extra = Measures.of(tok.content).runs - 1
        if extra > 0:
            groups.setdefault(tok.content[:2], []).append((tok.content, extra))
    # Counting every added token in a long text costs a pass each (Llama 3 has
    # 256): tokens sharing a prefix are counted by it, charged the most extra runs.
    charges = [
        members[0] if len(members) == 1 else (prefix, max(e for _, e in members))
        for prefix, members in sorted(groups.items())
    ]
    return VocabBound(
        max_bytes=0 if swallows else max_bytes,
        max_nonspace=max_nonspace,
        max_digits=max_digits,
        max_runs=max_runs,
        added=tuple(charges),
        unicode_form=form,
        space_mark=marks,
        dropped=dropped,
    )


def _supported(hf: Any) -> tuple[bool, str | None, bool, bool]:
    """Whether ``hf`` can be bounded, the Unicode form it applies first, whether its
    decoder strips, and whether it writes "▁" for spaces.

    Each part must keep a token's decoded text equal to the text it stands
    for: nothing dropped (a "Removed" split, a fused unknown), nothing turned
    into a letter (a space that becomes "▁" must become a space again).
    """
    no = (False, None, False, False)
    model = hf.model
    if type(model).__name__ != "BPE":
        return no
    if model.unk_token and model.fuse_unk and not model.byte_fallback:
        return no  # one unk may stand for any run of unknown characters
    form: str | None = None
    spaces_marked = False  # some part writes "▁" for a space
    for part in _parts(hf.normalizer, "normalizers"):
        kind = part.get("type")
        if kind in _UNICODE_FORMS and form is None:
            form = kind
        elif (kind == "Prepend" and part.get("prepend") == _SPACE_MARK) or (
            kind == "Replace"
            and part.get("pattern") == {"String": " "}
            and part.get("content") == _SPACE_MARK
        ):
            spaces_marked = True
        else:
            return no
    byte_level = False
    for part in _parts(hf.pre_tokenizer, "pretokenizers"):
        kind = part.get("type")
        if kind not in _PRE_TOKENIZERS or part.get("behavior") == "Removed":
            return no
        byte_level = byte_level or kind == "ByteLevel"
        spaces_marked = spaces_marked or kind == "Metaspace"
    decoder = _parts(hf.decoder, "decoders")
    kinds = {part.get("type") for part in decoder}
    strips = False
    for part in decoder:
        kind = part.get("type")
        if kind == "Strip" and part.get("content", " ") in string.whitespace:
            strips = True
        elif kind == "Replace" and part.get("pattern") == {"String": _SPACE_MARK}:
            if part.get("content") != " ":
                return no
            kinds.add("Metaspace")  # turns the mark back into a space, as Metaspace does
        elif kind not in _DECODERS:
            return no
    if byte_level and "ByteLevel" not in kinds:
        return no  # tokens would decode to the byte alphabet ("Ġ" for a space)
    if spaces_marked and "Metaspace" not in kinds:
        return no
    return True, form, strips, spaces_marked


def _byte_chars() -> list[str]:
    """The byte-level alphabet: the character GPT-2's byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    return [chars.get(b) or chr(next(extra)) for b in range(256)]


_BYTE_CHARS = _byte_chars()


def _is_byte_level(hf: Any) -> bool:
    return any(p.get("type") == "ByteLevel" for p in _parts(hf.pre_tokenizer, "pretokenizers"))


def _parts(component: Any, key: str) -> list[dict[str, Any]]:
    """The flattened JSON description of a tokenizer component (Sequence unrolled)."""
    if component is None:
        return []
    spec = json.loads(component.__getstate__())
    out: list[dict[str, Any]] = []
    stack = [spec]
    while stack:
        part = stack.pop(0)
        if part.get("type") == "Sequence":
            stack[:0] = part.get(key) or []
        else:
            out.append(part)
    return out
