"""Fill-in-the-middle prompts built from the model's own FIM tokens.

Code models trained for infilling read the text before and after the cursor
between special tokens and write the middle. Each family has its own tokens
and order; the tokenizer tells which family a model belongs to:

=====================  ==========================================================
family                 prompt (``P`` prefix, ``S`` suffix; generation follows)
=====================  ==========================================================
Qwen2.5/3-Coder        ``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>``
StarCoder2, Granite    ``<fim_prefix>P<fim_suffix>S<fim_middle>``
SantaCoder             ``<fim-prefix>P<fim-suffix>S<fim-middle>``
DeepSeek-Coder         ``<｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>``
CodeLlama              ``▁<PRE>P▁<SUF>S▁<MID>`` (``<PRE>`` ... in GGUF vocabularies)
Codestral              ``[SUFFIX]S[PREFIX]P`` (suffix first, no middle token)
=====================  ==========================================================

BOS goes first where the tokenizer asks for it (DeepSeek, CodeLlama,
Codestral). Repository context (llama.cpp's ``input_extra``: other files) goes
before the prefix, each file after the family's file separator with its name
on the first line (``<|file_sep|>utils.py\\n...``), led by the repository-name
token where the family has one, as llama.cpp's ``/infill`` lays it out.

Prefix, suffix and extra text are request data: special-token strings in them
are tokenized as plain text, never as control tokens.

Example::

    ids = fim_prompt(tokenizer, "def add(a, b):\\n    ", "\\n\\nprint(add(1, 2))\\n")
    # generate from ids; the answer is the middle ("return a + b")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class FimFamily:
    """One family's FIM tokens (as token strings) and order."""

    name: str
    prefix: str
    suffix: str
    #: The token after which the middle is generated; None: none (Codestral
    #: generates straight after the prefix).
    middle: str | None
    #: Suffix before prefix (SPM order).
    suffix_first: bool = False
    #: Repository-level context tokens, where the family was trained with them.
    repo_name: str | None = None
    file_sep: str | None = None
    #: Tokens the model writes when the middle is done (beside its EOS).
    end: tuple[str, ...] = ()


#: Checked in order; the first whose prefix and suffix tokens are both in the
#: vocabulary wins (the strings do not overlap between families).
FAMILIES: tuple[FimFamily, ...] = (
    FimFamily(
        "qwen",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        repo_name="<|repo_name|>",
        file_sep="<|file_sep|>",
        end=("<|fim_pad|>", "<|endoftext|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>"),
    ),
    FimFamily(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        repo_name="<repo_name>",
        file_sep="<file_sep>",
        end=("<fim_pad>", "<|endoftext|>", "<file_sep>", "<repo_name>", "<fim_prefix>"),
    ),
    FimFamily(
        "santacoder",
        "<fim-prefix>",
        "<fim-suffix>",
        "<fim-middle>",
        end=("<fim-pad>", "<|endoftext|>", "<fim-prefix>"),
    ),
    FimFamily("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFamily("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", end=("▁<EOT>",)),
    FimFamily("codellama", "<PRE>", "<SUF>", "<MID>", end=("<EOT>", "▁<EOT>")),
    FimFamily("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
)


def fim_family(tokenizer: Tokenizer) -> FimFamily | None:
    """The FIM family whose tokens ``tokenizer`` has, or None (no infilling).

    Example::

        fim_family(qwen_coder_tokenizer).name  # "qwen"
    """
    for fam in FAMILIES:
        tokens = (fam.prefix, fam.suffix) + ((fam.middle,) if fam.middle else ())
        if all(tokenizer.token_to_id(t) is not None for t in tokens):
            return fam
    return None


def fim_stop_ids(tokenizer: Tokenizer) -> set[int]:
    """Token ids that end a middle besides the model's EOS (``<|fim_pad|>``,
    ``▁<EOT>``, a file separator ...): a base code model writes one of them
    when the middle is done. Empty for a model without FIM tokens."""
    fam = fim_family(tokenizer)
    if fam is None:
        return set()
    ids = (tokenizer.token_to_id(t) for t in fam.end)
    return {i for i in ids if i is not None}


def is_fim_prompt(tokenizer: Tokenizer, ids: Sequence[int]) -> bool:
    """Whether ``ids`` hold the model's FIM prefix and suffix tokens (a FIM prompt
    built by the client, which sends it as a plain completion prompt)."""
    fam = fim_family(tokenizer)
    if fam is None:
        return False
    marks = {tokenizer.token_to_id(fam.prefix), tokenizer.token_to_id(fam.suffix)}
    return marks <= set(ids)


def _id(tokenizer: Tokenizer, token: str) -> int:
    tid = tokenizer.token_to_id(token)
    assert tid is not None, token  # fim_family checked it
    return tid


def _extra_ids(
    tokenizer: Tokenizer, fam: FimFamily, extra: Sequence[Mapping[str, str]]
) -> list[int]:
    """Repository context before the prefix, laid out as llama.cpp's ``/infill``."""
    ids: list[int] = []
    repo = fam.repo_name and tokenizer.token_to_id(fam.repo_name)
    sep = fam.file_sep and tokenizer.token_to_id(fam.file_sep)
    if repo:
        ids += [repo, *tokenizer.encode_plain("myproject\n")]
    for chunk in extra:
        text = str(chunk.get("text", ""))
        filename = str(chunk.get("filename", "tmp"))
        if sep:
            ids += [sep, *tokenizer.encode_plain(filename + "\n")]
            ids += tokenizer.encode_plain(text)
        else:
            # No separator token: a plain-text divider, as llama.cpp writes.
            ids += tokenizer.encode_plain(f"\n\n--- snippet ---\n\n{text}")
    if sep:
        # The file being edited comes last; its name is not known here.
        ids += [sep, *tokenizer.encode_plain("filename\n")]
    return ids


def fim_prompt(
    tokenizer: Tokenizer,
    prefix: str,
    suffix: str,
    extra: Sequence[Mapping[str, str]] | None = None,
) -> list[int]:
    """Token ids of the fill-in-the-middle prompt for ``prefix`` / ``suffix``.

    Args:
        tokenizer: the model's tokenizer; its FIM tokens pick the family.
        prefix: the text before the cursor.
        suffix: the text after the cursor.
        extra: other files for context, each ``{"filename": ..., "text": ...}``
            (llama.cpp's ``input_extra``), placed before the prefix.

    Raises:
        InvalidRequest: the model has no fill-in-the-middle tokens (param ``suffix``).

    Example::

        fim_prompt(tok, "def f():\\n    ", "\\n")
        # [<|fim_prefix|>, ...prefix..., <|fim_suffix|>, ...suffix..., <|fim_middle|>]
    """
    fam = fim_family(tokenizer)
    if fam is None:
        raise InvalidRequest(
            "this model has no fill-in-the-middle tokens (such as <|fim_prefix|> or "
            "<fim_prefix>) in its tokenizer, so it cannot complete with a suffix; "
            "use a code model trained for infilling, or send the prompt without a suffix",
            param="suffix",
        )
    pre = [_id(tokenizer, fam.prefix), *tokenizer.encode_plain(prefix)]
    suf = [_id(tokenizer, fam.suffix), *tokenizer.encode_plain(suffix)]
    ids = _extra_ids(tokenizer, fam, extra) if extra else []
    ids += suf + pre if fam.suffix_first else pre + suf
    if fam.middle is not None:
        ids.append(_id(tokenizer, fam.middle))
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None:
        ids.insert(0, bos)
    return ids
