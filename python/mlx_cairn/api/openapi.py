"""Request-body schemas in the server's OpenAPI document (``GET /openapi.json``).

The dialect routes read raw JSON (validation lives in ``protocol/``, so each
error names its field in the dialect's words), which leaves FastAPI nothing to
describe. :func:`install` adds a JSON Schema for each generation route's body
to the generated document, so client generators and API fuzzers
(schemathesis, see tests/test_schemathesis.py) know what the routes take.

The schemas describe the accepted shape loosely (unknown fields are allowed,
as in the real APIs); the mappers stay the authority on what is valid.
"""

from __future__ import annotations

import copy
from typing import Any


def _body(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """A request body: a JSON object with these required fields and properties."""
    return {"type": "object", "required": required, "properties": properties}


def _messages(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """A non-empty list of message objects."""
    return {"type": "array", "minItems": 1, "items": _body(required, properties)}


_STR = {"type": "string"}
_NAME = {"type": "string", "minLength": 1}
_INT = {"type": "integer"}
_TOP_P = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_BOOL = {"type": "boolean"}
_OBJ = {"type": "object"}
_POS_INT = {"type": "integer", "minimum": 1}
_NONNEG_INT = {"type": "integer", "minimum": 0}
_TEMPERATURE = {"type": "number", "minimum": 0, "maximum": 2}
_TOP_LOGPROBS = {"type": "integer", "minimum": 0, "maximum": 20}
_STREAM_OPTIONS = {"type": "object", "properties": {"include_usage": _BOOL}}
_OPENAI_TOOL_CHOICE = {"anyOf": [{"enum": ["auto", "none", "required"]}, _OBJ]}
_KEEP_ALIVE = {"anyOf": [{"type": "number"}, _STR]}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _NONNEG_INT}
_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _STR},
}
_CONTENT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {
            "type": "string",
            "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"],
        },
        "text": _STR,
        "id": _STR,
        "name": _STR,
        "input": _OBJ,
        "tool_use_id": _STR,
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_BLOCK}]},
        "is_error": _BOOL,
        "thinking": _STR,
    },
}
_ANTHROPIC_COMMON: dict[str, Any] = {
    "model": _NAME,
    "messages": _messages(
        ["role", "content"],
        {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"anyOf": [_STR, {"type": "array", "items": _CONTENT_BLOCK}]},
        },
    ),
    "system": {"anyOf": [_STR, {"type": "array", "items": _TEXT_BLOCK}]},
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "input_schema"],
            "properties": {"name": _STR, "description": _STR, "input_schema": _OBJ},
        },
    },
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR},
    },
    "thinking": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": _INT,
        },
    },
}
#: Logits-processor and sampling fields every dialect reads (Anthropic as extra fields).
_SAMPLING_EXTRAS: dict[str, Any] = {
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
}
_JSON_SCHEMA_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "schema": _OBJ},
}
MESSAGES_BODY = _body(
    ["model", "max_tokens", "messages"],
    {
        **_ANTHROPIC_COMMON,
        "max_tokens": _POS_INT,
        "stream": _BOOL,
        "stop_sequences": {"type": "array", "items": _STR},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": _TOP_P,
        "top_k": _NONNEG_INT,
        "seed": _INT,
        **_SAMPLING_EXTRAS,
        "metadata": _OBJ,
    },
)
COUNT_TOKENS_BODY = _body(["model", "messages"], dict(_ANTHROPIC_COMMON))
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "description": _STR, "parameters": _OBJ},
}
CHAT_BODY = _body(
    ["model", "messages"],
    {
        "model": _NAME,
        "messages": _messages(
            ["role"],
            {
                "role": {
                    "type": "string",
                    "enum": ["system", "developer", "user", "assistant", "tool"],
                },
                "content": {
                    "anyOf": [
                        _STR,
                        {"type": "null"},
                        {
                            "type": "array",
                            "items": _TEXT_BLOCK,
                        },
                    ]
                },
                "name": _NAME,
                "tool_call_id": _NAME,
                "tool_calls": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "type", "function"],
                        "properties": {
                            "id": _NAME,
                            "type": {"const": "function"},
                            "function": {
                                "type": "object",
                                "required": ["name", "arguments"],
                                "properties": {"name": _NAME, "arguments": _STR},
                            },
                        },
                    },
                },
            },
        ),
        "max_tokens": _POS_INT,
        "max_completion_tokens": _POS_INT,
        "stream": _BOOL,
        "stream_options": _STREAM_OPTIONS,
        "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        "temperature": _TEMPERATURE,
        "top_p": _TOP_P,
        "seed": _INT,
        "n": {"type": "integer", "enum": [1], "description": "only 1 is supported"},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION},
            },
        },
        "tool_choice": _OPENAI_TOOL_CHOICE,
        "parallel_tool_calls": _BOOL,
        "reasoning_effort": _STR,
        "top_k": _NONNEG_INT,
        **_SAMPLING_EXTRAS,
        "logprobs": _BOOL,
        "top_logprobs": _TOP_LOGPROBS,
        "response_format": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {"name": _STR, "schema": _OBJ, "strict": _BOOL},
                },
            },
        },
    },
)
COMPLETIONS_BODY = _body(
    ["model", "prompt"],
    {
        "model": _NAME,
        "prompt": {
            "anyOf": [
                _NAME,
                {"type": "array", "minItems": 1, "items": _NAME},
                _TOKEN_IDS,
                {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
            ]
        },
        "suffix": _STR,
        "max_tokens": _POS_INT,
        "temperature": _TEMPERATURE,
        "top_p": _TOP_P,
        "top_k": _NONNEG_INT,
        "n": {"type": "integer", "minimum": 1, "maximum": 64},
        "stop": {"anyOf": [_NAME, {"type": "array", "items": _NAME}]},
        "seed": _INT,
        "logprobs": _TOP_LOGPROBS,
        "echo": _BOOL,
        "stream": _BOOL,
        "stream_options": _STREAM_OPTIONS,
        **_SAMPLING_EXTRAS,
    },
)
INFILL_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": _NAME,
        "input_prefix": _STR,
        "input_suffix": _STR,
        "prompt": _STR,
        "input_extra": {
            "type": "array",
            "items": {"type": "object", "properties": {"filename": _STR, "text": _STR}},
        },
        "n_predict": _POS_INT,
        "temperature": {"type": "number", "minimum": 0},
        "top_k": _NONNEG_INT,
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": _INT,
        "stop": {"type": "array", "items": _NAME},
        "stream": _BOOL,
    },
}
RESPONSES_BODY = _body(
    ["model", "input"],
    {
        "model": _NAME,
        "input": {
            "anyOf": [
                _STR,
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"enum": ["message", "function_call", "function_call_output"]},
                            "role": {"enum": ["system", "developer", "user", "assistant"]},
                            "content": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]},
                            "call_id": _STR,
                            "name": _STR,
                            "arguments": _STR,
                            "output": _STR,
                        },
                    },
                },
            ]
        },
        "instructions": _STR,
        "max_output_tokens": _POS_INT,
        "temperature": _TEMPERATURE,
        "top_p": _TOP_P,
        "stream": _BOOL,
        "store": _BOOL,
        "previous_response_id": _STR,
        "metadata": {"type": "object", "additionalProperties": _STR},
        "top_logprobs": _TOP_LOGPROBS,
        "include": {"type": "array", "items": _STR},
        "text": {"type": "object", "properties": {"format": _JSON_SCHEMA_FORMAT}},
        "tool_choice": _OPENAI_TOOL_CHOICE,
        "parallel_tool_calls": _BOOL,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": _STR,
                    "description": _STR,
                    "parameters": _OBJ,
                },
            },
        },
    },
)

_OLLAMA_COMMON: dict[str, Any] = {
    "model": _NAME,
    "stream": _BOOL,
    "format": {"anyOf": [{"enum": ["", "json"]}, _OBJ]},
    "think": {"anyOf": [_BOOL, {"enum": ["low", "medium", "high"]}]},
    "keep_alive": _KEEP_ALIVE,
    "logprobs": _BOOL,
    "top_logprobs": _TOP_LOGPROBS,
    "options": {
        "type": "object",
        "properties": {
            "temperature": _TEMPERATURE,
            "top_p": _TOP_P,
            "top_k": _NONNEG_INT,
            "seed": _INT,
            "num_predict": {"type": "integer", "minimum": -2},
            "num_ctx": _POS_INT,
            "stop": {"type": "array", "items": _NAME},
            "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        },
    },
}
OLLAMA_CHAT_BODY = _body(
    ["model", "messages"],
    {
        **_OLLAMA_COMMON,
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "tool"]},
                    "content": _STR,
                    "thinking": _STR,
                    "tool_name": _STR,
                    "tool_calls": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["function"],
                            "properties": {
                                "function": {
                                    "type": "object",
                                    "required": ["name", "arguments"],
                                    "properties": {"name": _NAME, "arguments": _OBJ},
                                }
                            },
                        },
                    },
                },
            },
        },
        "tools": CHAT_BODY["properties"]["tools"],
    },
)
OLLAMA_GENERATE_BODY = _body(
    ["model"],
    {
        **_OLLAMA_COMMON,
        "prompt": _STR,
        "system": _STR,
        "suffix": _STR,
        "raw": _BOOL,
        "context": {"type": "array", "items": _INT},
    },
)

EMBEDDINGS_BODY = _body(
    ["model", "input"],
    {
        "model": _NAME,
        "input": {
            "anyOf": [
                _NAME,
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _NAME},
                _TOKEN_IDS,
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_IDS},
            ]
        },
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": _POS_INT,
        "user": _STR,
    },
)
_OLLAMA_EMBED_COMMON: dict[str, Any] = {
    "model": _NAME,
    "options": _OBJ,
    "keep_alive": _KEEP_ALIVE,
}
OLLAMA_EMBED_BODY = _body(
    ["model"],
    {
        **_OLLAMA_EMBED_COMMON,
        "input": {"anyOf": [_STR, {"type": "array", "maxItems": 2048, "items": _NAME}]},
        "truncate": _BOOL,
        "dimensions": _POS_INT,
    },
)
OLLAMA_EMBEDDINGS_BODY = _body(["model"], {**_OLLAMA_EMBED_COMMON, "prompt": _STR})

#: (path, method) -> request-body schema.
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/messages", "post"): MESSAGES_BODY,
    ("/v1/messages/count_tokens", "post"): COUNT_TOKENS_BODY,
    ("/v1/chat/completions", "post"): CHAT_BODY,
    ("/v1/completions", "post"): COMPLETIONS_BODY,
    # The render routes (vLLM's, for routers) take the generation route's body.
    ("/v1/messages/render", "post"): MESSAGES_BODY,
    ("/v1/chat/completions/render", "post"): CHAT_BODY,
    ("/v1/completions/render", "post"): COMPLETIONS_BODY,
    ("/infill", "post"): INFILL_BODY,
    ("/v1/responses", "post"): RESPONSES_BODY,
    ("/v1/embeddings", "post"): EMBEDDINGS_BODY,
    ("/api/embed", "post"): OLLAMA_EMBED_BODY,
    ("/api/embeddings", "post"): OLLAMA_EMBEDDINGS_BODY,
    ("/api/chat", "post"): OLLAMA_CHAT_BODY,
    ("/api/generate", "post"): OLLAMA_GENERATE_BODY,
    ("/api/show", "post"): {
        "type": "object",
        "required": ["model"],
        "properties": {"model": _NAME},
    },
}


def install(app: Any) -> None:
    """Make ``app.openapi()`` describe the request body of every generation route.

    The token caps carry the server's ``max_tokens_limit`` and the model
    names its served models as examples.
    """
    base = app.openapi
    state = app.state.cairn
    limit = state.config.max_tokens_limit
    names = state.registry.names()

    def openapi() -> dict[str, Any]:
        doc: dict[str, Any] = base()  # FastAPI builds it once and caches it
        for (path, method), schema in BODIES.items():
            op = doc.get("paths", {}).get(path, {}).get(method)
            if op is None or "requestBody" in op:
                continue
            body = copy.deepcopy(schema)
            props = body["properties"]
            props["model"] = {**props["model"], "examples": names}
            for cap in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if cap in props:
                    props[cap] = {**props[cap], "maximum": limit}
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        return doc

    app.openapi = openapi
