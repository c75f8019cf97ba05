"""Shared set-up for the OpenAI end-to-end tests (no tests here).

One real uvicorn server on a free loopback port serves real engines running
the scripted test model (tests/scripted_model.py): ``scripted`` (roomy),
``tight`` (one request at a time, one waiting: for 429) and ``broken`` (its
loader fails: for 500). A token is configured, so every client
authenticates with ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from live_server import scripted_server

TOKEN = "openai-s3cret"
BEARER = {"authorization": f"Bearer {TOKEN}"}
#: Volatile fields: ids and timestamps differ between two requests.
VOLATILE = {"id", "created", "created_at", "completed_at", "call_id", "timings"}
#: A Chat Completions (and Ollama) function tool.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@contextmanager
def openai_env() -> Iterator[dict[str, Any]]:
    """Start the server; yield url, app, engines, blockers and a client."""
    with scripted_server(TOKEN, {"gpt-4o-mini": "scripted"}) as env:
        client = openai.OpenAI(
            base_url=env["url"] + "/v1", api_key=TOKEN, max_retries=0, timeout=60
        )
        try:
            yield {**env, "client": client}
        finally:
            client.close()


def call(name: str, **args: Any) -> str:
    """What the scripted model says to make one Hermes-style tool call."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def user(text: str) -> list[dict[str, Any]]:
    """A one-message Chat Completions ``messages`` list."""
    return [{"role": "user", "content": text}]


def normalize(obj: Any) -> Any:
    """A dump with ids/timestamps and SDK-side helper fields removed.

    Dropped: :data:`VOLATILE` keys (ids, timestamps, timing figures), ``parsed`` / ``parsed_arguments`` (the
    SDK's parsing helpers) and a tool call's ``index`` (the SDK keeps the
    stream's merge key in the accumulated message).
    """
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump()
    if isinstance(obj, dict):
        return {
            k: normalize(v)
            for k, v in obj.items()
            if k not in VOLATILE and k not in ("parsed", "parsed_arguments", "index")
        }
    if isinstance(obj, list):
        return [normalize(v) for v in obj]
    return obj


def sse_data(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame; comment frames are skipped."""
    out: list[tuple[str | None, str]] = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            out.append((name, "\n".join(data)))
    return out
