"""The three chat dialects' request parsers on a minimal valid body, for the
field-level tests (no tests here): each takes the fields to add or override."""

from __future__ import annotations

from typing import Any

from mlx_cairn.protocol.anthropic import AnthropicRequest, parse_messages_request
from mlx_cairn.protocol.openai_chat import OpenAIChatRequest, parse_chat_request
from mlx_cairn.protocol.openai_responses import ResponsesRequest, parse_responses_request

#: The server's ``max_tokens_limit`` in these parses.
LIMIT = 1000


def anthropic_request(**kw: Any) -> AnthropicRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return parse_messages_request(body | kw, max_tokens_limit=LIMIT)


def chat_request(**kw: Any) -> OpenAIChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return parse_chat_request(body | kw, max_tokens_limit=LIMIT)


def responses_request(**kw: Any) -> ResponsesRequest:
    def lookup(rid: str) -> Any:
        raise AssertionError("no stored responses here")

    body = {"model": "m", "input": "hi"}
    return parse_responses_request(body | kw, max_tokens_limit=LIMIT, lookup=lookup)
