"""The shared vocabulary: a dialect-neutral chat request and the Event stream.

Every dialect (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses)
maps its request body to a :class:`ChatRequest`; the engine turns it into an
async stream of :data:`Event`; each dialect encodes that stream as SSE or
folds it into one JSON body (docs/design.md §1). Nothing here imports MLX.

Example::

    req = ChatRequest(messages=[Message("user", "Hi")], max_tokens=32)
    async for ev in engine.generate(req):
        if isinstance(ev, TextDelta):
            print(ev.text, end="")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]

#: Stop sequences per request, and characters per stop sequence. The engine
#: enforces them; every dialect checks them first to name its own field.
MAX_STOP_SEQUENCES = 64
MAX_STOP_SEQUENCE_CHARS = 1024
#: Numeric limits of the sampling settings, read by the engine and every dialect:
#: ``top_k`` is an int32 in the sampler; seeds are 64-bit; a temperature below
#: ``GREEDY_BELOW_TEMPERATURE`` samples greedily (dividing logits by a smaller
#: one only overflows the softmax: 1e-38 used to give empty output).
MAX_TOP_K = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
GREEDY_BELOW_TEMPERATURE = 1e-5
#: Bounds of the logits processors' settings (OpenAI's ranges; vLLM's for
#: ``repetition_penalty``, which must be > 0 and is capped here).
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Bound:
    """The range of one numeric setting: ``lo <= v <= hi`` (``lo < v`` when ``lo_open``),
    finite, and an ``int`` when ``integer``.

    Example: ``SAMPLING_BOUNDS["top_p"].holds(0)`` is False, ``.describe()`` is
    ``"in (0, 1]"``.
    """

    lo: int | float
    hi: int | float
    lo_open: bool = False
    integer: bool = False
    #: How a refusal words the range, where the bounds alone say it badly.
    what: str | None = None

    def holds(self, v: Any) -> bool:
        """Whether ``v`` is in range (bools never are)."""
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(v):
            return False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def describe(self) -> str:
        """The range in words, after "must be": ``in [0, 1]``, ``an integer in [0, 20]``."""
        if self.what is not None:
            return self.what
        if self.hi == math.inf:
            return f"a finite number >= {self.lo}"
        span = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        return f"an integer in {span}" if self.integer else f"in {span}"


#: The range of every numeric sampling setting, checked by the engine
#: (``engine/prepare.py``) and by every dialect's reader (``protocol/sampling.py``)
#: from this one table. A dialect may lower ``temperature``'s ceiling (Anthropic 1,
#: OpenAI 2); ``logit_bias`` bounds each value.
SAMPLING_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0, math.inf),
    "top_p": Bound(0, 1, lo_open=True),
    "top_k": Bound(0, MAX_TOP_K, integer=True),
    "min_p": Bound(0, 1),
    "frequency_penalty": Bound(-MAX_PENALTY, MAX_PENALTY),
    "presence_penalty": Bound(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Bound(0, MAX_REPETITION_PENALTY, lo_open=True),
    "logit_bias": Bound(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
    "top_logprobs": Bound(0, MAX_TOP_LOGPROBS, integer=True),
    "seed": Bound(MIN_SEED, MAX_SEED, integer=True, what="a 64-bit integer"),
}
#: Speculative decoding modes the engine and ``cairn serve`` take, and the most
#: draft tokens per step and row by default (bench/bench_speculative.py) and at most.
SPECULATIVE_MODES = ("ngram",)
#: Quantized KV cache widths (``--kv-bits``; None is full precision), and the
#: group sizes ``mx.quantize`` takes (``--kv-group-size``).
KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_NUM_SPECULATIVE = 8
MAX_NUM_SPECULATIVE = 64
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call, both as an Event and inside an assistant :class:`Message`.

    ``arguments`` is the JSON text of an object (``"{}"`` when empty).
    """

    id: str
    name: str
    arguments: str


#: Where an image sits in a :class:`Message`'s ``content``: one mark per entry of
#: ``Message.images``, in order (a private-use character; the wire removes it
#: from client text, so every mark is an image).
IMAGE_MARK = "\ue0f0"


@dataclass(frozen=True, slots=True)
class Image:
    """A picture from a request, decoded and validated at the wire.

    ``pixels`` is an RGB ``PIL.Image.Image`` (GIFs: their first frame).
    ``digest`` is its identity in the prefix cache and the vision-feature
    cache: a SHA-256 of the decoded pixels and their size, so the same picture
    sent as PNG or as base64 twice is one image, and two pictures never are.

    Example::

        img = Image.from_pil(PIL.Image.new("RGB", (32, 32), "red"))
        Message("user", f"What is this? {IMAGE_MARK}", images=[img])
    """

    pixels: Any
    digest: str
    width: int
    height: int

    @classmethod
    def from_pil(cls, picture: Any) -> Image:
        """An :class:`Image` of a PIL picture (converted to RGB)."""
        import hashlib

        rgb = picture if picture.mode == "RGB" else picture.convert("RGB")
        h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
        h.update(rgb.tobytes())
        return cls(rgb, h.hexdigest(), rgb.width, rgb.height)


@dataclass(slots=True)
class Message:
    """One conversation turn in dialect-neutral form."""

    role: Role
    content: str = ""
    #: Reasoning text an assistant produced in an earlier turn.
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: For role "tool": the id of the call this result answers, and its name.
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    #: The pictures this turn carries, in the order of the IMAGE_MARKs in ``content``.
    images: list[Image] = field(default_factory=list)


@dataclass(slots=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON Schema object."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    #: Calls must match ``parameters`` exactly (OpenAI / Anthropic ``strict``): once
    #: the model opens a call, decoding is constrained to the tools' schemas.
    strict: bool = False


@dataclass(slots=True)
class OutputFormat:
    """Structured output: the answer is one JSON value matching ``schema``
    (None: any JSON object, OpenAI's ``json_object``). Decoding is constrained
    to it, so it always parses."""

    schema: dict[str, Any] | None = None
    #: The dialect's name for the format (OpenAI ``json_schema.name``), for echoes.
    name: str = ""
    strict: bool = True
    #: Where the dialect takes it from, for errors ("response_format", "text.format", ...).
    param: str = "response_format"


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    #: Logits processors (each off at its default). ``repetition_penalty``
    #: divides positive / multiplies negative logits of every token seen in the
    #: prompt or output; ``frequency_penalty`` subtracts count x penalty and
    #: ``presence_penalty`` subtracts the penalty once, over output tokens;
    #: ``logit_bias`` adds its value to that token id's logit.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: Report each sampled token's log-probability (``TokenLogprob`` events),
    #: with the ``top_logprobs`` most likely alternatives (0..MAX_TOP_LOGPROBS).
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def uses_processors(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )


@dataclass(slots=True)
class RawPrompt:
    """A prompt that bypasses the chat template (legacy completions, fill-in-the-middle).

    Exactly one of ``text`` / ``ids`` is the prompt. With ``suffix`` set the
    prompt is a fill-in-the-middle one: ``text`` is the code before the
    cursor, ``suffix`` the code after it, built with the model's own FIM
    tokens (:func:`mlx_cairn.chat.fim.fim_prompt`). Output is plain text: no
    reasoning split, no tool-call parsing.

    Example::

        ChatRequest(messages=[], raw=RawPrompt(text="def add(a, b):"), max_tokens=16)
        ChatRequest(messages=[], raw=RawPrompt(text="def f():\\n    ", suffix="\\n"))
    """

    text: str = ""
    #: Token ids sent by the client instead of text (prefilled as they are).
    ids: list[int] | None = None
    #: The text after the cursor (fill-in-the-middle). An empty suffix on a
    #: model without FIM tokens is a plain completion: nothing follows the cursor.
    suffix: str | None = None
    #: Other files as FIM context, each ``{"filename": ..., "text": ...}``.
    extra: list[dict[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ChatRequest:
    """A validated, dialect-neutral generation request."""

    messages: list[Message]
    model: str = ""
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    #: "auto" | "none" | "required" | {"name": ...}; None means "auto".
    #: "required" and a name are enforced by a grammar (the call always comes).
    tool_choice: str | dict[str, Any] | None = None
    #: Whether one answer may hold several tool calls.
    parallel_tool_calls: bool = True
    #: Structured output (JSON constrained to a schema), or None for free text.
    output_format: OutputFormat | None = None
    #: Reasoning switch: None = the model's default, else on / off.
    reasoning: bool | None = None
    #: Most reasoning tokens before the engine closes the reasoning block
    #: itself (the model's end-of-reasoning tag) so the answer follows; None: no limit.
    reasoning_budget: int | None = None
    #: Keeps prefix-cache entries of different tenants apart (docs/design.md §3).
    cache_salt: str | None = None
    #: Speculative decoding for this request: None = the server's setting,
    #: False = off (an opt-out; True cannot turn it on where the server has none).
    speculative: bool | None = None
    #: Extra keyword arguments for the chat template.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Render earlier turns as they were generated (reasoning kept) where the
    #: template would rewrite them, so the next turn reads them from the prefix
    #: cache (chat/history.py); the client asked to keep earlier thinking.
    history_as_generated: bool = False
    #: A prompt without the chat template (``messages`` is then empty).
    raw: RawPrompt | None = None

    @property
    def offers_tools(self) -> bool:
        """Tools are shown to the model (and its calls parsed) unless ``tool_choice`` is "none"."""
        return bool(self.tools) and self.tool_choice != "none"


# --------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request left the queue and holds its KV blocks: its prompt size and
    prefix-cache hit are known. Comes once, before any output."""

    input_tokens: int
    #: Prompt tokens served from the prefix cache.
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    token_id: int
    #: Natural log of the token's probability under the model's raw
    #: distribution (before temperature, penalties and bias), <= 0.
    logprob: float
    #: The token's bytes (a byte-fallback token may hold part of a character,
    #: which ``token`` shows as U+FFFD).
    token_bytes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely alternatives
    (sorted by logprob, descending). Comes before that token's text events,
    only when ``SamplingParams.logprobs`` is set."""

    token: str
    token_id: int
    logprob: float
    token_bytes: tuple[int, ...] = ()
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    #: Prompt tokens served from the prefix cache (real hits).
    cached_tokens: int = 0
    #: Speculative decoding: draft tokens proposed and verified, and how many of
    #: them were accepted (0 when the request did not speculate).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Done:
    stop_reason: StopReason
    matched_stop: str | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)


@dataclass(frozen=True, slots=True)
class Error:
    """A failure after the stream started. ``kind`` is one of the
    :mod:`mlx_cairn.errors` kinds ("internal", "overloaded", ...)."""

    kind: str
    message: str


Event = Admitted | TextDelta | ReasoningDelta | ToolCall | TokenLogprob | Done | Error
