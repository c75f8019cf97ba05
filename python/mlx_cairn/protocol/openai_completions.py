"""OpenAI legacy Completions: request bodies -> raw prompts, Events -> chunks, fold.

Request mapping (validated before any model work, each failure a 400 naming
the field; unknown fields are ignored):

- ``prompt``: a string, a list of strings, a list of token ids or a list of
  token id lists; no chat template, the prompt is the raw text (special-token
  strings in it are markup, as in llama.cpp, vLLM and mlx-lm);
- ``suffix``: fill-in-the-middle with the model's own FIM tokens
  (:mod:`mlx_cairn.chat.fim`; a model without them is a 400 on ``suffix``);
- ``n`` choices per prompt (``best_of`` only equal to ``n``), ``max_tokens``
  (default 16, as OpenAI's), ``temperature`` (0..2), ``top_p``, ``seed``
  (choice ``i`` of a prompt samples with ``seed + i``), ``stop``, penalties,
  ``logit_bias``, vLLM's ``top_k`` / ``min_p`` / ``repetition_penalty``
  (:mod:`mlx_cairn.protocol.sampling`), ``logprobs`` (0..20 alternatives),
  ``echo`` (the prompt's text before the answer; not with ``suffix`` nor
  ``logprobs``, which would need the prompt's own log-probabilities),
  ``stream`` with ``stream_options.include_usage``, ``cache_salt``.

Wire format of a stream; every choice of every prompt is one index
(prompt ``p``, choice ``i``: index ``p * n + i``), chunks of different
choices interleave::

    {"object":"text_completion","choices":[{"text":"<prompt>","index":k,...}]}  echo
    {"object":"text_completion","choices":[{"text":"...","index":k,"logprobs":L,
                                            "finish_reason":null}]}
    {"object":"text_completion","choices":[{"text":"","index":k,"logprobs":L,
                                            "finish_reason":"stop"|"length"}]}
    {"object":"text_completion","choices":[],"usage":{...}}      when include_usage
    [DONE]

``L`` is null unless ``logprobs`` was asked; then it is the legacy shape
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for the tokens
since the last chunk of that choice, every generated token but the end of
the answer once, in order. A failure after the first byte is one
``{"error": {...}}`` data line and no ``[DONE]``. The JSON response is
:func:`fold_chunks` over exactly these chunks (the codec always emits the
usage chunk in JSON mode).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_cairn.errors import InvalidRequest, error_kind
from mlx_cairn.protocol.codec import (
    WireEvent,
    cache_salt,
    is_int,
    required_model,
    speculative_switch,
    speculative_usage,
    timings_body,
    tool_call_as_text,
)
from mlx_cairn.protocol.openai_common import (
    ChunkWire,
    chunk_payloads,
    error_body,
    fail,
    opt_bool,
    opt_max_tokens,
    stop_list,
    stream_flags,
    wire_logprob,
)
from mlx_cairn.protocol.sampling import bounded, integer, read_sampling
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Error,
    Event,
    RawPrompt,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
    Usage,
)

#: OpenAI's default ``max_tokens`` for legacy completions.
DEFAULT_MAX_TOKENS = 16
#: Most generations one request may start (prompts x n): each is a row of the batch.
MAX_CHOICES = 64


@dataclass(slots=True)
class OpenAICompletionRequest:
    """A validated legacy Completions request: one ChatRequest per prompt, plus options."""

    #: The first prompt's request (what the runner reads of every dialect).
    chat: ChatRequest
    #: One raw-prompt request per prompt, in order.
    prompts: list[ChatRequest]
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    open_ended: bool = False
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    #: Every choice's request: prompt ``p``'s choice ``i`` at ``p * n + i``.
    choices: list[ChatRequest] = field(default_factory=list)


def parse_completion_request(body: Any, *, max_tokens_limit: int) -> OpenAICompletionRequest:
    """Validate a ``POST /v1/completions`` body and map it to raw-prompt ChatRequests."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = required_model(body)
    if "prompt" not in body:
        raise fail("prompt", "field required")
    raws = _prompts(body["prompt"])
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise fail("suffix", "must be a string")
        if any(r.ids is not None for r in raws):
            raise fail("suffix", "needs a text prompt (the prefix), not token ids")
        raws = [replace(r, suffix=suffix) for r in raws]
    n = integer(body, "n", 1, MAX_CHOICES) or 1
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != n):
        raise fail("best_of", "only best_of equal to n is supported (every choice is returned)")
    if len(raws) * n > MAX_CHOICES:
        raise fail("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(raws) * n}")

    mt = opt_max_tokens(body, "max_tokens", max_tokens_limit)
    sampling = read_sampling(body, max_temperature=2.0)
    k = bounded(body, "logprobs", "top_logprobs")
    if k is not None:
        sampling.logprobs, sampling.top_logprobs = True, k
    echo = opt_bool(body, "echo", False)
    if echo and suffix is not None:
        raise fail("echo", "cannot be combined with suffix")
    if echo and k is not None:
        raise fail("echo", "cannot be combined with logprobs (prompt logprobs are not computed)")

    stream, include_usage = stream_flags(body)

    stop, salt, spec = stop_list(body.get("stop")), cache_salt(body), speculative_switch(body)
    prompts = [
        ChatRequest(
            messages=[],
            raw=raw,
            model=model,
            max_tokens=mt if mt is not None else min(DEFAULT_MAX_TOKENS, max_tokens_limit),
            sampling=copy.copy(sampling),
            stop=list(stop),
            cache_salt=salt,
            speculative=spec,
        )
        for raw in raws
    ]
    choices = [_choice(p, i) for p in prompts for i in range(n)]
    return OpenAICompletionRequest(
        prompts[0], prompts, model, n, stream, include_usage, echo, choices=choices
    )


def _choice(prompt: ChatRequest, i: int) -> ChatRequest:
    """Choice ``i`` of ``prompt``: its own seed (``seed + i``) so choices differ."""
    if i == 0:
        return prompt
    seed = prompt.sampling.seed
    if seed is not None:
        seed = (seed + i) % 2**64  # wraps inside the 64-bit range the engine takes
    return replace(prompt, sampling=replace(prompt.sampling, seed=seed))


def _prompts(raw: Any) -> list[RawPrompt]:
    """``prompt`` in any of its four shapes, as one RawPrompt per prompt."""
    if isinstance(raw, str):
        return [RawPrompt(text=raw)]
    if not isinstance(raw, list) or not raw:
        raise fail("prompt", "must be a string, a list of strings or a non-empty list of token ids")
    if all(isinstance(p, str) for p in raw):
        return [RawPrompt(text=p) for p in raw]
    if all(is_int(t) for t in raw):
        return [RawPrompt(ids=_ids(raw, "prompt"))]
    if all(isinstance(p, list) for p in raw):
        return [RawPrompt(ids=_ids(p, f"prompt[{i}]")) for i, p in enumerate(raw)]
    raise fail("prompt", "mixes strings, token ids and lists; send one shape")


def _ids(raw: list[Any], param: str) -> list[int]:
    if not raw:
        raise fail(param, "must not be empty")
    if not all(is_int(t) and t >= 0 for t in raw):
        raise fail(param, "must be a list of non-negative token ids")
    return [int(t) for t in raw]


# ----------------------------------------------------------------- encoding


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One Event of choice ``index`` of a request that runs several generations."""

    index: int
    event: Event


_FINISH = {"max_tokens": "length"}


class _Choice:
    """Per-choice state: held logprob entries and the text offset reached."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.held: list[TokenLogprob] = []


class CompletionCodec(ChunkWire):
    """Encodes the Events of every choice as ``text_completion`` chunks (see module doc).

    Fed :class:`ChoiceEvent` for each choice's events, then one final
    :class:`~mlx_cairn.types.Done` (usage over all choices) or an Error.
    """

    OBJECT = "text_completion"

    def __init__(
        self,
        *,
        model: str,
        input_tokens: int,
        include_usage: bool,
        echo: list[str] | None = None,
        num_choices: int = 1,
        logprobs: bool = False,
        completion_id: str | None = None,
        created: int | None = None,
    ) -> None:
        super().__init__(
            model, "cmpl-", completion_id, created, input_tokens, include_usage, logprobs
        )
        self._echo = echo or []
        self._choices = [
            _Choice(len(self._echo[i]) if i < len(self._echo) else 0) for i in range(num_choices)
        ]

    def open(self) -> list[WireEvent]:
        """The echoed prompts, one chunk per choice (nothing without ``echo``)."""
        return [
            self._chunk([self._entry(i, text, None)]) for i, text in enumerate(self._echo) if text
        ]

    def _entry(self, i: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": i, "logprobs": self._take(i), "finish_reason": finish}

    def _take(self, i: int) -> dict[str, Any] | None:
        """The legacy logprobs of the tokens held for choice ``i`` (None when not asked)."""
        if not self.logprobs:
            return None
        c = self._choices[i]
        held, c.held = c.held, []
        lp: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for ev in held:
            lp["tokens"].append(ev.token)
            lp["token_logprobs"].append(wire_logprob(ev.logprob))
            top = {t.token: wire_logprob(t.logprob) for t in ev.top}
            # The sampled token, always; keyed by text, it wins over an alternative
            # that decodes the same (two byte-fallback pieces are both U+FFFD).
            top[ev.token] = wire_logprob(ev.logprob)
            lp["top_logprobs"].append(top)
            lp["text_offset"].append(c.offset)
            c.offset += len(ev.token)
        return lp

    def feed(self, ev: ChoiceEvent | Event) -> list[WireEvent]:
        """Chunks for one choice's Event, or the end of the whole request."""
        if isinstance(ev, ChoiceEvent):
            return self._feed_choice(ev.index, ev.event)
        if isinstance(ev, Done):
            out: list[WireEvent] = []
            if self.include_usage:
                out.append(self._chunk([], usage=self._usage(ev)))
            out.append((None, "[DONE]"))
            return out
        if isinstance(ev, Error):
            status = error_kind(ev.kind).status
            return [(None, error_body(status, ev.kind, ev.message, None))]
        return []

    def _feed_choice(self, i: int, ev: Event) -> list[WireEvent]:
        if isinstance(ev, TokenLogprob):
            if self.logprobs:
                self._choices[i].held.append(ev)
            return []
        text = ""
        if isinstance(ev, (TextDelta, ReasoningDelta)):  # a raw prompt has no reasoning split
            text = ev.text
        elif isinstance(ev, ToolCall):  # nor tool parsing: what the model meant, as text
            text = tool_call_as_text(ev)
        elif isinstance(ev, Done):
            return [self._chunk([self._entry(i, "", _FINISH.get(ev.stop_reason, "stop"))])]
        return [self._chunk([self._entry(i, text, None)])] if text else []

    def _usage(self, done: Done) -> dict[str, Any]:
        prompt = done.usage.input_tokens or self.input_tokens
        u: Usage = done.usage
        return {
            "prompt_tokens": prompt,
            "completion_tokens": u.output_tokens,
            "total_tokens": prompt + u.output_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "timings": timings_body(done.timings),
            **speculative_usage(u),
        }

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The non-streaming ``text_completion``: :func:`fold_chunks` over these chunks."""
        return fold_chunks(wire)


def fold_chunks(wire: list[WireEvent]) -> dict[str, Any]:
    """Accumulate ``text_completion`` chunks into the completion they describe:
    per index, texts concatenate, logprobs lists extend, the last finish wins.

    Raises ValueError on an error chunk or when no chunk came.
    """
    head: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] | None = None
    for payload in chunk_payloads(wire):
        head = head or payload
        for c in payload["choices"]:
            acc = choices.setdefault(
                c["index"],
                {"text": "", "index": c["index"], "logprobs": None, "finish_reason": None},
            )
            acc["text"] += c["text"]
            got = c.get("logprobs")
            if got is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = {key: [] for key in got}
                for key, vals in got.items():
                    acc["logprobs"][key] += copy.deepcopy(vals)
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
        if payload.get("usage") is not None:
            usage = payload["usage"]
    if head is None:
        raise ValueError("no chunks")
    return {
        "id": head["id"],
        "object": "text_completion",
        "created": head["created"],
        "model": head["model"],
        "system_fingerprint": head.get("system_fingerprint"),
        "choices": [choices[i] for i in sorted(choices)],
        "usage": copy.deepcopy(usage),
    }
