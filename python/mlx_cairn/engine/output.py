"""One sequence's text side: incremental detokenizer -> Rust TextPipeline -> Events.

The pipeline (``mlx_cairn.text.TextPipeline``) scans stop sequences and runs
the output parser (reasoning / tool-call tags) over each decoded chunk::

    out = SequenceOutput(tokenizer, prepared)
    events, matched = out.push(token_id)   # matched: the stop sequence that ended it
    events += out.flush()                   # at EOS / max_tokens
"""

from __future__ import annotations

import secrets
from typing import Any

from mlx_cairn.engine.sequence import PreparedRequest
from mlx_cairn.text import TextPipeline
from mlx_cairn.types import Event, ReasoningDelta, TextDelta, ToolCall


class SequenceOutput:
    """Detokenizes one sequence's tokens and turns the text into Events."""

    def __init__(self, tokenizer: Any, prepared: PreparedRequest) -> None:
        self._detok = tokenizer.detokenizer()
        self._pipeline = TextPipeline(
            list(prepared.request.stop),
            family=prepared.parser_family,
            reasoning=prepared.reasoning,
            starts_in_reasoning=prepared.in_reasoning and prepared.reasoning,
        )
        self.saw_tool_call = False

    def push(self, token_id: int) -> tuple[list[Event], str | None]:
        """Feed one sampled (non-EOS) token; return its events and a matched stop, if any."""
        text = self._detok.add(token_id)
        if not text:
            return [], None
        return self._feed(text, final=False)

    def flush(self) -> list[Event]:
        """End of generation: release anything held back."""
        events, _ = self._feed(self._detok.flush(), final=True)
        return events

    def _feed(self, text: str, *, final: bool) -> tuple[list[Event], str | None]:
        segments, matched = self._pipeline.push(text) if text else ([], None)
        if final and matched is None:
            segments = [*segments, *self._pipeline.flush()]
        events = [_event(s) for s in segments if s.kind == "tool_call" or s.text]
        if any(isinstance(e, ToolCall) for e in events):
            self.saw_tool_call = True
        return events, matched


def _event(seg: Any) -> Event:
    """Map a pipeline ``Segment`` to an Event."""
    if seg.kind == "text":
        return TextDelta(seg.text)
    if seg.kind == "reasoning":
        return ReasoningDelta(seg.text)
    if seg.kind == "tool_call":
        return ToolCall(f"call_{secrets.token_hex(12)}", seg.name or "", seg.arguments or "{}")
    raise TypeError(f"unexpected text pipeline segment {seg!r}")
