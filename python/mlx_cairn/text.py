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

Semantics in brief (see the class docstrings for details):

- Stops: the match that completes earliest wins, ties go to the stop listed
  first; text that may still become a stop is held back; nothing after a
  match is returned.
- Families (:data:`FAMILIES`): ``hermes`` (``<tool_call>{json}</tool_call>``),
  ``qwen3_coder`` (``<tool_call><function=..><parameter=..>``), ``llama3``
  (``<|python_tag|>`` and bare JSON replies), ``mistral`` (``[TOOL_CALLS]``);
  ``None`` parses no tool calls (use it when the request has no tools).
- ``reasoning=True`` splits ``<think>..</think>`` into reasoning segments;
  ``starts_in_reasoning=True`` is for templates that open ``<think>`` in the
  prompt. End-of-turn markers (``<|im_end|>``, ``<|eot_id|>``, ...) are
  always dropped. A malformed tool call comes back as text, tags included.
- Whitespace right after a reasoning block or a tool call is dropped.
- Streamed segments may split one text run in several; :func:`coalesce`
  merges them, and ``coalesce(streamed) == parse_output(whole_text)``.
"""

from __future__ import annotations

from typing import Literal

from mlx_cairn._core import (
    FAMILIES,
    OutputParser,
    Segment,
    StopScanner,
    TextPipeline,
    coalesce,
    parse_output,
)

#: The tool-call family names accepted by ``family=``.
Family = Literal["hermes", "qwen3_coder", "llama3", "mistral"]
SegmentKind = Literal["text", "reasoning", "tool_call"]

__all__ = [
    "FAMILIES",
    "Family",
    "OutputParser",
    "Segment",
    "SegmentKind",
    "StopScanner",
    "TextPipeline",
    "coalesce",
    "parse_output",
]
