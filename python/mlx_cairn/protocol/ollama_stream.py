"""Ollama API answers: Events -> NDJSON lines, and the JSON answer as their fold.

One JSON object per line (``application/x-ndjson``), one line per text,
thinking or tool-call event; the last line has ``done: true`` and the figures::

    {"model":m,"created_at":t,"message":{"role":"assistant","content":"Hel"},"done":false}
    {"model":m,"created_at":t,"message":{"role":"assistant","content":"","thinking":"..."},"done":false}
    {"model":m,"created_at":t,"message":{"role":"assistant","content":"","tool_calls":[
        {"id":"call_...","function":{"index":0,"name":"f","arguments":{...}}}]},"done":false}
    {"model":m,"created_at":t,"message":{"role":"assistant","content":""},"done":true,
     "done_reason":"stop"|"length","total_duration":ns,"load_duration":ns,
     "prompt_eval_count":n,"prompt_eval_duration":ns,"eval_count":n,"eval_duration":ns}

``/api/generate`` lines carry ``response`` (and ``thinking``) at the top level
instead of ``message``. With ``logprobs`` each line carries the entries of the
tokens since the line before (``logprobs``: ``[{token, logprob, bytes,
top_logprobs}]``) and the last line the rest. A failure after the first line
is one ``{"error": "..."}`` line.

Figures, in nanoseconds: ``total_duration`` from the request's arrival to
the end; ``load_duration`` from its arrival until the engine had it (waiting
for the model to load, template and tokenizer); ``prompt_eval_duration``
from admission to the first token; ``eval_duration`` from the first token to
the last. ``prompt_eval_count`` is the whole prompt (cached tokens included,
as every dialect's input count), ``eval_count`` the generated tokens.

The JSON answer (``stream: false``) is :func:`fold_lines` over exactly these
lines: text, thinking, tool calls and logprobs concatenated, the rest from
the last line, as the ``ollama`` clients accumulate a stream.
"""

from __future__ import annotations

import copy
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import orjson

from mlx_cairn.protocol.codec import NDJSON, WireEvent, tool_call_as_text
from mlx_cairn.protocol.ollama import Shape
from mlx_cairn.protocol.openai_common import CallIds, LogprobHold, TextGate, json_object
from mlx_cairn.types import Done, Error, Event, ReasoningDelta, TextDelta, TokenLogprob, ToolCall


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC).

    >>> created_at().endswith("Z")
    True
    """
    return (
        dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    )


class OllamaCodec:
    """Encodes one request's Events as Ollama NDJSON lines (see module doc).

    ``arrived_ns`` is when the request came in (``time.perf_counter_ns``);
    the codec is built when the engine is about to get it, which ends the
    ``load_duration``. ``clock`` and ``now`` are the time sources (tests fix them).
    """

    framing = NDJSON

    def __init__(
        self,
        *,
        model: str,
        shape: Shape,
        allow_tools: bool,
        logprobs: bool = False,
        arrived_ns: int | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        now: Callable[[], str] = created_at,
    ) -> None:
        self.model = model
        self.shape = shape
        self.allow_tools = allow_tools
        self.logprobs = logprobs
        self._clock = clock
        self._now = now
        self.ready_ns = clock()
        self.arrived_ns = self.ready_ns if arrived_ns is None else arrived_ns
        self._calls = 0
        self._gate = TextGate()
        self._ids = CallIds()
        self._lp = LogprobHold()

    def open(self) -> list[WireEvent]:
        """Nothing: Ollama's stream starts with the first piece of the answer."""
        return []

    def ping(self) -> bytes:
        """Nothing: every line of an Ollama stream must be a JSON object."""
        return b""

    def _line(
        self,
        content: str = "",
        *,
        thinking: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        done: Done | None = None,
    ) -> WireEvent:
        body: dict[str, Any] = {"model": self.model, "created_at": self._now()}
        if self.shape == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking is not None:
                msg["thinking"] = thinking
            if tool_calls is not None:
                msg["tool_calls"] = tool_calls
            body["message"] = msg
        else:
            body["response"] = content
            if thinking is not None:
                body["thinking"] = thinking
        body["done"] = done is not None
        if done is not None:
            body.update(self._figures(done))
        if self.logprobs:
            entries = self._lp.take()
            if entries or done is not None:  # the last line always has the list
                body["logprobs"] = entries
        return (None, body)

    def feed(self, ev: Event) -> list[WireEvent]:
        """Lines for one engine Event."""
        if isinstance(ev, TokenLogprob):
            if self.logprobs:
                self._lp.add(ev)
            return []
        if isinstance(ev, TextDelta):
            return self._text(ev.text)
        if isinstance(ev, ReasoningDelta):
            if not ev.text:
                return []
            self._gate.drop()
            return [self._line(thinking=ev.text)]
        if isinstance(ev, ToolCall):
            if not (self.allow_tools and json_object(ev.arguments)):
                return self._text(tool_call_as_text(ev))
            self._gate.drop()
            call = {
                "id": self._ids.take(ev.id),
                "function": {
                    "index": self._calls,
                    "name": ev.name,
                    "arguments": orjson.loads(ev.arguments),
                },
            }
            self._calls += 1
            return [self._line(tool_calls=[call])]
        if isinstance(ev, Done):
            return [self._line(done=ev)]
        if isinstance(ev, Error):
            return [(None, {"error": ev.message})]
        return []

    def _text(self, text: str) -> list[WireEvent]:
        text = self._gate.push(text) if text else ""
        return [self._line(text)] if text else []

    def _figures(self, done: Done) -> dict[str, Any]:
        t, u = done.timings, done.usage
        decode = u.output_tokens - 1
        rate = t.decode_tokens_per_s
        return {
            "done_reason": "length" if done.stop_reason == "max_tokens" else "stop",
            "total_duration": self._clock() - self.arrived_ns,
            "load_duration": self.ready_ns - self.arrived_ns,
            "prompt_eval_count": u.input_tokens,
            "prompt_eval_duration": max(0, round((t.ttft_ms - t.queue_ms) * 1e6)),
            "eval_count": u.output_tokens,
            "eval_duration": round(decode / rate * 1e9) if decode > 0 and rate > 0 else 0,
        }

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The ``stream: false`` answer: :func:`fold_lines` over these lines."""
        return fold_lines([payload for _, payload in wire])


def fold_lines(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Accumulate Ollama stream lines into the one answer they describe.

    Text, thinking and tool calls concatenate in order (``message`` for chat,
    ``response`` / ``thinking`` for generate); everything else comes from the
    last line. Raises ValueError on an error line, or when no line is final.
    """
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] | None = None
    last: dict[str, Any] | None = None
    for line in lines:
        if "error" in line:
            raise ValueError(line["error"])
        msg = line.get("message", line)
        text.append(msg.get("content", msg.get("response", "")))
        thinking.append(msg.get("thinking") or "")
        calls += msg.get("tool_calls") or []
        if "logprobs" in line:
            logprobs = (logprobs or []) + line["logprobs"]
        last = line
    if last is None or not last.get("done"):
        raise ValueError("the stream has no final line")
    out = copy.deepcopy(last)
    out.pop("logprobs", None)
    holder = out.get("message", out)
    holder["content" if "message" in out else "response"] = "".join(text)
    if any(thinking):
        holder["thinking"] = "".join(thinking)
    if calls:
        holder["tool_calls"] = copy.deepcopy(calls)
    if logprobs is not None:
        out["logprobs"] = copy.deepcopy(logprobs)
    return out
