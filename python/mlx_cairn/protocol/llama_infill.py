"""llama.cpp's ``POST /infill``: request bodies -> a FIM ChatRequest, Events -> chunks, fold.

The endpoint llama.vim and llama.vscode call. Request mapping (unknown
fields are ignored, each failure a 400 naming the field):

- ``input_prefix`` / ``input_suffix``: the code before and after the cursor;
  ``prompt``: text typed on the cursor's line, appended to the prefix (as
  llama.cpp does); ``input_extra``: other files,
  ``[{"filename": ..., "text": ...}]``, placed before the prefix with the
  model's repository tokens (:func:`mlx_cairn.chat.fim.fim_prompt`);
- ``model``: optional (llama.cpp serves one model): the first served one;
- ``n_predict`` (-1 or absent: up to the end of the context), ``temperature``
  (default 0.8), ``top_k`` (40), ``top_p`` (0.95), ``min_p`` (0.05), as
  llama.cpp's defaults; ``seed`` (-1: random), ``stop``, ``repeat_penalty``,
  ``presence_penalty``, ``frequency_penalty``, ``stream``, ``cache_salt``.
  llama.cpp's time limits (``t_max_prompt_ms``, ``t_max_predict_ms``), its
  sampler chain and ``cache_prompt`` (the prefix cache is always on) are
  accepted and ignored.

Wire format (llama.cpp's ``/completion`` shape, SSE data lines with no event
name)::

    {"index":0,"content":"...","stop":false}
    {"index":0,"content":"","stop":true,"model":...,"tokens_predicted":n,
     "tokens_evaluated":N,"tokens_cached":C,"truncated":false,
     "stop_type":"eos"|"limit"|"word","stopping_word":"...",
     "generation_settings":{"n_ctx":...},"timings":{"prompt_n",...}}

The JSON answer is :func:`fold_chunks` over exactly these chunks: the
contents joined, the final chunk's fields. A failure after the first byte is
one ``{"error": {"code", "message", "type", "param"}}`` data line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_cairn.errors import InvalidRequest, error_kind
from mlx_cairn.protocol.codec import WireEvent, cache_salt, fail
from mlx_cairn.protocol.frames import comment
from mlx_cairn.protocol.openai_common import opt_bool, stop_list
from mlx_cairn.protocol.sampling import bounded, integer, number
from mlx_cairn.types import (
    MAX_SEED,
    ChatRequest,
    Done,
    Error,
    Event,
    RawPrompt,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
)


def error_body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    """llama.cpp's error envelope (its types are OpenAI's), with OpenAI's ``param`` too."""
    row = error_kind(kind)
    return {"error": {"code": status, "message": message, "type": row.openai, "param": param}}


@dataclass(slots=True)
class InfillRequest:
    """A validated ``/infill`` request."""

    chat: ChatRequest
    model: str
    stream: bool = False
    open_ended: bool = False
    prompt_param: str = "input_prefix"
    max_tokens_param: str = "n_predict"


def _text(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise fail(key, "must be a string")
    return v


def _extra(raw: Any) -> list[dict[str, str]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise fail("input_extra", 'must be a list of {"filename", "text"} objects')
    out = []
    for i, chunk in enumerate(raw):
        if not isinstance(chunk, dict):
            raise fail(f"input_extra[{i}]", "must be an object")
        item = {"filename": chunk.get("filename", "tmp"), "text": chunk.get("text", "")}
        for k, v in item.items():
            if not isinstance(v, str):
                raise fail(f"input_extra[{i}].{k}", "must be a string")
        out.append(item)
    return out


def parse_infill_request(body: Any, *, max_tokens_limit: int, default_model: str) -> InfillRequest:
    """Validate a ``POST /infill`` body and map it to a fill-in-the-middle ChatRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model") or default_model
    if not isinstance(model, str):
        raise fail("model", "must be a string")
    raw = RawPrompt(
        text=_text(body, "input_prefix") + _text(body, "prompt"),
        suffix=_text(body, "input_suffix"),
        extra=_extra(body.get("input_extra")),
    )
    n = integer(
        body,
        "n_predict",
        -1,
        max_tokens_limit,
        f"must be -1 (no limit) or a positive integer up to {max_tokens_limit} on this server",
    )
    if n == 0:
        raise fail("n_predict", "must be -1 (no limit) or a positive integer")
    open_ended = n is None or n == -1
    sp = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
    if (t := number(body, "temperature", 0.0, 100.0)) is not None:
        sp.temperature = t
    if (p := number(body, "top_p", 0.0, 1.0)) is not None:
        sp.top_p = p if p > 0 else 1.0  # llama.cpp: 0 turns top-p off
    if (k := bounded(body, "top_k")) is not None:
        sp.top_k = k
    if (m := bounded(body, "min_p")) is not None:
        sp.min_p = m
    seed = integer(body, "seed", -1, MAX_SEED, "must be -1 (random) or a 64-bit integer")
    sp.seed = None if seed is None or seed == -1 else seed
    if (rp := bounded(body, "repeat_penalty", "repetition_penalty")) is not None:
        sp.repetition_penalty = rp
    for key in ("presence_penalty", "frequency_penalty"):
        if (v := bounded(body, key)) is not None:
            setattr(sp, key, v)
    chat = ChatRequest(
        messages=[],
        raw=raw,
        model=model,
        max_tokens=max_tokens_limit if n is None or n == -1 else n,
        sampling=sp,
        stop=stop_list(body.get("stop")),
        cache_salt=cache_salt(body),
    )
    return InfillRequest(chat, model, opt_bool(body, "stream", False), open_ended)


# ----------------------------------------------------------------- encoding

_STOP_TYPE = {"end_turn": "eos", "max_tokens": "limit", "stop_sequence": "word"}


class InfillCodec:
    """Encodes one ``/infill`` generation as llama.cpp ``/completion`` chunks (see module doc)."""

    def __init__(self, *, model: str, input_tokens: int, context_length: int) -> None:
        self.model = model
        self.input_tokens = input_tokens
        self.context_length = context_length

    def open(self) -> list[WireEvent]:
        return []

    def ping(self) -> bytes:
        return comment("ping")

    def feed(self, ev: Event) -> list[WireEvent]:
        if isinstance(ev, (TextDelta, ReasoningDelta)) and ev.text:
            return [(None, {"index": 0, "content": ev.text, "stop": False})]
        if isinstance(ev, Done):
            return [(None, self._final(ev))]
        if isinstance(ev, Error):
            return [(None, error_body(error_kind(ev.kind).status, ev.kind, ev.message, None))]
        return []

    def _final(self, done: Done) -> dict[str, Any]:
        u, t = done.usage, done.timings
        prompt_n = (u.input_tokens or self.input_tokens) - u.cached_tokens
        decode_ms = (
            1000 * (u.output_tokens - 1) / t.decode_tokens_per_s if t.decode_tokens_per_s else 0.0
        )
        return {
            "index": 0,
            "content": "",
            "stop": True,
            "model": self.model,
            "tokens_predicted": u.output_tokens,
            "tokens_evaluated": u.input_tokens or self.input_tokens,
            "tokens_cached": u.cached_tokens,
            "truncated": False,
            "stop_type": _STOP_TYPE.get(done.stop_reason, "eos"),
            "stopping_word": done.matched_stop or "",
            "generation_settings": {"n_ctx": self.context_length},
            "timings": {
                "prompt_n": prompt_n,
                "prompt_ms": round(t.ttft_ms, 3),
                "prompt_per_second": round(t.prefill_tokens_per_s, 3),
                "predicted_n": u.output_tokens,
                "predicted_ms": round(decode_ms, 3),
                "predicted_per_second": round(t.decode_tokens_per_s, 3),
            },
        }

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        return fold_chunks(wire)


def fold_chunks(wire: list[WireEvent]) -> dict[str, Any]:
    """The JSON answer the chunks describe: contents joined, the final chunk's fields.

    Raises ValueError on an error chunk or without a final chunk.
    """
    content = ""
    for _, payload in wire:
        if "error" in payload:
            raise ValueError(payload["error"]["message"])
        content += payload["content"]
        if payload["stop"]:
            return {**payload, "content": content}
    raise ValueError("no final chunk")
