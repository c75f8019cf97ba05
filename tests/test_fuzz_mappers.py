"""Fuzz harness over the request mappers: arbitrary JSON in, a ChatRequest or a typed 400 out.

Every dialect mapper (protocol/: request body -> ChatRequest) is fed bodies as
they arrive off the wire (serialized, then parsed with orjson like
``api.state.read_json``): free-form JSON, and request-shaped JSON whose known
fields hold random values. A mapper may only return a well-formed request or
raise :class:`~mlx_cairn.errors.InvalidRequest`; every accepted request is
then prepared for a tiny model (template + tokenizer + context checks), which
may likewise only raise InvalidRequest. Any other exception is a 500 waiting
to happen.

The budget is the hypothesis profile (CAIRN_HYPOTHESIS_EXAMPLES); raise it for
a deeper run::

    CAIRN_HYPOTHESIS_EXAMPLES=5000 .venv/bin/python -m pytest tests/test_fuzz_mappers.py
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from mlx_cairn.engine.prepare import prepare
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message

LIMIT = 4096

#: (module, function, extra kwargs, chat attribute) of every dialect mapper.
MAPPERS: list[tuple[str, str, dict[str, Any]]] = [
    ("mlx_cairn.protocol.anthropic", "parse_messages_request", {"max_tokens_limit": LIMIT}),
    ("mlx_cairn.protocol.anthropic", "parse_count_tokens_request", {}),
    ("mlx_cairn.protocol.openai_chat", "parse_chat_request", {"max_tokens_limit": LIMIT}),
    ("mlx_cairn.protocol.ollama", "parse_chat_request", {"max_tokens_limit": LIMIT}),
    (
        "mlx_cairn.protocol.openai_completions",
        "parse_completion_request",
        {"max_tokens_limit": LIMIT},
    ),
    (
        "mlx_cairn.protocol.llama_infill",
        "parse_infill_request",
        {"max_tokens_limit": LIMIT, "default_model": "tiny"},
    ),
    (
        "mlx_cairn.protocol.openai_responses",
        "parse_responses_request",
        {"max_tokens_limit": LIMIT, "lookup": lambda rid: stored_history(rid)},
    ),
]


def stored_history(response_id: str) -> list[Message]:
    """The Responses store stand-in: one known id, every other one is a typed 404."""
    from mlx_cairn.protocol.openai_responses import ResponseNotFound

    if response_id == "resp_known":
        return [Message("user", "earlier"), Message("assistant", "reply")]
    raise ResponseNotFound(f"response {response_id!r} not found")


def typed_rejections() -> tuple[type[Exception], ...]:
    """The only exceptions a mapper may raise: a 400, or the Responses store's 404."""
    from mlx_cairn.protocol.openai_responses import ResponseNotFound

    return (InvalidRequest, ResponseNotFound)


def mapper(spec: tuple[str, str, dict[str, Any]]) -> Callable[[Any], Any]:
    mod, fn, kw = spec
    f = getattr(importlib.import_module(mod), fn)
    return lambda body: f(body, **kw)


def chat_of(result: Any) -> ChatRequest:
    """The ChatRequest inside a mapper's result (dialect wrappers keep it as ``.chat``)."""
    if isinstance(result, ChatRequest):
        return result
    chat = getattr(result, "chat", None)
    assert isinstance(chat, ChatRequest), f"mapper returned {type(result).__name__}"
    return chat


# ------------------------------------------------------------------ strategies

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["", "user", "assistant", "text", "tool_use", "x" * 300, "\x00", "\ud7ff"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=25,
)

ROLES = ["user", "assistant", "system", "developer", "tool", "function", "", "USER"]
BLOCK_TYPES = [
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "input_text",
    "output_text",
    "image_url",
    "refusal",
    "function_call",
    "function_call_output",
    "message",
    "reasoning",
    "bogus",
]
BLOCK_FIELDS = [
    "text",
    "id",
    "name",
    "input",
    "tool_use_id",
    "content",
    "is_error",
    "thinking",
    "arguments",
    "call_id",
    "output",
    "role",
    "image_url",
    "source",
    "summary",
]
TOP_FIELDS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "messages",
    "input",
    "instructions",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "stop_sequences",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "parallel_tool_calls",
    "include",
    "text",
    "n",
    "stream",
    "stream_options",
    "metadata",
    "output_config",
    "reasoning_effort",
    "reasoning",
    "previous_response_id",
    "store",
    "response_format",
    "parallel_tool_calls",
    "user",
    "options",
    "format",
    "think",
    "keep_alive",
    "prompt",
    "suffix",
    "echo",
    "best_of",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "n_predict",
]


def _pick(options: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(options, options, options, json_values)


blocks = st.builds(
    lambda kind, fields: {"type": kind, **fields},
    _pick(st.sampled_from(BLOCK_TYPES)),
    st.dictionaries(
        st.sampled_from(BLOCK_FIELDS),
        _pick(st.text(max_size=30) | st.dictionaries(st.text(max_size=5), scalars, max_size=3)),
        max_size=4,
    ),
)
content = _pick(st.text(max_size=40) | st.lists(_pick(blocks), max_size=4))
messages = st.lists(
    _pick(
        st.fixed_dictionaries(
            {"role": _pick(st.sampled_from(ROLES)), "content": content},
            optional={
                "tool_calls": st.lists(json_values, max_size=2),
                "tool_call_id": _pick(st.text(max_size=10)),
                "name": json_values,
            },
        )
    ),
    max_size=5,
)
tools = st.lists(
    _pick(
        st.fixed_dictionaries(
            {},
            optional={
                "type": _pick(st.sampled_from(["function", "custom", "web_search_20250305"])),
                "name": _pick(st.text(max_size=12)),
                "description": json_values,
                "input_schema": _pick(st.just({"type": "object", "properties": {}})),
                "parameters": _pick(st.just({"type": "object", "properties": {}})),
                "function": json_values,
            },
        )
    ),
    max_size=3,
)
plausible: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["m", "tiny", "claude-sonnet-4-5", ""]),
    "max_tokens": st.integers(min_value=-5, max_value=2 * LIMIT),
    "max_completion_tokens": st.integers(min_value=-5, max_value=2 * LIMIT),
    "max_output_tokens": st.integers(min_value=-5, max_value=2 * LIMIT),
    "messages": messages,
    "input": st.text(max_size=30) | messages | st.lists(_pick(blocks), max_size=4),
    "previous_response_id": st.sampled_from(["resp_known", "resp_unknown", ""]),
    "system": st.text(max_size=30) | st.lists(_pick(blocks), max_size=3),
    "tools": tools,
    "stop_sequences": st.lists(st.text(max_size=8), max_size=5),
    "stop": st.text(max_size=8) | st.lists(st.text(max_size=8), max_size=5),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": st.floats(min_value=-1, max_value=2),
    "top_k": st.integers(min_value=-3, max_value=100),
    "stream": st.booleans(),
    "prompt": st.text(max_size=30)
    | st.lists(st.text(max_size=10), max_size=3)
    | st.lists(st.integers(min_value=-1, max_value=500), max_size=6)
    | st.lists(st.lists(st.integers(min_value=0, max_value=500), max_size=4), max_size=3),
    "suffix": st.text(max_size=20),
    "input_prefix": st.text(max_size=30),
    "input_suffix": st.text(max_size=20),
    "input_extra": st.lists(
        st.fixed_dictionaries({}, optional={"filename": json_values, "text": json_values}),
        max_size=2,
    ),
    "n_predict": st.integers(min_value=-2, max_value=2 * LIMIT),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
        optional={"budget_tokens": st.integers(min_value=-2, max_value=10_000)},
    ),
}
shaped = st.fixed_dictionaries(
    {
        "model": _pick(plausible["model"]),
        "max_tokens": _pick(plausible["max_tokens"]),
        "messages": _pick(messages),
    },
    optional={
        f: _pick(plausible.get(f, json_values))
        for f in TOP_FIELDS
        if f not in ("model", "max_tokens", "messages")
    },
)
bodies = st.one_of(json_values, shaped, shaped, shaped)


def off_the_wire(value: Any) -> Any:
    """``value`` as the server would see it: serialized, then parsed by orjson."""
    try:
        raw = json.dumps(value).encode("utf-8", "surrogatepass")
        return orjson.loads(raw)
    except (ValueError, TypeError, OverflowError, orjson.JSONDecodeError):
        assume(False)  # read_json answers 400 before any mapper runs


# ------------------------------------------------------------------ the checks


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3")


def check_request(chat: ChatRequest) -> None:
    """The mapper's promises on an accepted request."""
    # A raw prompt (legacy completions, FIM) has no messages: its text or ids are the prompt.
    assert isinstance(chat.messages, list) and bool(chat.messages) != (chat.raw is not None)
    if chat.raw is not None:
        assert isinstance(chat.raw.text, str)
        assert chat.raw.suffix is None or isinstance(chat.raw.suffix, str)
        assert all(isinstance(v, str) for c in chat.raw.extra for v in c.values())
        assert chat.raw.ids is None or all(isinstance(t, int) and t >= 0 for t in chat.raw.ids)
    for m in chat.messages:
        assert isinstance(m, Message)
        assert m.role in ("system", "user", "assistant", "tool"), m.role
        assert isinstance(m.content, str)
        assert m.reasoning is None or isinstance(m.reasoning, str)
        for tc in m.tool_calls:
            assert isinstance(tc.id, str) and isinstance(tc.name, str)
            assert isinstance(orjson.loads(tc.arguments), dict)
    assert isinstance(chat.max_tokens, int) and not isinstance(chat.max_tokens, bool)
    assert 1 <= chat.max_tokens <= LIMIT
    assert all(isinstance(s, str) and s for s in chat.stop)
    for t in chat.tools:
        assert isinstance(t.name, str) and t.name and isinstance(t.parameters, dict)


def run_one(spec: tuple[str, str, dict[str, Any]], body: Any, lm: Any) -> None:
    try:
        result = mapper(spec)(body)
    except typed_rejections() as e:
        assert e.status in (400, 404) and isinstance(e.message, str) and e.message
        return
    chat = chat_of(result)
    check_request(chat)
    try:
        prepare(lm, chat, context_length=lm.context_length, max_tokens_capacity=1 << 20)
    except InvalidRequest as e:  # ContextLengthExceeded is one too
        assert e.status == 400


@pytest.mark.parametrize("spec", MAPPERS, ids=lambda s: s[1])
@given(value=bodies)
@example(
    value={
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "text"}]}],
    }
)
def test_mapper_raises_only_invalid_request(spec, lm, value):
    run_one(spec, off_the_wire(value), lm)


def nested_json(levels: int) -> str:
    """JSON text of ``{"a": [{"a": [... {} ...]}]}``, ``levels`` objects deep (2 per level)."""
    return '{"a":[' * levels + "{}" + "]}" * levels


DEEP_SLOTS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "metadata": lambda d: {"messages": [{"role": "user", "content": "hi"}], "metadata": d},
    "tool_use.input": lambda d: {
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": d}],
            },
            {"role": "user", "content": "go"},
        ]
    },
    "tools.schema": lambda d: {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": d, "parameters": d}],
    },
    "tool_result.content": lambda d: {
        "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": d}]}
        ]
    },
    "content": lambda d: {"messages": [{"role": "user", "content": d}]},
    "function.parameters": lambda d: {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": d}}],
        "input": "hi",
    },
    "input": lambda d: {"input": d, "messages": [{"role": "user", "content": "hi"}]},
    "response_format": lambda d: {
        "messages": [{"role": "user", "content": "hi"}],
        "input": "hi",
        "response_format": d,
        "text": d,
        "stream_options": d,
    },
    "messages": lambda d: {"messages": d},
}


@pytest.mark.parametrize("spec", MAPPERS, ids=lambda s: s[1])
@pytest.mark.parametrize("slot", list(DEEP_SLOTS))
@pytest.mark.parametrize("depth", [200, 300, 1000])
def test_deeply_nested_values_in_every_slot(spec, lm, slot, depth):
    """Nesting that orjson accepts on the way in (depth < 1024) must not break a mapper later."""
    template = json.dumps({"model": "m", "max_tokens": 8, **DEEP_SLOTS[slot]("DEEP")})
    raw = template.replace('"DEEP"', nested_json(depth // 2))
    body = orjson.loads(raw)  # what read_json hands the route
    run_one(spec, body, lm)
