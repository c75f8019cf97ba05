"""What the two OpenAI dialects (Chat Completions, Responses) share.

- the error envelope ``{"error": {"message", "type", "param", "code"}}`` and
  the status -> type table;
- field validators that name the offending field (``messages[2].content``);
- ``tools`` / ``tool_choice`` / ``reasoning_effort`` mapping to the neutral
  :class:`~mlx_cairn.types.ChatRequest`;
- :class:`TextGate`: holds whitespace that only precedes a tool call (the
  same rule as the Anthropic encoder, so a tool-only answer has no text);
- a tool call the request did not allow comes back as text, nothing is lost
  (:func:`~mlx_cairn.protocol.codec.tool_call_as_text`);
- :func:`logprob_entry`, one token's log-probabilities in the OpenAI shape,
  and :class:`LogprobHold`, the rule for which tokens' logprobs a text
  delta carries (both dialects).

Error types and codes come from the one table in :mod:`mlx_cairn.errors`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import orjson

from mlx_cairn.errors import error_kind
from mlx_cairn.protocol.codec import (
    MEDIA_PLACEHOLDER,
    WireEvent,
    cache_salt,
    fail,
    is_int,
    new_id,
    opt_bool,
    short,
    speculative_switch,
)
from mlx_cairn.protocol.frames import comment
from mlx_cairn.protocol.images import ImageReader
from mlx_cairn.types import (
    IMAGE_MARK,
    MAX_STOP_SEQUENCE_CHARS,
    MAX_STOP_SEQUENCES,
    ChatRequest,
    Image,
    Message,
    OutputFormat,
    SamplingParams,
    TokenLogprob,
    Tool,
)


class CallIds:
    """``call_`` ids for one response: the engine's id when it is a fresh
    ``call_...``, else a new random one (ids never repeat within a response)."""

    def __init__(self) -> None:
        self._used: set[str] = set()

    def take(self, engine_id: str) -> str:
        cid = engine_id if engine_id.startswith("call_") else ""
        while not cid or cid in self._used:
            cid = new_id("call_")
        self._used.add(cid)
        return cid


def error_body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    """The OpenAI error envelope (the ``error_body`` of both OpenAI dialects)."""
    row = error_kind(kind)
    return {
        "error": {"message": message, "type": row.openai, "param": param, "code": row.openai_code}
    }


def models_body(models: list[Any]) -> dict[str, Any]:
    """``GET /v1/models`` in the OpenAI shape.

    Each entry carries the model's context, once known, under the names
    OpenAI-compatible peers use: ``context_length`` (LM Studio, OpenRouter)
    and ``max_model_len`` (vLLM); clients size their prompts by them.
    """
    data = []
    for m in models:
        entry = {"id": m.id, "object": "model", "created": m.created, "owned_by": "mlx-cairn"}
        if m.context_length is not None:
            entry["context_length"] = entry["max_model_len"] = m.context_length
        data.append(entry)
    return {"object": "list", "data": data}


# ---------------------------------------------------------------- validation


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage`` (the options only with a stream)."""
    stream = opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise fail("stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise fail("stream_options", "must be an object")
    return stream, opt_bool(opts, "include_usage", False)


def opt_max_tokens(body: dict[str, Any], key: str, limit: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v):
        raise fail(key, "must be an integer")
    if v < 1:
        raise fail(key, "must be at least 1")
    if v > limit:
        raise fail(key, f"must be at most {limit} on this server")
    return int(v)


def stop_list(raw: Any, param: str = "stop") -> list[str]:
    """``stop``: a string or a list of strings."""
    if raw is None:
        return []
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise fail(param, "must be a string or a list of strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise fail(param, f"at most {MAX_STOP_SEQUENCES} entries")
    for i, s in enumerate(items):
        p = param if isinstance(raw, str) else f"{param}[{i}]"
        if not isinstance(s, str) or not s:
            raise fail(p, "must be a non-empty string")
        if len(s) > MAX_STOP_SEQUENCE_CHARS:
            raise fail(p, f"at most {MAX_STOP_SEQUENCE_CHARS} characters")
    return list(items)


#: ``metadata`` bounds, as the OpenAI API documents them: it is stored and echoed.
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def metadata_map(raw: Any, param: str = "metadata") -> dict[str, str] | None:
    """``metadata``: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(param, "must be an object")
    if len(raw) > METADATA_MAX_PAIRS:
        raise fail(param, f"at most {METADATA_MAX_PAIRS} key-value pairs")
    for k, v in raw.items():
        if len(k) > METADATA_MAX_KEY_CHARS:
            raise fail(param, f"keys are at most {METADATA_MAX_KEY_CHARS} characters")
        if not isinstance(v, str):
            raise fail(f"{param}.{short(k)}", "must be a string")
        if len(v) > METADATA_MAX_VALUE_CHARS:
            raise fail(f"{param}.{short(k)}", f"at most {METADATA_MAX_VALUE_CHARS} characters")
    return dict(raw)


def reasoning_switch(effort: Any, param: str) -> bool | None:
    """``reasoning_effort`` -> the model's reasoning switch (None: model default)."""
    if effort is None:
        return None
    if effort in ("none", "minimal"):
        return False
    if effort in ("low", "medium", "high", "xhigh"):
        return True
    raise fail(param, "must be one of 'none', 'minimal', 'low', 'medium', 'high'")


def chat_request(
    body: dict[str, Any],
    *,
    messages: list[Message],
    model: str,
    max_tokens: int,
    sampling: SamplingParams,
    tools: list[Tool],
    choice: str | dict[str, Any] | None,
    effort: Any,
    effort_param: str,
    output: OutputFormat | None = None,
) -> ChatRequest:
    """The neutral request both OpenAI dialects build; reads ``stop``, ``cache_salt``
    and ``parallel_tool_calls``."""
    return ChatRequest(
        messages=messages,
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop_list(body.get("stop")),
        tools=tools_for_choice(tools, choice),
        tool_choice=choice if tools else None,
        reasoning=reasoning_switch(effort, effort_param),
        cache_salt=cache_salt(body),
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls", True),
        output_format=output,
        speculative=speculative_switch(body),
    )


def output_format(raw: Any, param: str, *, nested: bool) -> OutputFormat | None:
    """``response_format`` (Chat, ``nested``: the schema under ``json_schema``) or
    ``text.format`` (Responses): ``text`` -> None, ``json_object``, ``json_schema``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(param, "must be an object")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat(None, "json_object", param=param)
    if kind != "json_schema":
        raise fail(f"{param}.type", "must be one of 'text', 'json_object', 'json_schema'")
    where = f"{param}.json_schema" if nested else param
    spec = raw.get("json_schema") if nested else raw
    if not isinstance(spec, dict):
        raise fail(where, "must be an object")
    name = spec.get("name", "")
    if not isinstance(name, str):
        raise fail(f"{where}.name", "must be a string")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise fail(f"{where}.schema", "must be a JSON Schema object")
    strict = spec.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise fail(f"{where}.strict", "must be a boolean")
    return OutputFormat(schema, name, bool(strict), param=where)


def content_text(
    raw: Any,
    param: str,
    text_types: tuple[str, ...],
    images: list[Image] | None = None,
    reader: ImageReader | None = None,
) -> str:
    """A message ``content``: a string, or parts whose text is joined.

    Text parts are the ``text_types`` (``text`` for Chat, ``input_text`` /
    ``output_text`` for Responses); refusals keep their text. Where ``images``
    and ``reader`` are given (user turns and tool results), image parts (Chat
    ``image_url``, Responses ``input_image``) are decoded into ``images`` and
    stand in the text as ``IMAGE_MARK``; elsewhere, and for audio and files,
    a part becomes a short placeholder.
    """
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise fail(param, "must be a string or a list of content parts")
    out: list[str] = []
    for j, part in enumerate(raw):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise fail(pp, "must be an object")
        kind = part.get("type")
        if kind in text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise fail(f"{pp}.text", "must be a string")
            out.append(text)
        elif kind == "refusal":
            text = part.get("refusal")
            if not isinstance(text, str):
                raise fail(f"{pp}.refusal", "must be a string")
            out.append(text)
        elif kind in ("image_url", "input_image") and images is not None and reader is not None:
            images.append(_image_part(part, kind, pp, reader))
            out.append(IMAGE_MARK)
        elif kind in ("image_url", "input_image", "input_audio", "file", "input_file"):
            out.append(MEDIA_PLACEHOLDER.format(kind=kind))
        else:
            raise fail(f"{pp}.type", f"unsupported content part type {short(kind)}")
    return "".join(out)


def _image_part(part: dict[str, Any], kind: str, pp: str, reader: ImageReader) -> Image:
    """Chat ``{"type": "image_url", "image_url": {"url": ...}}`` or Responses
    ``{"type": "input_image", "image_url": ...}``: a ``data:`` or ``http(s)`` URL."""
    url = part.get("image_url")
    up = f"{pp}.image_url"
    if isinstance(url, dict):
        url, up = url.get("url"), f"{up}.url"
    if url is None and kind == "input_image" and part.get("file_id") is not None:
        raise fail(
            f"{pp}.file_id", "uploaded files are not supported; send image_url as a data: URL"
        )
    return reader.url(url, up)


def function_tool(name: Any, desc: Any, params: Any, param: str, strict: Any = None) -> Tool:
    """One validated function tool."""
    if not isinstance(name, str) or not name:
        raise fail(f"{param}.name", "must be a non-empty string")
    if desc is None:
        desc = ""
    if not isinstance(desc, str):
        raise fail(f"{param}.description", "must be a string")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise fail(f"{param}.parameters", "must be a JSON Schema object")
    if strict is not None and not isinstance(strict, bool):
        raise fail(f"{param}.strict", "must be a boolean")
    return Tool(name, desc, params, bool(strict))


def tool_choice(raw: Any, tools: list[Tool], *, nested: bool) -> str | dict[str, Any] | None:
    """``tool_choice``: auto / none / required or one named function.

    ``nested``: Chat spells a named choice ``{"type": "function", "function":
    {"name": ...}}``, Responses ``{"type": "function", "name": ...}``.
    """
    if raw is None:
        return None
    if raw in ("auto", "none", "required"):
        return str(raw)
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise fail("tool_choice", "must be 'auto', 'none', 'required' or a named function")
    holder = raw.get("function") if nested else raw
    name = holder.get("name") if isinstance(holder, dict) else None
    where = "tool_choice.function.name" if nested else "tool_choice.name"
    if not isinstance(name, str) or not name:
        raise fail(where, "must be a non-empty string")
    if not any(t.name == name for t in tools):
        raise fail(where, f"no tool named {short(name)} in tools")
    return {"name": name}


def tools_for_choice(tools: list[Tool], choice: str | dict[str, Any] | None) -> list[Tool]:
    """The tools the model is shown: only the named one for a named choice."""
    if isinstance(choice, dict):
        return [t for t in tools if t.name == choice["name"]]
    return tools


# ------------------------------------------------------------------ encoding


def json_object(text: str) -> bool:
    """Whether ``text`` is the JSON text of an object."""
    try:
        return isinstance(orjson.loads(text), dict)
    except orjson.JSONDecodeError:
        return False


class TextGate:
    """Holds text that is whitespace only until something visible follows.

    Whitespace the model writes before a tool call (or before the end) is
    dropped; whitespace before more text is released with it.
    """

    def __init__(self) -> None:
        self.started = False
        self._held = ""

    def push(self, text: str) -> str:
        """The text to send now ("" while only whitespace has been seen)."""
        if self.started:
            return text
        held = self._held + text
        if not held.strip():
            self._held = held
            return ""
        self.started = True
        self._held = ""
        return held

    def drop(self) -> None:
        """A tool call or reasoning came next: forget held whitespace, hold again."""
        self.started = False
        self._held = ""


# ------------------------------------------------------------------ logprobs

#: What a log-probability too small to write (-inf, NaN) is sent as: the
#: value OpenAI documents for "very unlikely".
VERY_UNLIKELY = -9999.0


def wire_logprob(x: float) -> float:
    """A log-probability as sent: in ``[-9999, 0]`` (float rounding can pass 0 by an ulp)."""
    if not math.isfinite(x) or x < VERY_UNLIKELY:
        return VERY_UNLIKELY
    return min(float(x), 0.0)


def _token_bytes(token: str, raw: tuple[int, ...]) -> list[int]:
    # The engine's bytes when it gave them (a byte-fallback token holds part
    # of a character); else the UTF-8 of the token's text.
    return list(raw) if raw else list(token.encode("utf-8", "surrogatepass"))


def logprob_entry(ev: TokenLogprob) -> dict[str, Any]:
    """One sampled token as ``{token, logprob, bytes, top_logprobs}``, most likely first.

    The shape of Chat's ``logprobs.content[i]`` and of Responses'
    ``output_text.logprobs[i]`` (its deltas carry the same entries).
    """
    top = sorted(ev.top, key=lambda t: -wire_logprob(t.logprob))  # stable: ties keep engine order
    return {
        "token": ev.token,
        "logprob": wire_logprob(ev.logprob),
        "bytes": _token_bytes(ev.token, ev.token_bytes),
        "top_logprobs": [
            {
                "token": t.token,
                "logprob": wire_logprob(t.logprob),
                "bytes": _token_bytes(t.token, t.token_bytes),
            }
            for t in top
        ],
    }


class ChunkWire:
    """What the OpenAI chunk codecs (Chat, legacy Completions) share: the chunk
    envelope with their ``OBJECT`` name, the usage and logprobs switches, and
    the keep-alive ping."""

    OBJECT = ""

    def __init__(
        self,
        model: str,
        id_prefix: str,
        completion_id: str | None,
        created: int | None,
        input_tokens: int,
        include_usage: bool,
        logprobs: bool,
    ):
        self.model = model
        self.id = completion_id or new_id(id_prefix)
        self.created = created if created is not None else int(time.time())
        self.input_tokens = input_tokens
        self.include_usage = include_usage
        #: The request asked for logprobs: text chunks carry them.
        self.logprobs = logprobs

    def ping(self) -> bytes:
        """An SSE comment (clients ignore it)."""
        return comment("ping")

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> WireEvent:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        body.update(extra)
        return (None, body)


def chunk_payloads(wire: list[WireEvent]) -> Iterator[dict[str, Any]]:
    """The chunk objects of a chunk codec's wire events, for its ``fold``: the
    ``[DONE]`` sentinel skipped; an error chunk raises ValueError with its message."""
    for _, payload in wire:
        if isinstance(payload, str):  # [DONE]
            continue
        if "error" in payload:
            raise ValueError(payload["error"]["message"])
        yield payload


class LogprobHold:
    """Which tokens' logprobs ride on which chunk (both OpenAI dialects).

    The engine sends a token's :class:`~mlx_cairn.types.TokenLogprob` before
    that token's text, but the text may come later (a partial UTF-8
    character, a possible stop sequence, leading whitespace held by
    :class:`TextGate`) or never as answer text (a ``</think>`` tag, tool-call
    markup, whitespace the gate drops). Every generated token but the end of
    turn has exactly one entry, in order, whatever its text became: entries
    are held until the next chunk goes out and ride on it (:meth:`take`).
    Chat puts them on any chunk (text, reasoning, a tool call, the finish
    chunk), so ``logprobs.content`` covers the whole output as vLLM's does;
    Responses has a place for them on answer text only and drops the rest
    (:meth:`drop`). Streaming and the JSON body carry the same entries,
    because the JSON body is the fold of these very chunks.
    """

    def __init__(self) -> None:
        self._held: list[dict[str, Any]] = []

    def add(self, ev: TokenLogprob) -> None:
        self._held.append(logprob_entry(ev))

    def take(self) -> list[dict[str, Any]]:
        """Every entry held so far, for the chunk being sent now."""
        held, self._held = self._held, []
        return held

    def drop(self) -> None:
        """Tokens with no place on the wire (Responses: reasoning, a call, the end)."""
        self._held = []
