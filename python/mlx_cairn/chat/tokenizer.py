"""A thin wrapper over a Hugging Face ``tokenizers.Tokenizer`` plus incremental decoding.

Example::

    tok = Tokenizer.from_file("tokenizer.json", bos_token="<s>", eos_token="</s>")
    ids = tok.encode("Hello")
    detok = tok.detokenizer()
    text = "".join(detok.add(i) for i in ids) + detok.flush()
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Encode / decode text; knows the BOS/EOS/PAD strings a chat template needs."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self.hf = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        #: Whether prompts should start with BOS (added when the template does not).
        self.add_bos = add_bos
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        # Derived from the added vocabulary; rebuilt when it changes (see _specials).
        self._specials_key: tuple[object, ...] = ()
        self._special_tokens: dict[str, int] = {}
        self._plain: HFTokenizer | None = None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: object) -> Tokenizer:
        """Load a ``tokenizer.json``."""
        return cls(HFTokenizer.from_file(str(path)), **kwargs)  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids.

        ``add_special_tokens=False`` (the default) matches Hugging Face chat
        templating: the template, not the post-processor, places BOS. For text
        that came from a request use :meth:`encode_plain` (or
        :func:`mlx_cairn.chat.build_prompt`, which keeps the two apart).
        """
        return list(encode_off_gil(self.hf, text, add_special_tokens=add_special_tokens).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings read as ordinary text.

        ``encode_plain("<|im_end|>")`` is a few byte-level pieces, never the
        ``<|im_end|>`` id. Non-special added tokens still match, as in Hugging
        Face's ``split_special_tokens``.
        """
        specials = self._specials()
        plain = self._plain
        if plain is None:
            plain = _plain_copy(self.hf, set(specials))
            self._plain = plain
        return list(encode_off_gil(plain, text).ids)

    @property
    def special_tokens(self) -> dict[str, int]:
        """``{text: id}`` of the special tokens (added tokens marked special, BOS/EOS/PAD/UNK
        when they are added tokens): the strings :meth:`encode` turns into control ids."""
        return self._specials()

    def _specials(self) -> dict[str, int]:
        key = (
            id(self.hf),
            int(self.hf.get_vocab_size(with_added_tokens=True)),
            self.bos_token,
            self.eos_token,
            self.pad_token,
            self.unk_token,
        )
        if key != self._specials_key:
            added = self.hf.get_added_tokens_decoder()
            named = {self.bos_token, self.eos_token, self.pad_token, self.unk_token}
            self._special_tokens = {
                t.content: int(i)
                for i, t in added.items()
                if t.content and (t.special or t.content in named)
            }
            self._plain = None
            self._specials_key = key
        return self._special_tokens

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated stream."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


def _plain_copy(hf: HFTokenizer, specials: set[str]) -> HFTokenizer:
    """A copy of ``hf`` that reads the ``specials`` strings as ordinary text.

    The copy marks them special (BOS/EOS may be plain added tokens) and turns
    special-token matching off. It is a private copy because the switch is
    tokenizer-wide: flipping it on the shared tokenizer would race with
    encodes on other threads.
    """
    spec = json.loads(hf.to_str())
    for t in spec.get("added_tokens") or []:
        if t.get("content") in specials:
            t["special"] = True
    plain = HFTokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


#: Characters above which encoding releases the GIL (a few ms of work).
RELEASE_GIL_CHARS = 4096


def encode_off_gil(hf: HFTokenizer, text: str, *, add_special_tokens: bool = False) -> Any:
    """``hf.encode(text)``, but for long texts through ``encode_batch``, which
    releases the GIL: ``encode`` holds it for the whole call, and a 2 MB prompt
    stopped the event loop and the engine thread for seconds."""
    if len(text) < RELEASE_GIL_CHARS:
        return hf.encode(text, add_special_tokens=add_special_tokens)
    return hf.encode_batch([text], add_special_tokens=add_special_tokens)[0]


class IncrementalDetokenizer:
    """Turns a token stream into text deltas (the offsets method of vLLM / TGI).

    It decodes a small window twice per token::

        ids:  ... | prefix ........ read | new tokens
                    \\-- prefix_text --/
                    \\-------- new_text ----------/

    and emits ``new_text[len(prefix_text):]`` once it no longer ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD). Decoding from the same
    start keeps decoder clean-ups (e.g. a stripped leading space) identical on
    both sides, so text is never repeated nor split inside a character.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def _delta(self, final: bool) -> str:
        dec = self._tok.decode
        prefix_text = dec(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = dec(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (maybe empty)."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._delta(final=True)
