"""A small, bounded version of bench/load.py that runs in every test run.

24 concurrent streaming clients for a few seconds against a real server with
the scripted model on a small KV pool (so preemption happens): the three
dialects mixed, shared and unshared system prompts, every third client
abandoning its requests at random moments. Every request that is not
abandoned must end with its exact scripted answer; afterwards the engine is at
rest and nothing is referenced. A hang fails the test through its timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

pytestmark = pytest.mark.timeout(180)

CLIENTS = 24
SECONDS = 6.0
SHARED = "You answer exactly as told. " * 6


def make(rng: random.Random, i: int) -> tuple[str, dict[str, Any], str]:
    """(path, body, expected answer) of one random streaming request."""
    answer = f"answer {i} " + "x" * rng.randint(0, 30)
    system = SHARED if rng.random() < 0.5 else f"nonce {rng.random()} " + SHARED
    user = say(answer)
    kind = rng.choice(["anthropic", "chat", "responses"])
    if kind == "anthropic":
        body = {
            "model": "m",
            "max_tokens": 64,
            "stream": True,
            "system": system,
            "messages": [{"role": "user", "content": user}],
        }
        return "/v1/messages", body, answer
    if kind == "chat":
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return (
            "/v1/chat/completions",
            {"model": "m", "max_tokens": 64, "stream": True, "messages": messages},
            answer,
        )
    body = {
        "model": "m",
        "max_output_tokens": 64,
        "stream": True,
        "store": False,
        "instructions": system,
        "input": user,
    }
    return "/v1/responses", body, answer


def text_of(path: str, raw: str) -> tuple[str, str]:
    """(outcome, streamed text) of a finished SSE body."""
    text, outcome, event = [], "truncated", None
    for line in raw.splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            outcome = "done"
            continue
        p = json.loads(data)
        name = event or p.get("type")
        if name in ("error", "response.failed") or (
            path == "/v1/chat/completions" and "error" in p
        ):
            return "error", "".join(text)
        if name == "content_block_delta" and p["delta"].get("type") == "text_delta":
            text.append(p["delta"]["text"])
        elif name == "response.output_text.delta":
            text.append(p["delta"])
        elif path == "/v1/chat/completions" and p.get("choices"):
            text.append(p["choices"][0]["delta"].get("content") or "")
        if name in ("message_stop", "response.completed"):
            outcome = "done"
    return outcome, "".join(text)


async def client(
    idx: int, url: str, deadline: float, tally: Counter[str], wrong: list[Any]
) -> None:
    rng = random.Random(idx)
    dropper = idx % 3 == 0
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < deadline:
            n += 1
            path, body, answer = make(rng, idx * 1000 + n)

            async def one(path: str = path, body: dict[str, Any] = body) -> str:
                async with c.stream(
                    "POST", path, json=body, headers={"anthropic-version": "2023-06-01"}
                ) as r:
                    assert r.status_code == 200, await r.aread()
                    return "".join([chunk async for chunk in r.aiter_text()])

            if dropper:
                try:  # leave at a random moment, often before the first token
                    await asyncio.wait_for(one(), rng.uniform(0.0, 0.3))
                    tally["finished-before-drop"] += 1
                except asyncio.TimeoutError:
                    tally["dropped"] += 1
                continue
            outcome, text = text_of(path, await one())
            tally[outcome] += 1
            if outcome != "done" or text != answer:
                wrong.append((path, outcome, text, answer))


def test_concurrent_mixed_clients_with_disconnects():
    # 40 usable blocks of 8 tokens for 24 clients of ~100-token prompts: preemption and queueing.
    engine = Engine(
        scripted_model("m"), EngineConfig(num_blocks=41, block_size=8, max_batch=12, max_queue=64)
    )
    try:
        with serve(registry_for({"m": engine}), ServerConfig(ping_interval=0.5)) as srv:

            async def main() -> tuple[Counter[str], list[Any]]:
                tally: Counter[str] = Counter()
                wrong: list[Any] = []
                deadline = time.monotonic() + SECONDS
                await asyncio.gather(
                    *(client(i, srv.url, deadline, tally, wrong) for i in range(CLIENTS))
                )
                return tally, wrong

            tally, wrong = asyncio.run(main())
            st = assert_at_rest(engine)
    finally:
        engine.close()
    print(
        dict(tally),
        {k: getattr(st, k) for k in ("preemptions", "requests_cancelled", "requests_completed")},
    )
    assert not wrong, wrong[:5]
    assert tally["done"] > CLIENTS, tally  # every steady client finished more than once
    assert tally["dropped"] > 0, tally
    assert st.requests_failed == 0, st
    assert st.preemptions > 0, st
    assert st.requests_cancelled > 0, st  # the drops reached the engine as cancels
