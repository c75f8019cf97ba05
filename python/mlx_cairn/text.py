"""Streaming text core: stop sequences, reasoning and tool-call parsing (Rust).

Three building blocks, each giving the same result for any chunking of the
same text (chunks may be cut at any character)::

    model text ──► StopScanner ──► OutputParser ──► Segments
                   (stops, held     (<think>, tool calls,
                    partial match)   end-of-turn markers)

:class:`TextPipeline` runs both in one call per decoded chunk; this is what
the engine uses::

    from mlx_cairn.text import TextPipeline

    pipe = TextPipeline(["###"], family="hermes", reasoning=True)
    for chunk in ["<think>pl", "an</think>Sure.", '<tool_call>{"name": "f", ',
                  '"arguments": {"x": 1}}</tool_call>']:
        segments, stop = pipe.push(chunk)
        for seg in segments:
            if seg.kind == "text":
                print(seg.text, end="")          # visible answer
            elif seg.kind == "reasoning":
                ...                              # thinking delta
            else:
                print(seg.name, seg.arguments)   # f {"x":1}
        if stop is not None:
            break                                # stop_reason = stop_sequence
    else:
        segments = pipe.flush()                  # end of generation
    # Generation cut by max_tokens instead: pipe.flush(cut=True) drops a
    # tool call left open, where flush() would return it as text.

Semantics in brief (see the class docstrings for details):

- Stops: the match that completes earliest wins, ties go to the stop listed
  first; text that may still become a stop is held back; nothing after a
  match is returned.
- Families (:data:`FAMILIES`; the table :mod:`mlx_cairn.tool_families`
  describes each): ``hermes`` (``<tool_call>{json}</tool_call>``),
  ``qwen3_coder``, ``llama3``, ``mistral``, ``harmony`` (gpt-oss: ``analysis``
  channel -> reasoning, ``to=functions.NAME`` messages -> calls, other
  channels -> text), ``glm45``, ``deepseek_v3``, ``kimi_k2``, ``gemma4``,
  ``minimax_m2`` and ``pythonic``; ``None`` parses no tool calls (use it
  when the request has no tools).
- ``tool_schemas=`` (the request's tools, ``{name: parameters schema}``)
  decides, for the formats whose argument values are raw text (``glm45``,
  ``minimax_m2``), which values stay strings; without it a value that
  parses as JSON is JSON.
- ``reasoning=True`` splits ``<think>..</think>`` into reasoning segments;
  ``starts_in_reasoning=True`` is for templates that open ``<think>`` in the
  prompt. End-of-turn markers (``<|im_end|>``, ``<|eot_id|>``, ...) are
  always dropped. A malformed tool call comes back as text, tags included;
  ``flush(cut=True)`` (generation cut by max_tokens) drops a call still open
  instead, and releases held text as ``flush()`` does.
- Whitespace right after a reasoning block or a tool call is dropped.
- Streamed segments may split one text run in several; :func:`coalesce`
  merges them, and ``coalesce(streamed) == parse_output(whole_text)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from mlx_cairn._core import (
    FAMILIES,
    OutputParser,
    Segment,
    StopScanner,
    TextPipeline,
    coalesce,
    parse_output,
    parser_tags,
)
from mlx_cairn.tool_families import names_where

#: The tool-call family names accepted by ``family=`` (for type checkers: the
#: names of :data:`mlx_cairn.tool_families.FAMILIES`, which the tests compare).
Family = Literal[
    "hermes",
    "qwen3_coder",
    "llama3",
    "mistral",
    "harmony",
    "glm45",
    "deepseek_v3",
    "kimi_k2",
    "gemma4",
    "minimax_m2",
    "pythonic",
]
SegmentKind = Literal["text", "reasoning", "tool_call"]

#: Families whose tags are special tokens of their models' tokenizers
#: (gpt-oss's ``<|channel|>``, Gemma 4's ``<|tool_call>``, Kimi's sections,
#: Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, ...): decoding
#: that skips special tokens loses their structure. (Hermes' ``<tool_call>``
#: is special in some tokenizers, Hermes 3's, and plain in Qwen's.) The
#: engine decodes every family's output with the parser's tags kept, special
#: or not (:func:`decode_skips`).
SPECIAL_TOKEN_FAMILIES: frozenset[str] = names_where("special_tokens")

#: Families whose replies are structured even without tools (gpt-oss writes
#: every answer in channels, Gemma 4 reasons in ``<|channel>``): they are
#: parsed whether or not the request offers tools.
STRUCTURAL_FAMILIES: frozenset[str] = names_where("structural")


def keeps_special_tokens(family: str | None) -> bool:
    """Whether ``family``'s structure is made of special tokens (see
    :data:`SPECIAL_TOKEN_FAMILIES`)."""
    return family in SPECIAL_TOKEN_FAMILIES


def decode_skips(
    specials: Mapping[str, int], family: str | None, reasoning: bool
) -> frozenset[int]:
    """The special tokens to drop when decoding output for a parser.

    Output is decoded with special tokens kept, except these: the ones the
    parser for ``family`` / ``reasoning`` does not read (:func:`parser_tags`),
    which would otherwise show as text (BOS, padding, Mistral's ``[INST]``,
    reserved tokens). Every tag the parser reads reaches it, whether the
    tokenizer makes it special or not; it drops the end-of-turn markers
    among them itself.

    >>> sorted(decode_skips({"<s>": 1, "[TOOL_CALLS]": 5, "[INST]": 3}, "mistral", False))
    [1, 3]
    """
    keep = set(parser_tags(family, reasoning))
    return frozenset(i for text, i in specials.items() if text not in keep)


def output_family(family: str | None, tools_on: bool) -> str | None:
    """The parser family for one request: the model's, unless it offers no
    tools and the family is not :data:`STRUCTURAL_FAMILIES`.

    >>> output_family("hermes", False), output_family("harmony", False)
    (None, 'harmony')
    """
    return family if tools_on or family in STRUCTURAL_FAMILIES else None


#: Families whose argument values are raw text, typed by the tools' schemas.
SCHEMA_FAMILIES: frozenset[str] = names_where("schema_typed")


def tool_schemas(family: str | None, tools: Iterable[Any]) -> dict[str, Any] | None:
    """``tool_schemas=`` for a request's tools (objects with ``name`` and
    ``parameters``): ``{name: parameters schema}``, or None when ``family``
    does not read them (:data:`SCHEMA_FAMILIES`)."""
    if family not in SCHEMA_FAMILIES:
        return None
    return {t.name: t.parameters for t in tools}


__all__ = [
    "FAMILIES",
    "SCHEMA_FAMILIES",
    "SPECIAL_TOKEN_FAMILIES",
    "STRUCTURAL_FAMILIES",
    "Family",
    "OutputParser",
    "Segment",
    "SegmentKind",
    "StopScanner",
    "TextPipeline",
    "coalesce",
    "decode_skips",
    "keeps_special_tokens",
    "output_family",
    "parse_output",
    "parser_tags",
    "tool_schemas",
]
