"""One sequence's text side: incremental detokenizer -> Rust TextPipeline -> Events.

The pipeline (``mlx_cairn.text.TextPipeline``) scans stop sequences and runs
the output parser (reasoning / tool-call tags) over each decoded chunk::

    out = SequenceOutput(tokenizer, prepared)
    events, matched = out.push(token_id)   # matched: the stop sequence that ended it
    events += out.flush()                   # at EOS (cut=True at max_tokens)
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

import orjson

from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.text import TextPipeline, decode_skips, tool_schemas
from mlx_cairn.types import Event, ReasoningDelta, TextDelta, ToolCall


class SequenceOutput:
    """Detokenizes one sequence's tokens and turns the text into Events."""

    def __init__(self, tokenizer: Any, prepared: PreparedRequest) -> None:
        family = prepared.parser_family
        # The parser's tags must reach it even when they are special tokens
        # ([TOOL_CALLS], <|python_tag|>, <|channel|>, ...); the other special
        # tokens (BOS, padding, [INST], ...) are dropped here instead.
        self._skip = decode_skips(tokenizer.special_tokens, family, prepared.reasoning)
        self._detok = tokenizer.detokenizer(skip_special_tokens=False)
        self._pipeline = TextPipeline(
            list(prepared.request.stop),
            family=family,
            reasoning=prepared.reasoning,
            starts_in_reasoning=prepared.in_reasoning and prepared.reasoning,
            tool_schemas=tool_schemas(family, prepared.request.tools),
        )
        self.saw_tool_call = False
        # Under tool_choice "required" the model must call and then may stop; a
        # small model that would rather go on writes the same call again and
        # again. A call it already made this turn ends the turn instead: the
        # client would only run the same tool twice with the same input.
        req = prepared.request
        self._end_on_repeat = req.offers_tools and req.tool_choice == "required"
        self._calls: set[tuple[str, bytes]] = set()
        #: The turn ended at a repeated call (dropped); nothing more is read.
        self.repeated = False

    def push(self, token_id: int) -> tuple[list[Event], str | None]:
        """Feed one sampled (non-EOS) token; return its events and a matched stop, if any."""
        if token_id in self._skip:
            return [], None
        text = self._detok.add(token_id)
        if not text:
            return [], None
        return self._feed(text, final=False)

    def flush(self, *, cut: bool = False) -> list[Event]:
        """End of generation: release anything held back.

        ``cut``: generation was cut short (max_tokens), so a tool call still
        open is dropped, never shown as text; at an end of turn a malformed
        call comes back as text instead (nothing the model finished is lost).
        """
        events, _ = self._feed(self._detok.flush(), final=True, cut=cut)
        return events

    def _feed(self, text: str, *, final: bool, cut: bool = False) -> tuple[list[Event], str | None]:
        segments, matched = self._pipeline.push(text) if text else ([], None)
        if final and matched is None:
            segments = [*segments, *self._pipeline.flush(cut=cut)]
        events = [_event(s) for s in segments if s.kind == "tool_call" or s.text]
        if self._end_on_repeat:
            events = self._until_repeat(events)
        if any(isinstance(e, ToolCall) for e in events):
            self.saw_tool_call = True
        return events, matched

    def _until_repeat(self, events: list[Event]) -> list[Event]:
        for i, ev in enumerate(events):
            if isinstance(ev, ToolCall):
                key = (ev.name, _canonical(ev.arguments))
                if key in self._calls:
                    self.repeated = True
                    return events[:i]
                self._calls.add(key)
        return events


def _canonical(arguments: str) -> bytes:
    """The arguments as one JSON value with sorted keys (the text when not JSON)."""
    try:
        return orjson.dumps(orjson.loads(arguments), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        return arguments.encode()


def _event(seg: Any) -> Event:
    """Map a pipeline ``Segment`` to an Event."""
    if seg.kind == "text":
        return TextDelta(seg.text)
    if seg.kind == "reasoning":
        return ReasoningDelta(seg.text)
    if seg.kind == "tool_call":
        return ToolCall(f"call_{secrets.token_hex(12)}", seg.name or "", seg.arguments or "{}")
    raise TypeError(f"unexpected text pipeline segment {seg!r}")


def token_text(tokenizer: Any, token_id: int) -> tuple[str, tuple[int, ...]]:
    """One token's text (as it decodes alone) and its bytes.

    A token holding part of a UTF-8 character decodes to U+FFFD; its bytes
    come from the vocabulary piece then: SentencePiece byte-fallback pieces
    (``<0xAB>``) and byte-level BPE pieces (GPT-2's byte-to-character table).
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, tuple(text.encode("utf-8"))
    piece = tokenizer.id_to_token(token_id) or ""
    m = _BYTE_PIECE.fullmatch(piece)
    if m is not None:
        return text, (int(m.group(1), 16),)
    table = _byte_decoder()
    if piece and all(ch in table for ch in piece):
        return text, tuple(table[ch] for ch in piece)
    return text, tuple(text.encode("utf-8"))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character table, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}
