"""Type stubs for the private extension `mlx_cairn._core` (checked by mypy.stubtest).

Users import the facades `mlx_cairn.text`, `mlx_cairn.sse` and `mlx_cairn.kv`.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeAlias, final

from typing_extensions import Buffer

__version__: str
# Names the extension exports (pyo3 fills __all__); each section lists its own.
__all__ = [  # noqa: RUF022  (grouped by section)
    "__version__",
    # sse
    "SseDecoder",
    "SseEvent",
    "encode_comment",
    "encode_event",
    "encode_ping",
    # kv
    "BlockHashes",
    "BlockPool",
    "PrefixCache",
    # text
    "FAMILIES",
    "OutputParser",
    "Segment",
    "StopScanner",
    "TextPipeline",
    "coalesce",
    "parse_output",
    "parser_tags",
    # constrain
    "CompiledGrammar",
    "GrammarMatcher",
    "GrammarVocabulary",
]

# ---------------------------------------------------------------------------
# text: stop-sequence scanner and output parser (rust/text, bindings/src/text.rs)
# ---------------------------------------------------------------------------

#: Tool-call family names accepted by ``family=``.
FAMILIES: list[str]

#: ``tool_schemas=``: tool name -> its parameters' JSON Schema, a list of
#: tools (``{"name", "parameters" | "input_schema"}``, or OpenAI's
#: ``{"type": "function", "function": {...}}``), or that as JSON text.
_ToolSchemas: TypeAlias = str | dict[str, Any] | Sequence[Any] | None

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
        *,
        tool_schemas: _ToolSchemas = None,
    ) -> OutputParser: ...
    @property
    def family(self) -> str | None: ...
    @property
    def reasoning(self) -> bool: ...
    @property
    def starts_in_reasoning(self) -> bool: ...
    def push(self, text: str) -> list[Segment]: ...
    def flush(self, *, cut: bool = False) -> list[Segment]:
        """Ends the stream; ``cut=True`` (max_tokens) drops a tool call still open."""

@final
class TextPipeline:
    """StopScanner then OutputParser, one call per decoded chunk."""

    def __new__(
        cls,
        stops: Sequence[str],
        family: str | None = None,
        reasoning: bool = False,
        starts_in_reasoning: bool = False,
        *,
        tool_schemas: _ToolSchemas = None,
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
    def flush(self, *, cut: bool = False) -> list[Segment]:
        """Ends the stream; ``cut=True`` (max_tokens) drops a tool call still open."""

def parse_output(
    text: str,
    family: str | None = None,
    reasoning: bool = False,
    starts_in_reasoning: bool = False,
    *,
    tool_schemas: _ToolSchemas = None,
) -> list[Segment]: ...
def coalesce(segments: Sequence[Segment]) -> list[Segment]: ...
def parser_tags(family: str | None = None, reasoning: bool = False) -> list[str]: ...

# (end of text section)

# ---------------------------------------------------------------------------
# sse: SSE frame encoder / decoder (rust/sse, bindings/src/sse.rs)
# ---------------------------------------------------------------------------

@final
class SseEvent:
    """One decoded Server-Sent Event."""

    def __new__(
        cls, data: str, event: str | None = None, id: str | None = None, retry: int | None = None
    ) -> SseEvent: ...
    @property
    def event(self) -> str | None:
        """The ``event:`` field; None means the default type ("message")."""
    @property
    def data(self) -> str:
        """The data lines joined with LF."""
    @property
    def id(self) -> str | None:
        """The stream's last event id at dispatch (it persists across events)."""
    @property
    def retry(self) -> int | None:
        """A ``retry:`` value (milliseconds) seen since the previous event."""
    def __eq__(self, other: object, /) -> bool: ...

@final
class SseDecoder:
    """Incremental WHATWG event-stream decoder; feed bytes in any chunking."""

    def __new__(cls, max_event_bytes: int | None = None) -> SseDecoder: ...
    def feed(self, chunk: bytes | bytearray | memoryview | str) -> list[SseEvent]:
        """Decode one chunk; returns the events it completed."""
    def finish(self) -> bool:
        """End the stream (an incomplete event is dropped); True if something was dropped."""
    @property
    def has_partial(self) -> bool:
        """True while an unfinished line or event is buffered."""
    @property
    def last_event_id(self) -> str | None: ...

def encode_event(
    event: str | None, data: str | bytes, *, id: str | None = None, retry: int | None = None
) -> bytes:
    """One event frame: ``event:`` line if named, one ``data:`` line per line of data."""

def encode_comment(text: str = "") -> bytes:
    """A comment frame (``: text``), ignored by clients; keeps connections alive."""

def encode_ping() -> bytes:
    """The Anthropic keep-alive frame ``event: ping`` / ``data: {"type": "ping"}``."""

# (end of sse section)

# ---------------------------------------------------------------------------
# kv: block pool and prefix cache (rust/kv, bindings/src/kv.rs)
# ---------------------------------------------------------------------------

# Token ids: a list/tuple/iterable of ints or a 1-D integer buffer (numpy int32,
# array.array("i")), each in 0..2**31. (Stub-only alias.)
_TokenIds: TypeAlias = Iterable[int] | Buffer

@final
class BlockPool:
    """Fixed-size KV block allocator; block 0 is reserved, ids are 1..num_blocks-1.

    Freed blocks go to the tail of an LRU free list and keep their prefix-cache
    hash until ``allocate`` re-uses them (evicting the hash then).
    """

    def __new__(cls, num_blocks: int, block_size: int) -> BlockPool: ...
    @property
    def num_blocks(self) -> int:
        """Total block ids, including the reserved block 0."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (refcount 0, cached or not)."""
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with refcount 1, least recently freed first; None if fewer are free."""
    def free(self, block_ids: _TokenIds) -> None:
        """Drop one reference from each block (in reverse order); ValueError and no change on bad ids."""
    def refcount(self, block_id: int) -> int:
        """Current references on ``block_id`` (0 for block 0)."""
    def free_list(self) -> list[int]:
        """Free block ids in eviction order, next to be re-used first. O(num_free)."""
    def check_invariants(self) -> None:
        """Raise RuntimeError if an internal invariant is broken. O(num_blocks); for tests."""

@final
class BlockHashes:
    """Chained hashes of a prompt's full blocks, from ``PrefixCache.hash_blocks``.

    Pass it to ``lookup``/``insert`` of the same cache instead of the token ids to
    hash a prompt once. The salt given to ``hash_blocks`` is part of it.
    """

    @property
    def num_tokens(self) -> int:
        """Length of the prompt that was hashed (including a partial last block)."""
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> int:
        """The 128-bit hash of block ``index`` as an int."""

@final
class PrefixCache:
    """Content-addressed prefix cache over a ``BlockPool`` (see ``mlx_cairn.kv``)."""

    def __new__(cls, pool: BlockPool, seed: int | None = None) -> PrefixCache: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def block_size(self) -> int: ...
    def hash_blocks(
        self,
        tokens: _TokenIds,
        salt: str | bytes | None = None,
        *,
        prefix: BlockHashes | None = None,
    ) -> BlockHashes:
        """Hash every full block of ``tokens`` once, for reuse by lookup and insert.

        With ``prefix`` (whose tokens end on a block boundary), ``tokens`` continue it:
        the result equals hashing the whole sequence, at the cost of the new part only.
        """
    def lookup(self, tokens: _TokenIds | BlockHashes, salt: str | bytes | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks, one reference taken on each.

        Never covers the whole prompt: at most ``(len(tokens) - 1) // block_size`` blocks.
        """
    def insert(
        self,
        tokens: _TokenIds | BlockHashes,
        block_ids: _TokenIds,
        salt: str | bytes | None = None,
    ) -> int:
        """Register the full blocks of ``tokens`` as held in ``block_ids``; returns new entries."""
    def block_hash(self, block_id: int) -> int | None:
        """The hash ``block_id`` is cached under, or None."""
    def stats(self) -> dict[str, Any]:
        """blocks_total/free/in_use/cached, lookups, hit_tokens, miss_tokens, evictions."""

# (end of kv section)

# --------------------------------------------------------------- constrain

@final
class GrammarVocabulary:
    """A tokenizer's token trie for grammar-constrained decoding (llguidance)."""

    def __new__(cls, tokenizer_json: str, eos_ids: list[int], width: int) -> GrammarVocabulary: ...
    @property
    def width(self) -> int: ...
    def compile_json_schema(self, schema: str) -> CompiledGrammar: ...
    def compile_lark(self, grammar: str) -> CompiledGrammar: ...
    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher: ...

@final
class CompiledGrammar:
    """A compiled grammar (one per request)."""

@final
class GrammarMatcher:
    """One generating row's position in its grammar."""

    def consume(self, token: int) -> None: ...
    def mask(self) -> bytes: ...
    def is_accepting(self) -> bool: ...
    def is_stopped(self) -> bool: ...
