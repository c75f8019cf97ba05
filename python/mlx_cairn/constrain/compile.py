"""The grammar a request asks for: forced tool calls, strict tools, structured outputs.

Compiled once on the caller's thread while the engine prepares a request
(``mlx_cairn.engine.prepare``), so a schema that does not compile is a 400
before any model work, and the engine thread only steps the matcher.

Example::

    grammar = compile_grammar(loaded, request) if constrained(request) else None
"""

from __future__ import annotations

from typing import Any

from mlx_cairn.constrain import grammar as constrain
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.types import ChatRequest


def forced_tools(request: ChatRequest) -> list[Any] | None:
    """The tools one of which must be called, or None when no call is forced."""
    choice = request.tool_choice
    if not request.offers_tools or choice in (None, "auto"):
        return None
    if choice == "required":
        return list(request.tools)
    if isinstance(choice, dict):
        named = [t for t in request.tools if t.name == choice.get("name")]
        if not named:
            raise InvalidRequest(
                f"tool_choice names {choice.get('name')!r}, which is not among the tools",
                param="tool_choice",
            )
        return named
    return None


def constrained(request: ChatRequest) -> bool:
    strict = request.offers_tools and any(t.strict for t in request.tools)
    return strict or request.output_format is not None or forced_tools(request) is not None


def compile_grammar(loaded: Any, request: ChatRequest) -> Any:
    """The request's grammar, compiled (InvalidRequest naming what does not compile).

    A forced tool call follows the family's tool-call syntax; a structured
    output follows its schema; with tools offered as well (``auto``), either;
    ``auto`` with strict tools leaves text free and constrains calls once one
    opens. Families without a written grammar get no constraint on their calls.
    """
    vocab = constrain.vocabulary(loaded)
    family = loaded.parser_family
    forced = forced_tools(request)
    fmt = request.output_format
    specials = loaded.tokenizer.special_tokens
    # A named choice is one call of that tool, whatever parallel_tool_calls says:
    # the turn ends after it (a second call of a tool the client asked for once
    # is a loop, and agent frameworks would run it twice).
    parallel = request.parallel_tool_calls and not isinstance(request.tool_choice, dict)
    param = "tools" if forced is not None else fmt.param if fmt is not None else "tools"
    try:
        tools_text = None
        if forced is not None or (fmt is not None and request.offers_tools):
            tools_text = constrain.tool_grammar(
                family,
                forced if forced is not None else list(request.tools),
                parallel=parallel,
                specials=specials,
            )
        if fmt is not None:
            constrain.check_schema(constrain.output_schema(fmt))
        if forced is not None:
            if tools_text is None:
                return None
            return vocab.compile_lark(tools_text)
        if fmt is None:  # auto with strict tools: constrained once a call opens
            lazy = constrain.strict_tools_grammar(
                family,
                list(request.tools),
                parallel=parallel,
                specials=specials,
                eos=loaded.eos_token_ids,
            )
            return vocab.compile_lark(lazy) if lazy is not None else None
        schema = constrain.styled(constrain.output_schema(fmt), strict=fmt.strict)
        if tools_text is None:
            return vocab.compile_json_schema(schema)
        return vocab.compile_lark(constrain.either(tools_text, schema))
    except ValueError as e:
        raise InvalidRequest(
            f"the schema cannot be used for constrained decoding: {e}", param=param
        ) from e
