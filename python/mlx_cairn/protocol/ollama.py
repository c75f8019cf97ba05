r"""Ollama API request bodies (``/api/chat``, ``/api/generate``) -> ChatRequest.

Validated before any model work; every failure is an
:class:`~mlx_cairn.errors.InvalidRequest` naming the field
(``messages[1].tool_calls[0].function.arguments: ...``), answered as Ollama
answers errors: ``{"error": "..."}``. Unknown fields and unknown ``options``
are ignored, as Ollama ignores them.

Mapping rules:

- ``messages``: roles ``system``, ``user``, ``assistant`` (``content``,
  ``thinking`` from an earlier turn, ``tool_calls`` whose ``arguments`` are an
  object) and ``tool`` (``tool_name``, ``tool_call_id``; without an id a result
  answers the earliest call of the turn before it not answered yet). A call
  without an ``id`` gets one from its place (``call_<message>_<call>``), so the
  same conversation renders the same prompt and hits the prefix cache.
- ``images`` (base64 strings, on a message or on ``/api/generate``) are
  decoded here (:mod:`mlx_cairn.protocol.images`) and stand before the
  message's text as ``IMAGE_MARK``\ s; the route refuses them (400) for a model
  that does not read images. A ``raw`` or ``suffix`` prompt takes none.
- ``tools``: function tools, as in Chat Completions (other types are skipped).
- ``format``: ``"json"`` (any JSON object) or a JSON Schema object: decoding is
  constrained to it (the grammar engine, leniently: keywords it cannot
  enforce are left to the model, as Ollama does).
- ``think``: ``true`` / ``false`` / ``"low"`` / ``"medium"`` / ``"high"``: the
  model's reasoning switch (an effort level turns it on).
- ``options`` (Ollama's names -> ours): ``temperature`` (0..2), ``top_p``,
  ``top_k``, ``min_p``, ``seed``, ``num_predict`` -> max tokens (-1 / -2 or
  absent: up to the end of the context), ``stop``, ``repeat_penalty`` ->
  repetition penalty, ``presence_penalty`` / ``frequency_penalty`` (-2..2),
  ``num_ctx``: the request's context (a prompt and answer that do not fit
  are a 400; Ollama would cut the conversation instead). Defaults are the
  server's, the same in every dialect, not Ollama's Modelfile defaults.
- ``keep_alive``: seconds (a number) or a Go duration (``"5m"``, ``"1h30m"``,
  ``"0"``); negative: keep loaded. It sets how long the model stays loaded
  once idle (:meth:`~mlx_cairn.api.registry.ModelRegistry.keep_alive`).
- ``logprobs`` / ``top_logprobs`` (0..20, only with ``logprobs``).
- ``/api/generate``: ``prompt`` with an optional ``system`` through the chat
  template; ``raw: true`` sends ``prompt`` as it is; ``suffix`` makes a
  fill-in-the-middle prompt from the model's own FIM tokens (a 400 for a model
  without them); ``template`` (a Go template) is refused; ``context`` (token
  ids of an earlier answer) is ignored: send the conversation to ``/api/chat``.

A body with no ``messages`` (``/api/chat``) or no ``prompt`` and no ``suffix``
(``/api/generate``) only loads the model, or with ``keep_alive: 0`` unloads it
(:func:`load_request`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.codec import (
    each_object,
    fail,
    is_int,
    is_num,
    nonempty_list,
    opt_bool,
    required_model,
    short,
)
from mlx_cairn.protocol.images import ImageReader, strip_marks
from mlx_cairn.protocol.openai_common import function_tool, stop_list
from mlx_cairn.protocol.sampling import SETTINGS, read_sampling, top_logprobs
from mlx_cairn.types import (
    IMAGE_MARK,
    ChatRequest,
    Image,
    Message,
    OutputFormat,
    RawPrompt,
    SamplingParams,
    Tool,
    ToolCall,
)

Shape = Literal["chat", "generate"]


@dataclass(slots=True)
class OllamaRequest:
    """A validated ``/api/chat`` or ``/api/generate`` request."""

    chat: ChatRequest
    model: str
    shape: Shape = "chat"
    #: Ollama streams unless told not to.
    stream: bool = True
    #: No ``num_predict``: the answer may use the room the prompt leaves.
    open_ended: bool = True
    #: ``keep_alive`` in seconds (``inf``: keep loaded); None: not given.
    keep_alive: float | None = None
    #: ``options.num_ctx``: the context this request asks for (read by the runner).
    context_limit: int | None = None
    #: Images sent with the request (the route refuses them for a text-only model).
    images: int = 0
    prompt_param: str = "messages"
    max_tokens_param: str = "options.num_predict"
    #: The model name as the client wrote it (answers echo it; ``model`` is the
    #: name the server leases, e.g. without a ``:latest`` tag).
    echo: str = ""

    def __post_init__(self) -> None:
        self.echo = self.echo or self.model


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """A body that asks only to load (or, ``keep_alive`` 0, to unload) a model."""

    model: str
    keep_alive: float | None = None
    stream: bool = True
    shape: Shape = "chat"


def error_body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    """Ollama's error envelope: ``{"error": message}`` (the status says the rest); the
    field at fault leads the message when it does not already (there is no ``param``).

    >>> error_body(400, "invalid_request", "bad schema", "format")
    {'error': 'format: bad schema'}
    """
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"error": message}


# ------------------------------------------------------------------ top level


def load_request(body: Any, shape: Shape) -> LoadRequest | None:
    """The :class:`LoadRequest` a body is, or None for a generation request.

    ``/api/chat`` with ``messages`` absent or ``[]``, ``/api/generate`` with no
    ``prompt`` (or ``""``) and no ``suffix``: Ollama's way to load a model ahead
    of time, and with ``keep_alive: 0`` to unload it.
    """
    if not isinstance(body, dict):
        return None
    if shape == "chat":
        if body.get("messages") not in (None, []):
            return None
    elif body.get("prompt") not in (None, "") or body.get("suffix") not in (None, ""):
        return None
    return LoadRequest(
        model=required_model(body),
        keep_alive=keep_alive(body.get("keep_alive")),
        stream=opt_bool(body, "stream", True),
        shape=shape,
    )


def parse_chat_request(
    body: Any, *, max_tokens_limit: int, images: ImageReader | None = None
) -> OllamaRequest:
    """Validate a ``POST /api/chat`` body and map it to a ChatRequest.

    >>> r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
    ...                         "options": {"temperature": 0, "num_predict": 8}},
    ...                        max_tokens_limit=4096)
    >>> (r.chat.max_tokens, r.chat.sampling.temperature, r.stream)
    (8, 0.0, True)
    """
    body = strip_marks(_object(body))
    model = required_model(body)
    if "messages" not in body:
        raise fail("messages", "field required")
    reader = images or ImageReader()
    messages = _map_messages(body["messages"], reader)
    tools = _map_tools(body.get("tools"))
    req = _common(body, model, max_tokens_limit, messages=messages, tools=tools, shape="chat")
    req.images = reader.count
    return req


def parse_generate_request(
    body: Any, *, max_tokens_limit: int, images: ImageReader | None = None
) -> OllamaRequest:
    """Validate a ``POST /api/generate`` body and map it to a ChatRequest (see module doc)."""
    body = strip_marks(_object(body))
    model = required_model(body)
    prompt = _opt_str(body, "prompt")
    suffix = _opt_str(body, "suffix")
    system = _opt_str(body, "system")
    if _opt_str(body, "template"):
        raise fail(
            "template",
            "not supported: this server renders prompts with the model's own chat "
            "template; send raw=true with the whole prompt instead",
        )
    raw = opt_bool(body, "raw", False)
    context = body.get("context")
    if context is not None and not (isinstance(context, list) and all(map(is_int, context))):
        raise fail("context", "must be a list of token ids")
    reader = images or ImageReader()
    pics = _images(body.get("images"), "images", reader)
    raw_prompt: RawPrompt | None = None
    messages: list[Message] = []
    if pics and (suffix or raw):
        raise fail("images", "a raw or suffix prompt takes no images; send a templated prompt")
    if suffix:
        raw_prompt = RawPrompt(text=prompt, suffix=suffix)
    elif raw:
        raw_prompt = RawPrompt(text=prompt)
    else:
        user = Message("user", IMAGE_MARK * len(pics) + prompt, images=pics)
        messages = ([Message("system", system)] if system else []) + [user]
    req = _common(body, model, max_tokens_limit, messages=messages, tools=[], shape="generate")
    req.chat.raw = raw_prompt
    req.images = len(pics)
    req.prompt_param = "prompt"
    return req


def _common(
    body: dict[str, Any],
    model: str,
    limit: int,
    *,
    messages: list[Message],
    tools: list[Tool],
    shape: Shape,
) -> OllamaRequest:
    """What ``/api/chat`` and ``/api/generate`` share: options, format, think, stream."""
    opts = _options(body.get("options"), limit)
    sampling = opts.sampling
    sampling.logprobs = opt_bool(body, "logprobs", False)
    k = top_logprobs(body)
    if k and not sampling.logprobs:
        raise fail("top_logprobs", "is only allowed when logprobs is true")
    if sampling.logprobs and k is not None:
        sampling.top_logprobs = k
    chat = ChatRequest(
        messages=messages,
        model=model,
        max_tokens=opts.max_tokens if opts.max_tokens is not None else limit,
        sampling=sampling,
        stop=opts.stop,
        tools=tools,
        output_format=_format(body.get("format")),
        reasoning=_think(body.get("think")),
    )
    return OllamaRequest(
        chat,
        model,
        shape=shape,
        stream=opt_bool(body, "stream", True),
        open_ended=opts.max_tokens is None,
        keep_alive=keep_alive(body.get("keep_alive")),
        context_limit=opts.num_ctx,
    )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _opt_str(body: dict[str, Any], key: str, param: str | None = None) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise fail(param or key, "must be a string")
    return v


# -------------------------------------------------------------- options & co.


@dataclass(slots=True)
class _Options:
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None


#: Ollama option names that are ours under another name.
_RENAMED = {"repeat_penalty": "repetition_penalty"}
_BACK = {ours: theirs for theirs, ours in _RENAMED.items()}
#: The sampling settings ``options`` may hold, by Ollama's names.
_SAMPLING_KEYS = tuple(_BACK.get(k, k) for k in SETTINGS)


def _options(raw: Any, limit: int) -> _Options:
    """``options``: the sampling and length settings this server honours (module doc)."""
    if raw is None:
        return _Options(SamplingParams())
    if not isinstance(raw, dict):
        raise fail("options", "must be an object")
    mapped = {_RENAMED.get(k, k): raw[k] for k in _SAMPLING_KEYS if raw.get(k) is not None}
    try:
        sampling = read_sampling(mapped, max_temperature=2.0)
    except InvalidRequest as e:
        name = _BACK.get(e.param or "", e.param or "")
        message = e.message.removeprefix(f"{e.param}: ")  # fail() put the field first
        raise fail(f"options.{name}", message) from None
    out = _Options(sampling, stop=stop_list(raw.get("stop"), "options.stop"))
    n = raw.get("num_predict")
    if n is not None:
        if not is_int(n) or n == 0 or n < -2:
            raise fail("options.num_predict", "must be a positive integer, or -1 for no limit")
        if n > limit:
            raise fail("options.num_predict", f"must be at most {limit} on this server")
        out.max_tokens = n if n > 0 else None
    ctx = raw.get("num_ctx")
    if ctx is not None:
        if not is_int(ctx) or ctx < 1:
            raise fail("options.num_ctx", "must be a positive integer")
        out.num_ctx = int(ctx)
    return out


def _format(raw: Any) -> OutputFormat | None:
    """``format``: "" (free text), "json", or a JSON Schema object."""
    if raw is None or raw == "":
        return None
    if raw == "json":
        return OutputFormat(None, "json", strict=False, param="format")
    if isinstance(raw, dict):
        return OutputFormat(raw, "", strict=False, param="format")
    raise fail("format", "must be 'json' or a JSON Schema object")


def _think(raw: Any) -> bool | None:
    if raw is None or isinstance(raw, bool):
        return raw
    if raw in ("low", "medium", "high"):
        return True
    raise fail("think", "must be a boolean or one of 'low', 'medium', 'high'")


#: A Go duration (``time.ParseDuration``): numbers with units, e.g. ``1h30m``, ``-1s``.
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def keep_alive(raw: Any) -> float | None:
    """``keep_alive`` in seconds: a number is seconds, a string a Go duration; any
    negative value keeps the model loaded (``inf``). None when absent.

    >>> [keep_alive(v) for v in (None, 0, "5m", "1h30m", "-1", 2.5)]
    [None, 0.0, 300.0, 5400.0, inf, 2.5]
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        text = raw.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = float(text)  # a bare number is seconds, as Ollama reads it
        except ValueError:
            parts = _DURATION.findall(text)
            if not text or "".join(n + u for n, u in parts) != text:
                raise fail("keep_alive", f"{short(raw)} is not a duration such as '5m'") from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        value = sign * seconds
    elif is_num(raw):
        value = float(raw)
    else:
        raise fail("keep_alive", "must be a number of seconds or a duration such as '5m'")
    if not math.isfinite(value):
        raise fail("keep_alive", "must be finite")
    return math.inf if value < 0 else value


# ------------------------------------------------------------------ messages


def _images(raw: Any, param: str, reader: ImageReader) -> list[Image]:
    """The images (base64 strings) of an ``images`` field, decoded."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(i, str) for i in raw):
        raise fail(param, "must be a list of base64-encoded images")
    return [reader.base64(data, None, f"{param}[{k}]") for k, data in enumerate(raw)]


def _map_messages(raw: Any, reader: ImageReader) -> list[Message]:
    raw = nonempty_list(raw, "messages")
    out: list[Message] = []
    pending: list[ToolCall] = []  # calls of the last assistant turn not answered yet
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise fail(param, "must be an object")
        role = m.get("role")
        text = _opt_str(m, "content", f"{param}.content")
        pics = _images(m.get("images"), f"{param}.images", reader)
        if pics and role not in ("user", "tool"):
            raise fail(f"{param}.images", "only user and tool messages take images")
        if role in ("system", "user"):
            # As Ollama places them: the pictures first, then the text.
            out.append(Message(role, IMAGE_MARK * len(pics) + text, images=pics))
        elif role == "assistant":
            thinking = _opt_str(m, "thinking", f"{param}.thinking")
            calls = _map_calls(m.get("tool_calls"), i, param)
            out.append(Message("assistant", text, reasoning=thinking or None, tool_calls=calls))
            pending = list(calls)
        elif role == "tool":
            out.append(_map_tool_result(m, text, param, pending))
        else:
            raise fail(f"{param}.role", f"unknown role {short(role)}")
        if pics and role == "tool":
            out[-1].content = IMAGE_MARK * len(pics) + out[-1].content
            out[-1].images = pics
    return out


def _map_calls(raw: Any, i: int, param: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise fail(f"{param}.tool_calls", "must be a list")
    calls: list[ToolCall] = []
    for k, tc in enumerate(raw):
        tp = f"{param}.tool_calls[{k}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            raise fail(f"{tp}.function", "must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{tp}.function.name", "must be a non-empty string")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # some clients send the JSON text, as in Chat Completions
            try:
                args = orjson.loads(args or "{}")
            except orjson.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            raise fail(f"{tp}.function.arguments", "must be an object")
        cid = tc.get("id")
        if not isinstance(cid, str) or not cid:
            cid = f"call_{i}_{k}"
        calls.append(ToolCall(cid, name, orjson.dumps(args).decode()))
    return calls


def _map_tool_result(m: dict[str, Any], text: str, param: str, pending: list[ToolCall]) -> Message:
    tid = m.get("tool_call_id")
    if tid is not None and (not isinstance(tid, str) or not tid):
        raise fail(f"{param}.tool_call_id", "must be a non-empty string")
    name = m.get("tool_name", m.get("name"))
    if name is not None and not isinstance(name, str):
        raise fail(f"{param}.tool_name", "must be a string")
    call = next((c for c in pending if c.id == tid), None) if tid else None
    if call is None and tid is None and pending:
        # No id (most Ollama clients): the earliest call not answered yet, by name if given.
        call = next((c for c in pending if c.name == name), None) if name else pending[0]
    if call is not None:
        pending.remove(call)
    return Message(
        "tool",
        text,
        tool_call_id=tid or (call.id if call is not None else None),
        name=name or (call.name if call is not None else None),
    )


def _map_tools(raw: Any) -> list[Tool]:
    tools: list[Tool] = []
    for param, t in each_object(raw, "tools"):
        if t.get("type", "function") != "function":
            continue
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise fail(f"{param}.function", "must be an object")
        tools.append(
            function_tool(
                fn.get("name"), fn.get("description"), fn.get("parameters"), f"{param}.function"
            )
        )
    return tools
