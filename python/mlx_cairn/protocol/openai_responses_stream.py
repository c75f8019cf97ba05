"""Events -> OpenAI Responses stream events, and the fold into one Response.

Wire order (every event carries ``sequence_number``, counting from 0)::

    response.created, response.in_progress            (status "in_progress")
    per output item, in order:
      reasoning:     output_item.added, content_part.added (reasoning_text),
                     reasoning_text.delta*, reasoning_text.done,
                     content_part.done, output_item.done
      message:       output_item.added, content_part.added (output_text),
                     output_text.delta*, output_text.done,
                     content_part.done, output_item.done
      function_call: output_item.added, function_call_arguments.delta,
                     function_call_arguments.done, output_item.done
    response.completed   (or response.incomplete when max_output_tokens ran out)
    -- or, on failure after the start: error, response.failed

Logprobs (when the request included ``message.output_text.logprobs``): each
``output_text.delta`` carries the entries of the tokens whose text it holds
(:class:`~mlx_cairn.protocol.openai_common.LogprobHold` says which: the tokens
since the last delta; reasoning and function-call tokens have no place here), and the ``output_text`` part, its
``output_text.done`` and the item in ``output_item.done`` carry all of that
message's entries, in order: a client that reads only the deltas gets the
same list as the final response.

The terminal event carries the whole response. :func:`fold_events` rebuilds
it from the frames (the created response, the finished items in order, the
terminal status and usage); the JSON response is that fold.

Usage: ``input_tokens`` is the whole prompt, ``input_tokens_details.
cached_tokens`` the real prefix-hit part of it, timing figures ride in
``usage.timings``. ``output_tokens_details.reasoning_tokens`` is 0: the
engine does not split its output count by kind.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from mlx_cairn.errors import error_kind
from mlx_cairn.protocol.codec import WireEvent, speculative_usage, timings_body, tool_call_as_text
from mlx_cairn.protocol.frames import comment
from mlx_cairn.protocol.openai_common import (
    CallIds,
    LogprobHold,
    TextGate,
    json_object,
    new_id,
)
from mlx_cairn.types import (
    Done,
    Error,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
)

_TERMINAL = ("response.completed", "response.incomplete")


class ResponsesCodec:
    """Encodes one request's Events as Responses stream events (see module doc).

    ``on_finish(response)`` is called with the final response object when the
    generation ends normally (completed or incomplete): the store hook.
    """

    def __init__(
        self,
        *,
        model: str,
        input_tokens: int,
        allow_tools: bool,
        echo: dict[str, Any],
        on_finish: Callable[[dict[str, Any]], None] | None = None,
        response_id: str | None = None,
        created_at: int | None = None,
    ) -> None:
        self.input_tokens = input_tokens
        self.allow_tools = allow_tools
        self.on_finish = on_finish
        self.response: dict[str, Any] = {
            "id": response_id or new_id("resp_", 32),
            "object": "response",
            "created_at": created_at if created_at is not None else int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "usage": None,
            **copy.deepcopy(echo),
        }
        self._seq = 0
        self._item: dict[str, Any] | None = None  # the open output item
        self._text = ""  # text of the open item's content part / arguments
        self._logprobs: list[dict[str, Any]] = []  # of the open message's text part
        self._lp = LogprobHold()
        self._gate = TextGate()
        self._call_ids = CallIds()

    def _ev(self, kind: str, **fields: Any) -> WireEvent:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return (kind, ev)

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def open(self) -> list[WireEvent]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._ev("response.created", response=self._snapshot()),
            self._ev("response.in_progress", response=self._snapshot()),
        ]

    def ping(self) -> bytes:
        """An SSE comment (clients ignore it)."""
        return comment("ping")

    # ------------------------------------------------------------ events

    def feed(self, ev: Event) -> list[WireEvent]:
        """Stream events for one engine Event."""
        out: list[WireEvent] = []
        if isinstance(ev, TokenLogprob):
            self._lp.add(ev)
        elif isinstance(ev, TextDelta):
            self._text_delta(ev.text, out)
        elif isinstance(ev, ReasoningDelta):
            if ev.text:
                self._gate.drop()
                self._lp.drop()
                self._reasoning_delta(ev.text, out)
        elif isinstance(ev, ToolCall) and not (self.allow_tools and json_object(ev.arguments)):
            self._text_delta(tool_call_as_text(ev), out)
        elif isinstance(ev, ToolCall):
            self._gate.drop()
            self._lp.drop()
            self._function_call(ev, out)
        elif isinstance(ev, Done):
            self._lp.drop()
            self._finish(ev, out)
        elif isinstance(ev, Error):
            self._close(out, "incomplete")
            code = error_kind(ev.kind).openai
            out.append(self._ev("error", code=code, message=ev.message, param=None))
            self.response["status"] = "failed"
            self.response["error"] = {"code": code, "message": ev.message}
            out.append(self._ev("response.failed", response=self._snapshot()))
        return out

    def _open_item(self, item: dict[str, Any], out: list[WireEvent]) -> int:
        self._close(out, "completed")
        self._item = item
        self._text = ""
        self._logprobs = []
        index = len(self.response["output"])
        out.append(
            self._ev("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        )
        return index

    def _part_added(self, part: dict[str, Any], out: list[WireEvent]) -> None:
        assert self._item is not None
        out.append(
            self._ev(
                "response.content_part.added",
                item_id=self._item["id"],
                output_index=len(self.response["output"]),
                content_index=0,
                part=part,
            )
        )

    def _text_delta(self, text: str, out: list[WireEvent]) -> None:
        text = self._gate.push(text) if text else ""
        if not text:
            return
        if self._item is None or self._item["type"] != "message":
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self._open_item(item, out)
            self._part_added(
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}, out
            )
        assert self._item is not None
        self._text += text
        logprobs = self._lp.take()
        self._logprobs += logprobs
        out.append(
            self._ev(
                "response.output_text.delta",
                item_id=self._item["id"],
                output_index=len(self.response["output"]),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )

    def _reasoning_delta(self, text: str, out: list[WireEvent]) -> None:
        if self._item is None or self._item["type"] != "reasoning":
            item = {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self._open_item(item, out)
            self._part_added({"type": "reasoning_text", "text": ""}, out)
        assert self._item is not None
        self._text += text
        out.append(
            self._ev(
                "response.reasoning_text.delta",
                item_id=self._item["id"],
                output_index=len(self.response["output"]),
                content_index=0,
                delta=text,
            )
        )

    def _function_call(self, ev: ToolCall, out: list[WireEvent]) -> None:
        call_id = self._call_ids.take(ev.id)
        item = {
            "id": new_id("fc_"),
            "type": "function_call",
            "call_id": call_id,
            "name": ev.name,
            "arguments": "",
            "status": "in_progress",
        }
        index = self._open_item(item, out)
        self._text = ev.arguments
        out.append(
            self._ev(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=ev.arguments,
            )
        )
        self._close(out, "completed")

    def _close(self, out: list[WireEvent], status: str) -> None:
        """Finish the open item: its .done events, then output_item.done."""
        item = self._item
        if item is None:
            return
        index = len(self.response["output"])
        ids = {"item_id": item["id"], "output_index": index}
        text = self._text
        item["status"] = status
        if item["type"] == "message":
            lps = self._logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
            out.append(
                self._ev(
                    "response.output_text.done",
                    **ids,
                    content_index=0,
                    text=text,
                    logprobs=copy.deepcopy(lps),
                )
            )
            out.append(self._ev("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [copy.deepcopy(part)]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._ev("response.reasoning_text.done", **ids, content_index=0, text=text))
            out.append(self._ev("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [copy.deepcopy(part)]
        else:
            item["arguments"] = text
            out.append(
                self._ev(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item["name"],
                    arguments=text,
                )
            )
        out.append(
            self._ev("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        )
        self.response["output"].append(item)
        self._item = None
        self._text = ""
        self._logprobs = []

    def _finish(self, done: Done, out: list[WireEvent]) -> None:
        truncated = done.stop_reason == "max_tokens"
        self._close(out, "incomplete" if truncated else "completed")
        r = self.response
        prompt = done.usage.input_tokens or self.input_tokens
        r["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": done.usage.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": done.usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + done.usage.output_tokens,
            "timings": timings_body(done.timings),
            **speculative_usage(done.usage),
        }
        r["completed_at"] = int(time.time())
        if truncated:
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
            out.append(self._ev("response.incomplete", response=self._snapshot()))
        else:
            r["status"] = "completed"
            out.append(self._ev("response.completed", response=self._snapshot()))
        if self.on_finish is not None:
            self.on_finish(self._snapshot())

    # -------------------------------------------------------------- fold

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The non-streaming Response: :func:`fold_events` over these events."""
        return fold_events(wire)


def fold_events(wire: list[WireEvent]) -> dict[str, Any]:
    """Rebuild the Response a Responses event stream describes.

    The created response, the items of ``output_item.done`` in output order,
    then status, usage and details of the terminal event. Raises ValueError on
    a failed stream, a gap in the sequence numbers or a missing terminal event.
    """
    resp: dict[str, Any] | None = None
    items: dict[int, dict[str, Any]] = {}
    for expect, (name, payload) in enumerate(wire):
        if payload.get("sequence_number") != expect:
            raise ValueError(
                f"{name}: sequence_number {payload.get('sequence_number')} != {expect}"
            )
        if name == "response.created":
            resp = copy.deepcopy(payload["response"])
        elif name in ("error", "response.failed"):
            raise ValueError(payload.get("message") or payload["response"]["error"]["message"])
        elif name == "response.output_item.done":
            items[payload["output_index"]] = copy.deepcopy(payload["item"])
        elif name in _TERMINAL:
            if resp is None:
                raise ValueError(f"{name} before response.created")
            final = payload["response"]
            for key in ("status", "usage", "incomplete_details", "error", "completed_at"):
                if key in final:
                    resp[key] = copy.deepcopy(final[key])
            resp["output"] = [items[i] for i in sorted(items)]
            return resp
    raise ValueError("the stream ended without response.completed or response.incomplete")
