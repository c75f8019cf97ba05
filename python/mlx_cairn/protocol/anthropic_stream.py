"""Events -> Anthropic Messages stream events, and the fold into one Message.

Wire order (docs/design.md §6)::

    message_start (usage: input_tokens, cache_read_input_tokens)   on Admitted
      content_block_start / content_block_delta* / content_block_stop   (index 0, 1, ...)
    message_delta (stop_reason, stop_sequence, cumulative usage)
    message_stop
    -- or, on failure after the start: error (and no message_stop)

Rules applied here, so the streamed and the folded response agree:

- reasoning text becomes a ``thinking`` block only when thinking is shown;
- a text block opens at the first non-whitespace character: whitespace that
  only precedes a tool call, a thinking block or the end is not sent;
- each tool call is one ``tool_use`` block with exactly one ``input_json_delta``;
- ``message_start`` is sent once the request is admitted (the engine's
  Admitted event), so its usage is real; pings keep the stream alive before;
- usage as the Anthropic API defines it: ``input_tokens`` is the prompt
  tokens NOT read from the cache, ``cache_read_input_tokens`` the real
  prefix-hit count, ``cache_creation_input_tokens`` 0; their sum is the whole
  prompt (``count_tokens``). ``message_delta`` repeats them (cumulative) and
  adds ``output_tokens``; timing figures ride in ``usage.timings`` (queue_ms,
  ttft_ms, prefill_tokens_per_s, decode_tokens_per_s).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson

from mlx_cairn.errors import error_kind
from mlx_cairn.protocol.codec import (
    WireEvent,
    new_id,
    speculative_usage,
    timings_body,
    tool_call_as_text,
)
from mlx_cairn.protocol.frames import frame
from mlx_cairn.types import (
    Admitted,
    Done,
    Error,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
)


def error_payload(etype: str, message: str) -> dict[str, Any]:
    """The Anthropic error envelope."""
    return {"type": "error", "error": {"type": etype, "message": message}}


class AnthropicCodec:
    """Encodes one request's Events as Anthropic stream events (see module doc)."""

    def __init__(
        self,
        *,
        model: str,
        input_tokens: int,
        show_thinking: bool,
        allow_tools: bool = True,
        message_id: str | None = None,
    ) -> None:
        self.model = model
        self.allow_tools = allow_tools
        self.input_tokens = input_tokens
        self.show_thinking = show_thinking
        self.message_id = message_id or new_id("msg_")
        self._index = -1
        self._open: str | None = None  # type of the open content block
        self._pending_ws = ""  # whitespace held before a text block opens
        self._started = False  # message_start sent

    def open(self) -> list[WireEvent]:
        """Nothing: ``message_start`` waits for the Admitted event (real cache figures)."""
        return []

    def _message_start(self, input_tokens: int, cached: int) -> WireEvent:
        self._started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**_input_usage(input_tokens, cached), "output_tokens": 0},
        }
        return ("message_start", {"type": "message_start", "message": message})

    def ping(self) -> bytes:
        """An Anthropic ``ping`` frame."""
        return frame("ping", {"type": "ping"})

    # ------------------------------------------------------------ events

    def feed(self, ev: Event) -> list[WireEvent]:
        """Wire events for one engine Event."""
        out: list[WireEvent] = []
        if isinstance(ev, TokenLogprob):
            return out  # the Messages API has no logprobs
        if isinstance(ev, Admitted):
            if not self._started:
                out.append(self._message_start(ev.input_tokens, ev.cached_tokens))
            return out
        if not self._started and not isinstance(ev, Error):
            # A stream without Admitted (a hand-built Event list): open it now.
            out.append(self._message_start(self.input_tokens, 0))
        if isinstance(ev, TextDelta):
            self._text(ev.text, out)
        elif isinstance(ev, ReasoningDelta):
            if self.show_thinking and ev.text:
                self._pending_ws = ""
                self._ensure("thinking", out)
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, ToolCall) and not (self.allow_tools and _json_object(ev.arguments)):
            # No tools were offered (or the arguments are not a JSON object):
            # what the model wrote comes back as text, nothing is lost.
            self._text(tool_call_as_text(ev), out)
        elif isinstance(ev, ToolCall):
            self._pending_ws = ""
            self._close(out)
            tid = ev.id if ev.id.startswith("toolu_") else new_id("toolu_")
            self._start({"type": "tool_use", "id": tid, "name": ev.name, "input": {}}, out)
            out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}))
            self._close(out)
        elif isinstance(ev, Done):
            self._close(out)
            out.append(self._message_delta(ev))
            out.append(("message_stop", {"type": "message_stop"}))
        elif isinstance(ev, Error):
            out.append(("error", error_payload(error_kind(ev.kind).anthropic, ev.message)))
        return out

    def _text(self, text: str, out: list[WireEvent]) -> None:
        if not text:
            return
        if self._open != "text":
            held = self._pending_ws + text
            if not held.strip():
                self._pending_ws = held  # whitespace only: wait for what follows
                return
            self._pending_ws = ""
            text = held
            self._ensure("text", out)
        out.append(self._delta({"type": "text_delta", "text": text}))

    def _ensure(self, kind: str, out: list[WireEvent]) -> None:
        if self._open == kind:
            return
        self._close(out)
        block: dict[str, Any] = (
            {"type": "text", "text": ""}
            if kind == "text"
            else {"type": "thinking", "thinking": "", "signature": ""}
        )
        self._start(block, out)

    def _start(self, block: dict[str, Any], out: list[WireEvent]) -> None:
        self._index += 1
        self._open = block["type"]
        out.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )

    def _delta(self, delta: dict[str, Any]) -> WireEvent:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def _close(self, out: list[WireEvent]) -> None:
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None

    def _message_delta(self, done: Done) -> WireEvent:
        usage = {
            **_input_usage(done.usage.input_tokens or self.input_tokens, done.usage.cached_tokens),
            "output_tokens": done.usage.output_tokens,
            "timings": timings_body(done.timings),
            **speculative_usage(done.usage),
        }
        delta = {"stop_reason": done.stop_reason, "stop_sequence": done.matched_stop}
        return ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})

    # -------------------------------------------------------------- fold

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The non-streaming Message: :func:`fold_events` over these wire events."""
        return fold_events(wire)


def _input_usage(prompt_tokens: int, cached: int) -> dict[str, int]:
    """The Anthropic split of a prompt: uncached + cache reads (+ creation, 0 here)."""
    cached = min(max(cached, 0), prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object that survives a round trip (depth limits)."""
    try:
        value = orjson.loads(text)
        orjson.dumps(value)
    except (orjson.JSONDecodeError, TypeError):
        return False
    return isinstance(value, dict)


def fold_events(wire: list[WireEvent]) -> dict[str, Any]:
    """Accumulate Anthropic stream events into the Message they describe.

    Raises ValueError on an out-of-order stream or an ``error`` event.
    """
    msg: dict[str, Any] | None = None
    json_bufs: dict[int, str] = {}
    for name, payload in wire:
        if name == "message_start":
            msg = copy.deepcopy(payload["message"])
            continue
        if name in ("ping", None) or name == "message_stop":
            continue
        if name == "error":
            raise ValueError(payload["error"]["message"])
        if msg is None:
            raise ValueError(f"{name} before message_start")
        if name == "content_block_start":
            msg["content"].append(copy.deepcopy(payload["content_block"]))
        elif name == "content_block_delta":
            block, delta = msg["content"][payload["index"]], payload["delta"]
            dt = delta["type"]
            if dt == "text_delta":
                block["text"] += delta["text"]
            elif dt == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif dt == "signature_delta":
                block["signature"] = delta["signature"]
            elif dt == "input_json_delta":
                json_bufs[payload["index"]] = (
                    json_bufs.get(payload["index"], "") + delta["partial_json"]
                )
        elif name == "content_block_stop":
            idx = payload["index"]
            if idx in json_bufs:
                buf = json_bufs.pop(idx)
                # stdlib json: orjson turns integers past 64 bits into floats,
                # while the SDK's accumulator (and the stream) keep them exact.
                msg["content"][idx]["input"] = json.loads(buf) if buf else {}
        elif name == "message_delta":
            msg["stop_reason"] = payload["delta"]["stop_reason"]
            msg["stop_sequence"] = payload["delta"]["stop_sequence"]
            msg["usage"].update(payload["usage"])
    if msg is None:
        raise ValueError("no message_start")
    return msg
