"""Type stubs for the private extension `mlx_cairn._core` (checked by mypy.stubtest).

Users import the facades `mlx_cairn.text`, `mlx_cairn.sse` and `mlx_cairn.kv`.
"""

__version__: str
# pyo3 lists every registered name in __all__; each section appends its own.
__all__ = ["__version__"]

# ---------------------------------------------------------------------------
# text: stop-sequence scanner and output parser (rust/text, bindings/src/text.rs)
# ---------------------------------------------------------------------------

from collections.abc import Sequence
from typing import Literal, final

__all__ += [
    "FAMILIES",
    "OutputParser",
    "Segment",
    "StopScanner",
    "TextPipeline",
    "coalesce",
    "parse_output",
]

#: Tool-call family names accepted by ``family=``.
FAMILIES: list[str]

@final
class Segment:
    """One piece of parsed model output."""

    def __new__(
        cls,
        kind: Literal["text", "reasoning", "tool_call"],
        text: str = "",
        *,
        name: str | None = None,
        arguments: str | None = None,
        raw: str = "",
    ) -> Segment: ...
    @property
    def kind(self) -> Literal["text", "reasoning", "tool_call"]: ...
    @property
    def text(self) -> str:
        """Text of a text or reasoning segment ("" for a tool call)."""
    @property
    def name(self) -> str | None:
        """Tool name (None unless a tool call)."""
    @property
    def arguments(self) -> str | None:
        """JSON text of the arguments object (None unless a tool call)."""
    @property
    def raw(self) -> str:
        """The model's text of a tool call without its tags ("" otherwise)."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class StopScanner:
    """Streaming stop-sequence scanner: earliest completed match wins."""

    def __new__(cls, stops: Sequence[str]) -> StopScanner: ...
    @property
    def stops(self) -> list[str]: ...
    def push(self, text: str) -> tuple[str, str | None]: ...
    def flush(self) -> tuple[str, str | None]: ...

@final
class OutputParser:
    """Streaming parser for reasoning and tool-call tags."""

    def __new__(
        cls,
        family: str | None = None,
        reasoning: bool = False,
        starts_in_reasoning: bool = False,
    ) -> OutputParser: ...
    @property
    def family(self) -> str | None: ...
    @property
    def reasoning(self) -> bool: ...
    @property
    def starts_in_reasoning(self) -> bool: ...
    def push(self, text: str) -> list[Segment]: ...
    def flush(self) -> list[Segment]: ...

@final
class TextPipeline:
    """StopScanner then OutputParser, one call per decoded chunk."""

    def __new__(
        cls,
        stops: Sequence[str],
        family: str | None = None,
        reasoning: bool = False,
        starts_in_reasoning: bool = False,
    ) -> TextPipeline: ...
    @property
    def stops(self) -> list[str]: ...
    @property
    def family(self) -> str | None: ...
    @property
    def reasoning(self) -> bool: ...
    @property
    def starts_in_reasoning(self) -> bool: ...
    def push(self, text: str) -> tuple[list[Segment], str | None]: ...
    def flush(self) -> list[Segment]: ...

def parse_output(
    text: str,
    family: str | None = None,
    reasoning: bool = False,
    starts_in_reasoning: bool = False,
) -> list[Segment]: ...
def coalesce(segments: Sequence[Segment]) -> list[Segment]: ...

# (end of text section)

# ---------------------------------------------------------------------------
# sse: SSE frame encoder / decoder (rust/sse, bindings/src/sse.rs)
# ---------------------------------------------------------------------------

# (end of sse section)

# ---------------------------------------------------------------------------
# kv: block pool and prefix cache (rust/kv, bindings/src/kv.rs)
# ---------------------------------------------------------------------------

# (end of kv section)
