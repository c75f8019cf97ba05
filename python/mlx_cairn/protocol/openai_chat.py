"""OpenAI Chat Completions: request bodies -> ChatRequest, Events -> chunks, fold.

Request mapping (validated before any model work, each failure a 400 naming
the field; unknown fields are ignored):

- roles ``system`` / ``developer`` (both become system turns), ``user``,
  ``assistant`` (``content``, ``tool_calls`` with JSON-string arguments,
  ``reasoning_content`` from an earlier turn) and ``tool`` (``tool_call_id``);
- content as a string or parts (``text``; ``image_url`` parts of user and
  tool messages, ``data:`` or allowed ``http(s)`` URLs, are decoded into the
  message's images (:mod:`mlx_cairn.protocol.images`); audio and files
  become a short placeholder);
- ``tools`` (function tools; other types are skipped) and ``tool_choice``
  (auto / none / required / a named function: only that function is shown);
- ``stop`` (string or list), ``max_completion_tokens`` (wins) or
  ``max_tokens`` (absent: up to the end of the context), ``temperature``
  (0..2), ``top_p``, ``seed``, ``frequency_penalty`` / ``presence_penalty``
  (-2..2), ``logit_bias``, ``logprobs`` + ``top_logprobs`` (0..20, only with
  ``logprobs``), vLLM's extra ``top_k`` / ``min_p`` / ``repetition_penalty``
  (rules: :mod:`mlx_cairn.protocol.sampling`), ``reasoning_effort``,
  ``cache_salt`` (as in vLLM: different salts share no cached prefix); ``n``
  other than 1 is a 400.

Wire format of a stream (one request, one choice)::

    {"choices":[{"delta":{"role":"assistant","content":<first text or null>,...}}]}
    {"choices":[{"delta":{"content":"..."}}]}                     text
    {"choices":[{"delta":{"content":"..."},"logprobs":{"content":[...],"refusal":null}}]}
                                                                  text, with logprobs
    {"choices":[{"delta":{"reasoning_content":"..."}}]}           reasoning
    {"choices":[{"delta":{"tool_calls":[{"index":i,"id":"call_...","type":"function",
                 "function":{"name":...,"arguments":""}}]}}]}     once per call, then
    {"choices":[{"delta":{"tool_calls":[{"index":i,"function":{"arguments":"{...}"}}]}}]}
    {"choices":[{"delta":{},"finish_reason":"stop"|"length"|"tool_calls"}]}
    {"choices":[],"usage":{...}}                                  when include_usage
    [DONE]

With ``logprobs`` every generated token but the end of turn has one entry,
in order: each chunk carries the entries of the tokens since the last chunk
(:class:`~mlx_cairn.protocol.openai_common.LogprobHold`), text, reasoning and
tool-call chunks alike, and the finish chunk carries the rest (a stop
sequence, dropped whitespace, a call cut off), ``{"content": [], ...}`` at
least, so the completion always has a logprobs object when asked. A failure after the first byte is
one ``{"error": {...}}`` data line and no ``[DONE]``. The JSON response is
:func:`fold_chunks` over exactly these chunks (the codec always emits the
usage chunk in JSON mode), accumulated the way the ``openai`` SDK accumulates
them, logprobs included.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from mlx_cairn.errors import InvalidRequest, error_kind
from mlx_cairn.protocol.codec import (
    WireEvent,
    each_object,
    nonempty_list,
    required_model,
    speculative_usage,
    timings_body,
    tool_call_as_text,
)
from mlx_cairn.protocol.images import ImageReader, strip_marks
from mlx_cairn.protocol.openai_common import (
    CallIds,
    ChunkWire,
    LogprobHold,
    TextGate,
    chat_request,
    chunk_payloads,
    content_text,
    error_body,
    fail,
    function_tool,
    is_int,
    json_object,
    opt_bool,
    opt_max_tokens,
    output_format,
    short,
    stream_flags,
    tool_choice,
)
from mlx_cairn.protocol.sampling import read_sampling, top_logprobs
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Error,
    Event,
    Image,
    Message,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    Tool,
    ToolCall,
    Usage,
)

_TEXT_PARTS = ("text",)


@dataclass(slots=True)
class OpenAIChatRequest:
    """A validated Chat Completions request: the neutral request plus dialect options."""

    chat: ChatRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    #: No max_tokens / max_completion_tokens given: run to the end of the context.
    open_ended: bool = False
    prompt_param: str = "messages"
    #: The field the cap came from, as a context-length error names it.
    max_tokens_param: str = "max_tokens"


def parse_chat_request(
    body: Any, *, max_tokens_limit: int, images: ImageReader | None = None
) -> OpenAIChatRequest:
    """Validate a ``POST /v1/chat/completions`` body and map it to a ChatRequest.

    ``images`` reads the request's images under the server's limits (default:
    :class:`~mlx_cairn.protocol.images.ImageLimits` defaults, no URL fetching).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    body = strip_marks(body)
    model = required_model(body)
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise fail("n", "only n=1 is supported")
    if "messages" not in body:
        raise fail("messages", "field required")
    messages = _map_messages(body["messages"], images or ImageReader())

    cap = "max_completion_tokens"
    mt = opt_max_tokens(body, cap, max_tokens_limit)
    if mt is None:
        cap = "max_tokens"
        mt = opt_max_tokens(body, cap, max_tokens_limit)
    open_ended = mt is None

    sampling = read_sampling(body, max_temperature=2.0)
    sampling.logprobs = opt_bool(body, "logprobs", False)
    k = top_logprobs(body)
    if k and not sampling.logprobs:  # as OpenAI; 0 asks for nothing, so it passes
        raise fail("top_logprobs", "is only allowed when logprobs is true")
    if sampling.logprobs and k is not None:
        sampling.top_logprobs = k

    tools = _map_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools, nested=True)
    if choice is not None and not tools and choice != "none":
        raise fail("tool_choice", "is only allowed when tools are given")

    stream, include_usage = stream_flags(body)

    chat = chat_request(
        body,
        messages=messages,
        model=model,
        max_tokens=mt if mt is not None else max_tokens_limit,
        sampling=sampling,
        tools=tools,
        choice=choice,
        effort=body.get("reasoning_effort"),
        effort_param="reasoning_effort",
        output=output_format(body.get("response_format"), "response_format", nested=True),
    )
    return OpenAIChatRequest(chat, model, stream, include_usage, open_ended, max_tokens_param=cap)


def _map_messages(raw: Any, reader: ImageReader) -> list[Message]:
    raw = nonempty_list(raw, "messages")
    out: list[Message] = []
    names: dict[str, str] = {}  # tool call id -> function name
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise fail(param, "must be an object")
        role = m.get("role")
        if role in ("system", "developer"):
            out.append(
                Message("system", content_text(m.get("content"), f"{param}.content", _TEXT_PARTS))
            )
        elif role == "user":
            images: list[Image] = []
            text = content_text(m.get("content"), f"{param}.content", _TEXT_PARTS, images, reader)
            out.append(Message("user", text, images=images))
        elif role == "assistant":
            msg = _map_assistant(m, param)
            names.update({tc.id: tc.name for tc in msg.tool_calls})
            out.append(msg)
        elif role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise fail(f"{param}.tool_call_id", "must be a non-empty string")
            images = []
            text = content_text(m.get("content"), f"{param}.content", _TEXT_PARTS, images, reader)
            out.append(Message("tool", text, tool_call_id=tid, name=names.get(tid), images=images))
        elif role == "function":
            raise fail(
                f"{param}.role", "the deprecated 'function' role is not supported; use 'tool'"
            )
        else:
            raise fail(f"{param}.role", f"unknown role {short(role)}")
    return out


def _map_assistant(m: dict[str, Any], param: str) -> Message:
    text = content_text(m.get("content"), f"{param}.content", _TEXT_PARTS)
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise fail(f"{param}.reasoning_content", "must be a string")
    calls: list[ToolCall] = []
    raw_calls = m.get("tool_calls")
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            raise fail(f"{param}.tool_calls", "must be a list")
        for k, tc in enumerate(raw_calls):
            tp = f"{param}.tool_calls[{k}]"
            if not isinstance(tc, dict):
                raise fail(tp, "must be an object")
            tid = tc.get("id")
            if not isinstance(tid, str) or not tid:
                raise fail(f"{tp}.id", "must be a non-empty string")
            if tc.get("type", "function") != "function":
                raise fail(f"{tp}.type", "must be 'function'")
            fn = tc.get("function")
            if not isinstance(fn, dict):
                raise fail(f"{tp}.function", "must be an object")
            name, args = fn.get("name"), fn.get("arguments", "{}")
            if not isinstance(name, str) or not name:
                raise fail(f"{tp}.function.name", "must be a non-empty string")
            if not isinstance(args, str) or not json_object(args or "{}"):
                raise fail(f"{tp}.function.arguments", "must be the JSON text of an object")
            calls.append(ToolCall(tid, name, args or "{}"))
    return Message("assistant", text, reasoning=reasoning or None, tool_calls=calls)


def _map_tools(raw: Any) -> list[Tool]:
    tools: list[Tool] = []
    for param, t in each_object(raw, "tools"):
        if t.get("type") != "function":
            continue  # custom / server-side tools: nothing a local model can run
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise fail(f"{param}.function", "must be an object")
        tools.append(
            function_tool(
                fn.get("name"),
                fn.get("description"),
                fn.get("parameters"),
                f"{param}.function",
                fn.get("strict"),
            )
        )
    return tools


# ----------------------------------------------------------------- encoding

_FINISH = {"max_tokens": "length"}


class ChatCodec(ChunkWire):
    """Encodes one request's Events as ``chat.completion.chunk`` objects (see module doc)."""

    OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        *,
        model: str,
        input_tokens: int,
        include_usage: bool,
        allow_tools: bool,
        logprobs: bool = False,
        completion_id: str | None = None,
        created: int | None = None,
    ) -> None:
        super().__init__(
            model, "chatcmpl-", completion_id, created, input_tokens, include_usage, logprobs
        )
        self.allow_tools = allow_tools
        self._role_sent = False
        self._calls = 0
        self._gate = TextGate()
        self._call_ids = CallIds()
        self._lp = LogprobHold()
        self._lp_sent = False

    def open(self) -> list[WireEvent]:
        """Nothing: the role rides on the first delta."""
        return []

    def _delta(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> WireEvent:
        if not self._role_sent:
            self._role_sent = True
            delta = {"role": "assistant", "content": None, **delta}
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return self._chunk([choice])

    def feed(self, ev: Event) -> list[WireEvent]:
        """Chunks for one engine Event."""
        out: list[WireEvent] = []
        if isinstance(ev, TokenLogprob):
            if self.logprobs:
                self._lp.add(ev)
        elif isinstance(ev, TextDelta):
            self._text(ev.text, out)
        elif isinstance(ev, ReasoningDelta):
            if ev.text:
                self._gate.drop()
                out.append(self._delta({"reasoning_content": ev.text}, logprobs=self._entries()))
        elif isinstance(ev, ToolCall) and not (self.allow_tools and json_object(ev.arguments)):
            self._text(tool_call_as_text(ev), out)
        elif isinstance(ev, ToolCall):
            self._gate.drop()
            i = self._calls
            self._calls += 1
            call_id = self._call_ids.take(ev.id)
            head = {
                "index": i,
                "id": call_id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
            out.append(self._delta({"tool_calls": [head]}, logprobs=self._entries()))
            out.append(
                self._delta({"tool_calls": [{"index": i, "function": {"arguments": ev.arguments}}]})
            )
        elif isinstance(ev, Done):
            if not self._role_sent:
                out.append(self._delta({"content": ""}))
            finish = _FINISH.get(ev.stop_reason, "tool_calls" if self._calls else "stop")
            # What is still held rides here; asked, but no chunk carried any: the
            # completion still gets its (empty) logprobs object, in both modes.
            out.append(self._delta({}, finish, self._entries(last=True)))
            if self.include_usage:
                out.append(self._chunk([], usage=self._usage(ev)))
            out.append((None, "[DONE]"))
        elif isinstance(ev, Error):
            status = error_kind(ev.kind).status
            out.append((None, error_body(status, ev.kind, ev.message, None)))
        return out

    def _text(self, text: str, out: list[WireEvent]) -> None:
        text = self._gate.push(text) if text else ""
        if text:
            out.append(self._delta({"content": text}, logprobs=self._entries(text=True)))

    def _entries(self, *, text: bool = False, last: bool = False) -> list[dict[str, Any]] | None:
        """The held logprob entries for the chunk going out, or None (not asked; none
        held, on a reasoning or tool-call chunk). A ``text`` chunk always carries the
        object; the ``last`` (finish) chunk does when no chunk did, so a completion
        always has one."""
        if not self.logprobs:
            return None
        entries = self._lp.take()
        if not (entries or text or (last and not self._lp_sent)):
            return None
        self._lp_sent = True
        return entries

    def _usage(self, done: Done) -> dict[str, Any]:
        prompt = done.usage.input_tokens or self.input_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done.usage.output_tokens,
            "total_tokens": prompt + done.usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": done.usage.cached_tokens},
            "timings": timings_body(done.timings),
            **_prediction_usage(done.usage),
        }

    def fold(self, wire: list[WireEvent]) -> dict[str, Any]:
        """The non-streaming ``chat.completion``: :func:`fold_chunks` over these chunks."""
        return fold_chunks(wire)


def _prediction_usage(u: Usage) -> dict[str, Any]:
    """Speculative decoding's figures: OpenAI's own predicted-output fields (accepted
    and rejected draft tokens) and the extra ones every dialect has."""
    extra = speculative_usage(u)
    if not extra:
        return {}
    accepted = u.accepted_draft_tokens
    details = {
        "accepted_prediction_tokens": accepted,
        "rejected_prediction_tokens": u.draft_tokens - accepted,
    }
    return {"completion_tokens_details": details, **extra}


def _accumulate(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    """Merge one delta the way the ``openai`` SDK does (strings concatenate)."""
    for key, val in delta.items():
        cur = acc.get(key)
        if key == "tool_calls":
            calls = acc.setdefault("tool_calls", [])
            for tc in val:
                i = tc["index"]
                while len(calls) <= i:
                    calls.append({})
                _accumulate(calls[i], {k: v for k, v in tc.items() if k != "index"})
        elif cur is None or key == "type":
            acc[key] = copy.deepcopy(val)
        elif isinstance(cur, str) and isinstance(val, str):
            acc[key] = cur + val
        elif isinstance(cur, dict) and isinstance(val, dict):
            _accumulate(cur, val)
        elif val is not None:
            acc[key] = copy.deepcopy(val)


def _accumulate_logprobs(
    acc: dict[str, Any] | None, got: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Merge one chunk's ``logprobs`` the way the ``openai`` SDK does: the first
    object is kept, later ``content`` / ``refusal`` lists extend it."""
    if got is None:
        return acc
    if acc is None:
        return copy.deepcopy(got)
    for key in ("content", "refusal"):
        if got.get(key):
            acc[key] = (acc.get(key) or []) + copy.deepcopy(got[key])
    return acc


def fold_chunks(wire: list[WireEvent]) -> dict[str, Any]:
    """Accumulate chat completion chunks into the ``chat.completion`` they describe.

    Raises ValueError on an error chunk or when no chunk came.
    """
    head: dict[str, Any] | None = None
    message: dict[str, Any] = {}
    logprobs: dict[str, Any] | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    for payload in chunk_payloads(wire):
        head = head or payload
        for choice in payload["choices"]:
            _accumulate(message, choice["delta"])
            logprobs = _accumulate_logprobs(logprobs, choice.get("logprobs"))
            finish = choice.get("finish_reason") or finish
        if payload.get("usage") is not None:
            usage = payload["usage"]
    if head is None:
        raise ValueError("no chunks")
    message.setdefault("role", "assistant")
    message.setdefault("content", None)
    message.setdefault("refusal", None)
    return {
        "id": head["id"],
        "object": "chat.completion",
        "created": head["created"],
        "model": head["model"],
        "system_fingerprint": head.get("system_fingerprint"),
        "choices": [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        ],
        "usage": copy.deepcopy(usage),
    }
