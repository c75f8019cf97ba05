"""OpenAI Responses request bodies -> ChatRequest.

Validated before any model work; each failure is a 400 naming the field;
unknown fields are ignored. Mapping:

- ``input``: a string (one user message) or a list of items:
  messages (``role`` user / system / developer / assistant, ``content`` a
  string or parts: ``input_text``, ``output_text``, ``refusal``,
  ``input_image`` with ``image_url`` a ``data:`` (or allowed ``http(s)``) URL,
  decoded in user messages and function call outputs
  (:mod:`mlx_cairn.protocol.images`); files become a short placeholder),
  ``reasoning`` items, ``function_call`` and ``function_call_output``. Consecutive reasoning / assistant-message /
  function-call items form one assistant turn.
- ``instructions``: a system message in front of this request only (like
  OpenAI, instructions of a previous response are not carried over).
- ``previous_response_id``: the stored conversation of that response (its
  input and output) is put before ``input``; see
  :mod:`mlx_cairn.api.openai_responses` for the store and its limits.
- ``tools``: function tools (other tool types are skipped); ``tool_choice``
  auto / none / required / ``{"type": "function", "name": ...}``.
- ``max_output_tokens`` (absent: up to the end of the context),
  ``temperature`` (0..2), ``top_p``, ``top_logprobs`` (0..20; logprobs are
  reported only when ``include`` lists ``message.output_text.logprobs``, as
  OpenAI does), the extra sampling fields of
  :mod:`mlx_cairn.protocol.sampling` (``top_k``, ``min_p``, ``seed``,
  penalties, ``logit_bias``), ``reasoning.effort``, ``store``
  (default true), ``stream``, ``metadata`` (echoed), ``cache_salt`` (as in
  vLLM: different salts share no cached prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_cairn.errors import CairnError, InvalidRequest
from mlx_cairn.protocol.codec import required_model
from mlx_cairn.protocol.images import ImageReader, strip_marks
from mlx_cairn.protocol.openai_common import (
    chat_request,
    content_text,
    fail,
    function_tool,
    json_object,
    metadata_map,
    opt_bool,
    opt_max_tokens,
    output_format,
    short,
    tool_choice,
)
from mlx_cairn.protocol.sampling import read_sampling, top_logprobs
from mlx_cairn.types import ChatRequest, Image, Message, Tool, ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")
#: The ``include`` value that turns logprobs on; other values are accepted and
#: ignored (they name server-side tools' outputs a local model does not have).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponseNotFound(CairnError):
    """An unknown or expired ``previous_response_id`` (404)."""

    kind = "not_found"


#: previous_response_id -> that response's whole conversation (input + output).
Lookup = Callable[[str], list[Message]]


@dataclass(slots=True)
class ResponsesRequest:
    """A validated Responses request."""

    chat: ChatRequest
    model: str
    #: The conversation to store with the result: previous + input, no instructions.
    history: list[Message]
    stream: bool = False
    store: bool = True
    open_ended: bool = False
    #: Request settings echoed in every response object.
    echo: dict[str, Any] = field(default_factory=dict)
    prompt_param: str = "input"
    max_tokens_param: str = "max_output_tokens"


def parse_responses_request(
    body: Any, *, max_tokens_limit: int, lookup: Lookup, images: ImageReader | None = None
) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body and map it to a ChatRequest.

    ``images`` reads the request's ``input_image`` parts under the server's limits.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    body = strip_marks(body)
    model = required_model(body)
    if "input" not in body:
        raise fail("input", "field required")
    new = parse_input(body["input"], images=images or ImageReader())

    prev_id = body.get("previous_response_id")
    history: list[Message] = []
    if prev_id is not None:
        if not isinstance(prev_id, str) or not prev_id:
            raise fail("previous_response_id", "must be a non-empty string")
        history = list(lookup(prev_id))
    history += new
    if not history:
        raise fail("input", "must not be empty")

    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise fail("instructions", "must be a string")
    messages = ([Message("system", instructions)] if instructions else []) + history

    mt = opt_max_tokens(body, "max_output_tokens", max_tokens_limit)
    sampling = read_sampling(body, max_temperature=2.0)
    sampling.logprobs = LOGPROBS_INCLUDE in _include(body.get("include"))
    k = top_logprobs(body)
    if k is not None and sampling.logprobs:
        sampling.top_logprobs = k

    tools, tools_echo = _map_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools, nested=False)
    reasoning_cfg = body.get("reasoning")
    if reasoning_cfg is not None and not isinstance(reasoning_cfg, dict):
        raise fail("reasoning", "must be an object")
    effort = (reasoning_cfg or {}).get("effort")
    text_cfg = body.get("text") or {}
    if not isinstance(text_cfg, dict):
        raise fail("text", "must be an object")
    metadata = metadata_map(body.get("metadata"))
    store = opt_bool(body, "store", True)

    chat = chat_request(
        body,
        messages=messages,
        model=model,
        max_tokens=mt if mt is not None else max_tokens_limit,
        sampling=sampling,
        tools=tools,
        choice=choice,
        effort=effort,
        effort_param="reasoning.effort",
        output=output_format(text_cfg.get("format"), "text.format", nested=False),
    )
    raw_choice = body.get("tool_choice")
    echo = {
        "instructions": instructions,
        "max_output_tokens": mt,
        "metadata": metadata or {},
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": prev_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": store,
        "temperature": sampling.temperature,
        "text": {"format": text_cfg.get("format") or {"type": "text"}},
        "tool_choice": raw_choice if raw_choice is not None else "auto",
        "tools": tools_echo,
        "top_logprobs": k if k is not None else 0,
        "top_p": sampling.top_p,
        "truncation": "disabled",
    }
    return ResponsesRequest(
        chat, model, history, opt_bool(body, "stream", False), store, mt is None, echo
    )


def _include(raw: Any) -> list[str]:
    """``include``: a list of strings."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise fail("include", "must be a list of strings")
    for i, v in enumerate(raw):
        if not isinstance(v, str):
            raise fail(f"include[{i}]", "must be a string")
    return raw


def _map_tools(raw: Any) -> tuple[list[Tool], list[dict[str, Any]]]:
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise fail("tools", "must be a list")
    tools: list[Tool] = []
    echo: list[dict[str, Any]] = []
    for i, t in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise fail(param, "must be an object")
        if t.get("type") != "function":
            continue  # web search, file search, ...: nothing a local model can run
        tool = function_tool(
            t.get("name"), t.get("description"), t.get("parameters"), param, t.get("strict")
        )
        tools.append(tool)
        echo.append(
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description or None,
                "parameters": tool.parameters,
                "strict": t.get("strict") if isinstance(t.get("strict"), bool) else None,
            }
        )
    return tools, echo


# -------------------------------------------------------------------- input


def parse_input(
    raw: Any, param: str = "input", *, images: ImageReader | None = None
) -> list[Message]:
    """``input`` (a string or items) -> messages. Also maps stored output items.

    With ``images``, ``input_image`` parts of user messages and of function
    call outputs are decoded (else they become a placeholder).
    """
    if isinstance(raw, str):
        return [Message("user", raw)]
    if not isinstance(raw, list):
        raise fail(param, "must be a string or a list of items")
    out: list[Message] = []
    turn: Message | None = None  # the assistant turn being assembled
    names: dict[str, str] = {}  # call_id -> function name
    for i, item in enumerate(raw):
        ip = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise fail(ip, "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            raw_role = item.get("role")
            role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
            if role is None:
                raise fail(f"{ip}.role", f"unknown role {short(item.get('role'))}")
            pics: list[Image] = []
            reader = images if role == "user" else None
            text = content_text(item.get("content"), f"{ip}.content", _TEXT_PARTS, pics, reader)
            if role == "assistant":
                if turn is None or turn.tool_calls:
                    turn = Message("assistant")
                    out.append(turn)
                turn.content += text
            else:
                turn = None
                out.append(Message(role, text, images=pics))  # type: ignore[arg-type]
        elif kind == "reasoning":
            if turn is None or turn.content or turn.tool_calls:
                turn = Message("assistant")
                out.append(turn)
            text = _reasoning_text(item, ip)
            turn.reasoning = (turn.reasoning or "") + text
        elif kind == "function_call":
            call = _function_call(item, ip)
            names[call.id] = call.name
            if turn is None:
                turn = Message("assistant")
                out.append(turn)
            turn.tool_calls.append(call)
        elif kind == "function_call_output":
            turn = None
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise fail(f"{ip}.call_id", "must be a non-empty string")
            pics = []
            text = content_text(item.get("output"), f"{ip}.output", _TEXT_PARTS, pics, images)
            out.append(Message("tool", text, tool_call_id=cid, name=names.get(cid), images=pics))
        else:
            raise fail(f"{ip}.type", f"unsupported input item type {short(kind)}")
    for m in out:
        if m.role == "assistant" and m.reasoning == "":
            m.reasoning = None
    return out


def _reasoning_text(item: dict[str, Any], ip: str) -> str:
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise fail(f"{ip}.content", "must be a list")
    texts: list[str] = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or not isinstance(p.get("text"), str):
            raise fail(f"{ip}.content[{j}].text", "must be a string")
        texts.append(p["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], ip: str) -> ToolCall:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(cid, str) or not cid:
        raise fail(f"{ip}.call_id", "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise fail(f"{ip}.name", "must be a non-empty string")
    if not isinstance(args, str) or not json_object(args or "{}"):
        raise fail(f"{ip}.arguments", "must be the JSON text of an object")
    return ToolCall(cid, name, args or "{}")
