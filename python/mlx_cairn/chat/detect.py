"""Which output-parser family and reasoning mode a model uses, read from its template and vocabulary.

The families (the Rust output parser implements each) and the signs that give
each away are the table :mod:`mlx_cairn.tool_families`: a family is known by
markers only its chat template contains (the template renders earlier tool
calls in the model's own syntax, or tells the model that syntax), tried most
specific first (:data:`mlx_cairn.tool_families.SIGNS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mlx_cairn._core import FAMILIES
from mlx_cairn.chat.template import ChatTemplate
from mlx_cairn.errors import InvalidRequest, ModelLoadError
from mlx_cairn.tool_families import FAMILIES as _TABLE
from mlx_cairn.tool_families import SIGNS
from mlx_cairn.types import Message

#: Every output-parser family (the Rust parser's list).
PARSER_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def _renders_calls_only(src: str) -> bool:
    """The template renders ``tool_calls`` but no ``tools`` list."""
    return re.search(r"\btool_calls\b", src) is not None and re.search(r"\btools\b", src) is None


#: Template kwargs that switch reasoning on/off, in the order we look for them.
_REASONING_KWARGS = ("enable_thinking", "thinking", "reasoning")


@dataclass(frozen=True, slots=True)
class ReasoningInfo:
    """How a model reasons.

    Attributes:
        supported: the model emits reasoning blocks (``<think>...</think>``,
            or its family's own: gpt-oss's analysis channel, Gemma 4's
            ``<|channel>``).
        kwarg: the template variable that turns reasoning on/off
            (e.g. ``"enable_thinking"``), or None when there is none.
        default_on: reasoning is on when the request does not say.
        open_tag / close_tag: the reasoning delimiters.

    Whether a prompt's generation starts *inside* ``<think>`` depends on the
    rendered prompt (templates may open the block themselves); see
    :func:`starts_in_reasoning`.
    """

    supported: bool = False
    kwarg: str | None = None
    default_on: bool = False
    open_tag: str = "<think>"
    close_tag: str = "</think>"


def detect_parser_family(template_source: str, vocab: set[str] | None = None) -> str | None:
    """Guess the tool-call output format from the chat template (and vocabulary).

    A template with a family's markers that does not render the tools list
    (DeepSeek-R1 distills and V3.1 render calls only) gets tools and calls
    spelled the Hermes way by ChatTemplate, so this returns None for it.
    """
    src = template_source
    vocab = vocab or set()
    for family, sign in SIGNS:
        if sign.matches(src, vocab):
            # Calls rendered without the tools list: ChatTemplate's fallback.
            return None if sign.strength == "own" and _renders_calls_only(src) else family
    return None


#: Each family's own reasoning (gpt-oss's analysis channel, Gemma 4's
#: ``<|channel>``, Mistral's ``[THINK]``): (the template markers that show it,
#: the mode), in table order.
_FAMILY_REASONING: tuple[tuple[tuple[str, ...], ReasoningInfo], ...] = tuple(
    (
        f.reasoning.markers,
        ReasoningInfo(
            supported=True,
            kwarg=f.reasoning.kwarg,
            default_on=f.reasoning.default_on,
            open_tag=f.reasoning.open_tag,
            close_tag=f.reasoning.close_tag,
        ),
    )
    for f in _TABLE
    if f.reasoning is not None
)


def detect_reasoning(template_source: str, vocab: set[str] | None = None) -> ReasoningInfo:
    """Read the reasoning mode from the template source and vocabulary."""
    # The tags in the vocabulary alone do not make a reasoning model (many
    # tokenizers carry them); the template must know about them.
    del vocab
    src = template_source
    for markers, info in _FAMILY_REASONING:
        if any(m in src for m in markers):
            return info
    if "<think>" not in src and "</think>" not in src:
        return ReasoningInfo()
    kwarg, default_on = _reasoning_switch(src)
    return ReasoningInfo(supported=True, kwarg=kwarg, default_on=default_on)


def _reasoning_switch(src: str) -> tuple[str | None, bool]:
    """(the template variable that switches reasoning, whether it is on when unset).

    A candidate (:data:`_REASONING_KWARGS`) must be a variable the template's
    code reads (not a word in its prose or comments, nor ``reasoning_content``)
    and must change the generation prompt; its default is whichever setting
    renders like leaving it unset. Without one, reasoning is always on.
    """
    names = _code_names(src)
    for kwarg in (k for k in _REASONING_KWARGS if k in names):
        try:
            unset, on, off = (_generation_prompt(src, v, kwarg) for v in (None, True, False))
        except (InvalidRequest, ModelLoadError):
            # A template that does not render a lone user turn: read the source.
            default_off = f"{kwarg} is defined and {kwarg} is true" in src
            return kwarg, not default_off
        if on != off:
            return kwarg, unset != off
    return None, True


_COMMENT = re.compile(r"\{#.*?#\}", re.S)
_CODE = re.compile(r"\{%(.*?)%\}|\{\{(.*?)\}\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")


def _code_names(src: str) -> set[str]:
    """Names a template's code uses (outside comments, prose and string literals)."""
    code = " ".join(a or b for a, b in _CODE.findall(_COMMENT.sub("", src)))
    return set(_NAME.findall(_STRING.sub("", code)))


def _generation_prompt(src: str, value: bool | None, kwarg: str) -> str:
    kwargs: dict[str, Any] = {} if value is None else {kwarg: value}
    return ChatTemplate(src).render([Message("user", "hi")], None, True, **kwargs)


def starts_in_reasoning(prompt_text: str, info: ReasoningInfo) -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model."""
    if not info.supported:
        return False
    i = prompt_text.rfind(info.open_tag)
    return i >= 0 and prompt_text.rfind(info.close_tag) < i
