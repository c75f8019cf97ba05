"""A resumed Claude Code session (``claude --continue``) reads the previous turn from the cache.

The two fixtures are real Claude Code 2.1.332 requests, redacted
(tests/fixtures/claude-code/README.md): the last request of an interactive
session's turn (the model ran a tool, thinking shown) and the first request of
``claude --continue -p`` in the same directory, which re-sends that turn with
the model's answer and a new user message. The scripted model (Qwen3's
template) answers the first exactly as it answered then, so the second can
read from the cache everything the first prompted and generated.

Qwen3's template drops the ``<think>`` blocks of turns before the last user
message, so rendered its own way the resumed prompt leaves the cached one at
the previous turn's first assistant message; Claude Code asks to keep all
thinking (``context_management`` ``clear_thinking_20251015`` ``keep: "all"``),
and the server then renders earlier turns as they were generated.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.protocol.anthropic import parse_count_tokens_request, parse_messages_request
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import scripted_model

BLOCK = 16
FIXTURES = Path(__file__).parent / "fixtures" / "claude-code"
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}


def fixture(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    body["stream"] = False
    return body


@pytest.fixture
def server() -> Iterator[str]:
    """A fresh engine per test: what is cached comes from this test's requests only."""
    engine = Engine(
        scripted_model(context_length=131072), EngineConfig(num_blocks=6000, block_size=BLOCK)
    )
    try:
        with serve(
            registry_for({"scripted": engine}, default_model=""),
            ServerConfig(clamp_max_tokens=True),
        ) as srv:
            yield srv.url
        assert_at_rest(engine)
    finally:
        engine.close()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/messages?beta=true", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def prompt_tokens(usage: dict[str, Any]) -> int:
    return int(usage["input_tokens"] + usage["cache_read_input_tokens"])


def resume(url: str, last: dict[str, Any], resumed: dict[str, Any]) -> tuple[int, int, int]:
    """(the previous turn's prompt + answer, the resumed prompt, its cache hit)."""
    first = post(url, last)
    said = [b for b in first["content"] if b["type"] == "text"]
    # The model answers as it did in the captured session.
    assert said[0]["text"] == resumed["messages"][4]["content"][1]["text"]
    second = post(url, resumed)
    p1, o1 = prompt_tokens(first["usage"]), first["usage"]["output_tokens"]
    return p1 + o1, prompt_tokens(second["usage"]), second["usage"]["cache_read_input_tokens"]


def test_continue_reads_the_previous_turn_and_its_answer_from_the_cache(server: str) -> None:
    last = fixture("cc-2.1.332-resume-last-turn")
    resumed = fixture("cc-2.1.332-resume-continue")
    previous, prompt, hit = resume(server, last, resumed)
    # Everything the previous request prompted and generated, to the last full
    # block (the EOS that ended the answer is never fed to the model).
    assert hit >= (previous - 1) // BLOCK * BLOCK, (previous, prompt, hit)
    assert prompt - hit < 500  # the new user message and system turn


def test_without_keep_all_thinking_the_template_rewrites_the_previous_turn(server: str) -> None:
    """The cause, kept visible: rendered the template's way, the resumed prompt
    parts from the cached one where the previous turn's first answer starts."""
    last = fixture("cc-2.1.332-resume-last-turn")
    resumed = fixture("cc-2.1.332-resume-continue")
    for body in (last, resumed):
        del body["context_management"]
    previous, _, hit = resume(server, copy.deepcopy(last), resumed)
    turn_start = prompt_tokens(post(server, last | {"messages": last["messages"][:2]})["usage"])
    assert hit <= turn_start < previous - 300


@pytest.mark.parametrize(
    ("context_management", "kept"),
    [
        ({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, True),
        (
            {
                "edits": [
                    {"type": "clear_tool_uses_20250919"},
                    {"type": "clear_thinking_20251015", "keep": "all"},
                ]
            },
            True,
        ),
        ({"edits": [{"type": "clear_thinking_20251015"}]}, False),  # the API's default: 1 turn
        (
            {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns"}}]},
            False,
        ),
        ({"edits": "all"}, False),
        ("all", False),
        (None, False),
    ],
)
def test_only_keep_all_thinking_renders_history_as_generated(
    context_management: Any, kept: bool
) -> None:
    """Malformed or other edits are ignored, never a 400 (unknown fields are not rejected)."""
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "context_management": context_management,
    }
    for parse in (
        lambda b: parse_messages_request(b, max_tokens_limit=128),
        parse_count_tokens_request,
    ):
        assert parse(body).chat.history_as_generated is kept
