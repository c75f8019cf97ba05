"""Anthropic Messages request bodies -> :class:`~mlx_cairn.types.ChatRequest`.

Validation happens here, before any model work: every failure is an
:class:`~mlx_cairn.errors.InvalidRequest` whose message starts with the
offending field (``messages[2].content[0].tool_use_id: ...``). Unknown
top-level fields are ignored (Claude Code sends ``metadata``,
``context_management``, ``output_config``, ...).

Mapping rules:

- ``system``: a string or text blocks; the first block that starts with
  ``x-anthropic-billing-header:`` is dropped (its nonce rotates per request
  and would defeat prefix reuse); the rest are joined with newlines.
- user content: text blocks join into one user message; ``tool_result``
  blocks become ``tool`` messages, placed first and reordered to follow the
  order of the preceding assistant turn's ``tool_use`` blocks.
- assistant content: text, ``thinking`` (kept as the message's reasoning)
  and ``tool_use`` blocks (kept as tool calls, arguments as JSON text).
- images (``source`` ``base64`` or ``url``) in user turns and inside
  ``tool_result`` content (Claude Code's Read tool) are decoded here
  (:mod:`mlx_cairn.protocol.images`): each becomes an entry of the message's
  ``images`` and an ``IMAGE_MARK`` at its place in the text. Documents (and
  images in assistant turns) become a short placeholder.
- ``context_management``: a ``clear_thinking_20251015`` edit with ``keep:
  "all"`` (Claude Code sends it) keeps earlier turns as they were generated,
  reasoning included, where the chat template would drop it
  (``ChatRequest.history_as_generated``): a later turn, or a resumed
  session, then reads the whole previous turn from the prefix cache. Other
  edits are ignored.
- sampling: ``temperature`` (0..1), ``top_p``, ``top_k``, and as top-level
  extra fields (an SDK's ``extra_body``) ``min_p``, ``seed``,
  ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty`` and
  ``logit_bias``, with the OpenAI dialects' rules
  (:mod:`mlx_cairn.protocol.sampling`). The Messages API has no logprobs.
- ``cache_salt`` (an extra field, as in the OpenAI dialects and vLLM):
  requests with different salts share no cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.codec import (
    MEDIA_PLACEHOLDER,
    cache_salt,
    each_object,
    fail,
    is_int,
    nonempty_list,
    required_model,
    short,
    speculative_switch,
)
from mlx_cairn.protocol.images import ImageReader, strip_marks
from mlx_cairn.protocol.sampling import read_sampling
from mlx_cairn.types import (
    IMAGE_MARK,
    MAX_STOP_SEQUENCE_CHARS,
    MAX_STOP_SEQUENCES,
    ChatRequest,
    Image,
    Message,
    OutputFormat,
    Tool,
    ToolCall,
)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
#: Token cap for Claude Code's session-title requests.
TITLE_MAX_TOKENS = 48


@dataclass(slots=True)
class AnthropicRequest:
    """A validated Messages request: the neutral request plus dialect options."""

    chat: ChatRequest
    #: The model name as the client sent it.
    model: str
    stream: bool = False
    #: Whether reasoning text is shown as thinking blocks (``thinking`` enabled).
    show_thinking: bool = False
    #: A Claude Code session-title request (small cap, reasoning off).
    is_title: bool = False
    #: Always False: ``max_tokens`` is required in this dialect.
    open_ended: bool = False
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"


def parse_messages_request(
    body: Any, *, max_tokens_limit: int, images: ImageReader | None = None
) -> AnthropicRequest:
    """Validate a ``POST /v1/messages`` body and map it to a ChatRequest.

    ``images`` reads the request's images under the server's limits (default:
    :class:`ImageLimits` defaults, no URL fetching).
    """
    return _parse(body, max_tokens_limit=max_tokens_limit, count_only=False, images=images)


def parse_count_tokens_request(body: Any, *, images: ImageReader | None = None) -> AnthropicRequest:
    """Validate a ``POST /v1/messages/count_tokens`` body (no ``max_tokens`` needed)."""
    return _parse(body, max_tokens_limit=0, count_only=True, images=images)


def _parse(
    body: Any, *, max_tokens_limit: int, count_only: bool, images: ImageReader | None
) -> AnthropicRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    body = strip_marks(body)
    model = required_model(body)

    max_tokens = 1
    if not count_only:
        if "max_tokens" not in body:
            raise fail("max_tokens", "field required")
        max_tokens = body["max_tokens"]
        if not is_int(max_tokens):
            raise fail("max_tokens", "must be an integer")
        if max_tokens < 1:
            raise fail("max_tokens", "must be at least 1")
        if max_tokens > max_tokens_limit:
            raise fail("max_tokens", f"must be at most {max_tokens_limit} on this server")

    if "messages" not in body:
        raise fail("messages", "field required")
    messages = _map_messages(body["messages"], images or ImageReader())
    system = _map_system(body.get("system"))
    if system:
        messages.insert(0, Message("system", system))

    tools = _map_tools(body.get("tools"))
    tool_choice = _map_tool_choice(body.get("tool_choice"))
    parallel = _parallel_tool_use(body.get("tool_choice"))
    output = _map_output_format(body.get("output_config"))
    reasoning, show_thinking, budget = _map_thinking(
        body.get("thinking"), body.get("output_config")
    )
    # temperature 0..1, top_p, top_k; and through extra_body the fields the
    # Messages API lacks (min_p, seed, penalties, logit_bias): one rule each.
    sampling = read_sampling(body, max_temperature=1.0)
    stop = _map_stop(body.get("stop_sequences"))

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise fail("stream", "must be a boolean")

    is_title = _is_title_request(body.get("output_config"))
    if is_title:
        max_tokens = min(max_tokens, TITLE_MAX_TOKENS)
        reasoning, show_thinking, budget = False, False, None

    chat = ChatRequest(
        messages=messages,
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        tools=tools,
        tool_choice=tool_choice if tools else None,
        reasoning=reasoning,
        reasoning_budget=budget,
        parallel_tool_calls=parallel,
        output_format=output,
        cache_salt=cache_salt(body),
        speculative=speculative_switch(body),
        history_as_generated=_keeps_all_thinking(body.get("context_management")),
    )
    return AnthropicRequest(chat, model, stream, show_thinking, is_title)


# ------------------------------------------------------------------- system


def _map_system(system: Any) -> str:
    if system is None:
        return ""
    return _system_text(system, "system", drop_billing=True)


def _system_text(system: Any, param: str, *, drop_billing: bool = False) -> str:
    """A system prompt given as a string or as text blocks, joined with newlines.

    With ``drop_billing`` the first block that starts with Claude Code's
    billing header is left out (its nonce rotates per request).
    """
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise fail(param, "must be a string or a list of text blocks")
    texts: list[str] = []
    for i, block in enumerate(system):
        bp = f"{param}[{i}]"
        if not isinstance(block, dict):
            raise fail(bp, "must be an object")
        if block.get("type") != "text":
            raise fail(f"{bp}.type", "system blocks must be of type 'text'")
        text = _text_of(block, bp)
        if drop_billing and text.startswith(BILLING_HEADER_PREFIX):
            drop_billing = False  # rotating nonce: keep it out of the prompt
            continue
        texts.append(text)
    return "\n".join(texts)


# ----------------------------------------------------------------- messages


def _map_messages(raw: Any, reader: ImageReader) -> list[Message]:
    raw = nonempty_list(raw, "messages")
    out: list[Message] = []
    tool_order: dict[str, int] = {}  # tool_use id -> position in the last assistant turn
    tool_names: dict[str, str] = {}
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise fail(param, "must be an object")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise fail(
                f"{param}.role", f"must be 'user', 'assistant' or 'system', got {short(role)}"
            )
        if "content" not in m:
            raise fail(f"{param}.content", "field required")
        content = m["content"]
        if role == "system":
            # Kept at its place: hoisting it would shift every later token and
            # defeat prefix reuse from one turn to the next.
            out.append(Message("system", _system_text(content, f"{param}.content")))
            continue
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise fail(f"{param}.content", "must be a string or a list of content blocks")
        if role == "assistant":
            msg = _map_assistant(content, param)
            tool_order = {tc.id: k for k, tc in enumerate(msg.tool_calls)}
            tool_names.update({tc.id: tc.name for tc in msg.tool_calls})
            out.append(msg)
        else:
            out.extend(_map_user(content, param, tool_order, tool_names, reader))
    return out


def _block(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise fail(param, "content block must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise fail(f"{param}.type", "field required")
    return kind


def _text_of(block: dict[str, Any], param: str, key: str = "text") -> str:
    """The string field ``key`` of a content block."""
    text = block.get(key)
    if not isinstance(text, str):
        raise fail(f"{param}.{key}", "must be a string")
    return text


def _map_assistant(content: list[Any], param: str) -> Message:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        bp = f"{param}.content[{j}]"
        kind = _block(block, bp)
        if kind == "text":
            texts.append(_text_of(block, bp))
        elif kind == "thinking":
            reasoning.append(_text_of(block, bp, "thinking"))
        elif kind == "tool_use":
            calls.append(_map_tool_use(block, bp))
        elif text := _other_block(kind, block, bp):
            texts.append(text)
    return Message(
        "assistant",
        "".join(texts),
        reasoning="\n".join(reasoning) if reasoning else None,
        tool_calls=calls,
    )


#: Blocks of server-side tools (web search, code execution, MCP connectors, ...)
#: and redacted thinking: nothing a local model ran or can read; left out.
SERVER_BLOCKS = frozenset(
    {
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
    }
)


def _other_block(kind: str, block: dict[str, Any], bp: str) -> str:
    """The prompt text of a block that is neither text nor a tool call or result.

    Documents (and images where none are read: assistant turns) become a placeholder, a ``search_result`` its title
    and text, a ``tool_reference`` (tool search) the tool's name; server-side
    blocks give "" (left out). Any other type is a 400.
    """
    if kind in ("image", "document"):
        return MEDIA_PLACEHOLDER.format(kind=kind)
    if kind in SERVER_BLOCKS:
        return ""
    if kind == "search_result":
        parts = [block.get("title"), block.get("source")]
        content = block.get("content")
        if isinstance(content, list):
            parts += [c.get("text") for c in content if isinstance(c, dict)]
        return "\n".join(p for p in parts if isinstance(p, str) and p)
    if kind == "tool_reference":
        name = block.get("tool_name")
        return f"[tool available: {name}]" if isinstance(name, str) and name else ""
    raise fail(f"{bp}.type", f"unsupported content block type {short(kind)}")


def _map_tool_use(block: dict[str, Any], bp: str) -> ToolCall:
    tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(tid, str) or not tid:
        raise fail(f"{bp}.id", "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise fail(f"{bp}.name", "must be a non-empty string")
    if not isinstance(args, dict):
        raise fail(f"{bp}.input", "must be an object")
    try:
        arguments = orjson.dumps(args).decode()
    except TypeError:  # nested deeper than orjson writes
        raise fail(f"{bp}.input", "is nested too deeply") from None
    return ToolCall(tid, name, arguments)


def _map_user(
    content: list[Any],
    param: str,
    tool_order: dict[str, int],
    tool_names: dict[str, str],
    reader: ImageReader,
) -> list[Message]:
    texts: list[str] = []
    images: list[Image] = []
    results: list[tuple[int, int, Message]] = []
    for j, block in enumerate(content):
        bp = f"{param}.content[{j}]"
        kind = _block(block, bp)
        if kind == "text":
            texts.append(_text_of(block, bp))
        elif kind == "tool_result":
            msg = _map_tool_result(block, bp, tool_names, reader)
            # Stable sort key: the assistant's tool_use order, unknown ids last.
            results.append((tool_order.get(msg.tool_call_id or "", len(tool_order)), j, msg))
        elif kind == "image":
            images.append(_image(block, bp, reader))
            texts.append(IMAGE_MARK)
        elif text := _other_block(kind, block, bp):
            texts.append(text)
    out = [m for _, _, m in sorted(results, key=lambda r: (r[0], r[1]))]
    if texts or not results:
        out.append(Message("user", "\n".join(texts), images=images))
    return out


def _image(block: dict[str, Any], bp: str, reader: ImageReader) -> Image:
    """An ``image`` block: ``source`` ``{"type": "base64", "media_type", "data"}`` or
    ``{"type": "url", "url"}``."""
    source = block.get("source")
    sp = f"{bp}.source"
    if not isinstance(source, dict):
        raise fail(sp, "must be an object")
    kind = source.get("type")
    if kind == "base64":
        return reader.base64(source.get("data"), source.get("media_type"), sp)
    if kind == "url":
        return reader.url(source.get("url"), f"{sp}.url")
    raise fail(f"{sp}.type", f"must be 'base64' or 'url', got {short(kind)}")


def _map_tool_result(
    block: dict[str, Any], bp: str, tool_names: dict[str, str], reader: ImageReader
) -> Message:
    tid = block.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise fail(f"{bp}.tool_use_id", "must be a non-empty string")
    is_error = block.get("is_error", False)
    if is_error is None:
        is_error = False
    if not isinstance(is_error, bool):
        raise fail(f"{bp}.is_error", "must be a boolean")
    raw = block.get("content", "")
    images: list[Image] = []
    if raw is None:
        raw = ""
    if isinstance(raw, str):
        text = raw
    elif isinstance(raw, list):
        parts: list[str] = []
        for k, sub in enumerate(raw):
            sp = f"{bp}.content[{k}]"
            kind = _block(sub, sp)
            if kind == "text":
                parts.append(_text_of(sub, sp))
            elif kind == "image":  # Claude Code's Read tool on a picture
                images.append(_image(sub, sp, reader))
                parts.append(IMAGE_MARK)
            elif sub_text := _other_block(kind, sub, sp):
                parts.append(sub_text)
        text = "\n".join(parts)
    else:
        raise fail(f"{bp}.content", "must be a string or a list of content blocks")
    return Message(
        "tool", text, tool_call_id=tid, name=tool_names.get(tid), is_error=is_error, images=images
    )


# -------------------------------------------------------- tools and options


def _map_tools(raw: Any) -> list[Tool]:
    tools: list[Tool] = []
    for param, t in each_object(raw, "tools"):
        kind = t.get("type")
        if kind not in (None, "custom") and "input_schema" not in t:
            continue  # a server-side tool (web search, ...): nothing a local model can run
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{param}.name", "must be a non-empty string")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise fail(f"{param}.input_schema", "must be a JSON Schema object")
        desc = t.get("description", "")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise fail(f"{param}.description", "must be a string")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise fail(f"{param}.strict", "must be a boolean")
        tools.append(Tool(name, desc, schema, bool(strict)))
    return tools


def _map_tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail("tool_choice", "must be an object")
    kind = raw.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise fail("tool_choice.name", "must be a non-empty string")
        return {"name": name}
    raise fail("tool_choice.type", "must be one of 'auto', 'any', 'tool', 'none'")


def _parallel_tool_use(raw: Any) -> bool:
    """``tool_choice.disable_parallel_tool_use``: at most one call when true."""
    if not isinstance(raw, dict) or raw.get("disable_parallel_tool_use") is None:
        return True
    flag = raw["disable_parallel_tool_use"]
    if not isinstance(flag, bool):
        raise fail("tool_choice.disable_parallel_tool_use", "must be a boolean")
    return not flag


def _map_output_format(output_config: Any) -> OutputFormat | None:
    """``output_config.format``: ``{"type": "json_schema", "schema": {...}}`` (structured output)."""
    if not isinstance(output_config, dict) or output_config.get("format") is None:
        return None
    fmt = output_config["format"]
    if not isinstance(fmt, dict):
        raise fail("output_config.format", "must be an object")
    if fmt.get("type") != "json_schema":
        raise fail("output_config.format.type", "must be 'json_schema'")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise fail("output_config.format.schema", "must be a JSON Schema object")
    return OutputFormat(schema, param="output_config.format")


#: ``output_config.effort`` under adaptive thinking -> (reasoning on, token budget).
#: ``low`` answers without reasoning; ``max`` (and ``xhigh``) reason without a limit.
EFFORT_REASONING: dict[str, tuple[bool, int | None]] = {
    "low": (False, None),
    "medium": (True, 2048),
    "high": (True, 8192),
    "xhigh": (True, None),
    "max": (True, None),
}


def _map_thinking(raw: Any, output_config: Any) -> tuple[bool | None, bool, int | None]:
    """``thinking`` (+ ``output_config.effort``) -> (reasoning switch, show it, budget).

    - absent or ``disabled``: no reasoning (the Anthropic default);
    - ``enabled``: reasoning, shown as thinking blocks, ``budget_tokens``
      enforced by the engine (it closes the reasoning block after that many);
    - ``adaptive``: the effort level picks per :data:`EFFORT_REASONING`;
      without one (or an unknown one) the model's own default, unlimited.
      ``display: "omitted"`` keeps the reasoning out of the response.
    """
    effort = output_config.get("effort") if isinstance(output_config, dict) else None
    if effort is not None and not isinstance(effort, str):
        raise fail("output_config.effort", "must be a string")
    if raw is None:
        return False, False, None
    if not isinstance(raw, dict):
        raise fail("thinking", "must be an object")
    kind = raw.get("type")
    if kind == "disabled":
        return False, False, None
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if budget is not None and (not is_int(budget) or budget < 1):
            raise fail("thinking.budget_tokens", "must be a positive integer")
        return True, True, budget
    if kind == "adaptive":
        display = raw.get("display")
        if display is not None and not isinstance(display, str):
            raise fail("thinking.display", "must be a string")
        on, budget = EFFORT_REASONING.get(effort or "", (None, None))
        return on, on is not False and display != "omitted", budget
    raise fail("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")


def _keeps_all_thinking(context_management: Any) -> bool:
    """``context_management.edits`` holds ``{"type": "clear_thinking_20251015",
    "keep": "all"}``: every earlier turn keeps its thinking. Anything else,
    malformed included, is ignored (unknown fields are not rejected)."""
    edits = context_management.get("edits") if isinstance(context_management, dict) else None
    if not isinstance(edits, list):
        return False
    return any(
        isinstance(e, dict)
        and e.get("type") == "clear_thinking_20251015"
        and e.get("keep") == "all"
        for e in edits
    )


def _map_stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise fail("stop_sequences", "must be a list of strings")
    if len(raw) > MAX_STOP_SEQUENCES:
        raise fail("stop_sequences", f"at most {MAX_STOP_SEQUENCES} entries")
    for i, s in enumerate(raw):
        if not isinstance(s, str) or not s:
            raise fail(f"stop_sequences[{i}]", "must be a non-empty string")
        if len(s) > MAX_STOP_SEQUENCE_CHARS:
            raise fail(f"stop_sequences[{i}]", f"at most {MAX_STOP_SEQUENCE_CHARS} characters")
    return list(raw)


def _is_title_request(output_config: Any) -> bool:
    """Claude Code's session-title call: a json_schema output with a ``title`` property."""
    if not isinstance(output_config, dict):
        return False
    fmt = output_config.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return False
    schema = fmt.get("schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    return isinstance(props, dict) and "title" in props
