"""One sequence's text side: incremental detokenizer -> Rust TextPipeline -> Events.

The pipeline (``mlx_cairn.text.TextPipeline``) scans stop sequences and runs
the output parser (reasoning / tool-call tags) over each decoded chunk::

    out = SequenceOutput(tokenizer, prepared)
    events, matched = out.push(token_id)   # matched: the stop sequence that ended it
    events += out.flush()                   # at EOS / max_tokens
"""

from __future__ import annotations

from typing import Any

from mlx_cairn.engine.sequence import PreparedRequest
from mlx_cairn.types import Event, ReasoningDelta, TextDelta, ToolCall

try:  # the Rust text pipeline
    from mlx_cairn.text import TextPipeline  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - only while the extension lacks it
    TextPipeline = None


class SequenceOutput:
    """Detokenizes one sequence's tokens and turns the text into Events."""

    def __init__(self, tokenizer: Any, prepared: PreparedRequest) -> None:
        self._detok = tokenizer.detokenizer()
        self._pipeline: Any = None
        if TextPipeline is not None:
            self._pipeline = TextPipeline(
                stop=list(prepared.request.stop),
                parser=prepared.parser_family,
                reasoning=prepared.reasoning,
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
        if self._pipeline is None:
            return ([TextDelta(text)] if text else []), None
        segments, matched = self._pipeline.push(text) if text else ([], None)
        events = [_event(s) for s in segments]
        if final and matched is None:
            events += [_event(s) for s in self._pipeline.flush()]
        if any(isinstance(e, ToolCall) for e in events):
            self.saw_tool_call = True
        return [e for e in events if e is not None], matched


def _event(seg: Any) -> Event:
    """Map a pipeline segment to an Event (segments may already be Events)."""
    if isinstance(seg, (TextDelta, ReasoningDelta, ToolCall)):
        return seg
    raise TypeError(f"unexpected text pipeline segment {seg!r}")
