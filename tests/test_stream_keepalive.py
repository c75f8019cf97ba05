"""Keep-alive frames while a stream is prefilling, in every streaming dialect.

A client behind a proxy with an idle timeout (many use 15 to 60 s) must see
bytes while a long prompt is prefilled. The server pings after every
``ping_interval`` seconds of silence from its event loop, and the engine
computes on its own thread, so this holds only if nothing holds the pings back
until the answer starts and a prefill step does not hold the GIL (MLX
releases it while it evaluates).

The test model's first prefill chunk runs real MLX work, one long
``mx.eval`` after another, until the client has read two pings, a few ping
intervals apart, while the *same* evaluation was in flight. The client runs on
a thread of the same process: an evaluation that held the GIL would let it
(and the event loop) run only in the moment after it returned, never across
it. The waits are functional (a safety cap only); the one clock reading
compares two reads of the client, it times nothing the server does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import mlx.core as mx
import pytest

from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

pytestmark = pytest.mark.timeout(180)

PING_INTERVAL = 0.05
#: Two pings read during one evaluation at least this far apart: far more than
#: the 5 ms after which a thread waiting for the GIL asks for it.
SPREAD_S = 4 * PING_INTERVAL
#: Safety cap on the held prefill (never reached when pings flow).
HOLD_CAP_S = 90.0


class SlowPrefill:
    """Wraps a net: once armed, its next prefill chunk (more than one token) runs
    MLX evaluations of at least ``2 * SPREAD_S`` each until :attr:`release` is
    set, then computes as the net would."""

    def __init__(self, net: Any) -> None:
        self.net = net
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        #: The number of the evaluation in flight, None between evaluations.
        self.current: int | None = None
        self.evals = 0
        self.w = mx.random.normal((512, 512)) * (1 / 512**0.5)
        self.depth = self._size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.net, name)

    def _graph(self, depth: int) -> mx.array:
        x = self.w
        for _ in range(depth):
            x = mx.tanh(x @ self.w)  # stays in range: no denormals, no overflow
        return x

    def _size(self) -> int:
        """A depth whose evaluation takes at least 2 * SPREAD_S here (doubling)."""
        depth = 16
        while depth < 1 << 16:
            t = time.perf_counter()
            mx.eval(self._graph(depth))
            if time.perf_counter() - t >= 2 * SPREAD_S:
                break
            depth *= 2
        return depth

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.armed = True

    def __call__(self, tokens: mx.array, cache: Any) -> mx.array:
        if self.armed and tokens.shape[1] > 1:
            self.armed = False
            self.entered.set()
            deadline = time.monotonic() + HOLD_CAP_S
            while not self.release.is_set() and time.monotonic() < deadline:
                x = self._graph(self.depth)
                self.current = self.evals
                mx.eval(x)
                self.current = None
                self.evals += 1
        return self.net(tokens, cache)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    lm = scripted_model("slow")
    slow = SlowPrefill(lm.model)
    lm.model = slow
    # Small steps: a long prompt is many prefill chunks; the first one is held.
    engine = Engine(lm, EngineConfig(num_blocks=512, block_size=16, step_token_budget=64))
    config = ServerConfig(ping_interval=PING_INTERVAL)
    try:
        with serve(registry_for({"slow": engine}), config) as srv:
            yield {"url": srv.url, "engine": engine, "slow": slow}
    finally:
        engine.close()


def prompt(tag: str, answer: str) -> str:
    # Unique per test: nothing comes from the prefix cache, all of it is prefilled.
    return f"{tag} " + "many words of a long prompt " * 60 + say(answer)


def _messages_body(text: str) -> dict[str, Any]:
    """A streamed Messages or Chat Completions body (the two read the same fields here)."""
    return {
        "model": "slow",
        "max_tokens": 32,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }


ROUTES = {
    "anthropic": ("/v1/messages", _messages_body, lambda line: line == "event: ping"),
    "openai-chat": ("/v1/chat/completions", _messages_body, lambda line: line == ": ping"),
    "openai-responses": (
        "/v1/responses",
        lambda text: {
            "model": "slow",
            "max_output_tokens": 32,
            "stream": True,
            "store": False,
            "input": text,
        },
        lambda line: line == ": ping",
    ),
}


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_pings_arrive_while_a_long_prefill_computes(env: dict[str, Any], dialect: str) -> None:
    path, body, is_ping = ROUTES[dialect]
    slow: SlowPrefill = env["slow"]
    slow.arm()
    answer = f"prefilled for {dialect}"
    first_read: dict[int, float] = {}  # evaluation -> when a ping was first read during it
    released = 0  # lines read when the held prefill was let go
    lines: list[str] = []
    try:
        with httpx.stream(
            "POST",
            env["url"] + path,
            json=body(prompt(dialect, answer)),
            headers={"anthropic-version": "2023-06-01"} if dialect == "anthropic" else {},
            timeout=60,
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                k = slow.current
                if is_ping(line) and k is not None and not slow.release.is_set():
                    now = time.monotonic()
                    if now - first_read.setdefault(k, now) >= SPREAD_S:
                        released = len(lines)
                        slow.release.set()
    finally:
        slow.release.set()
    assert released, (slow.evals, slow.depth, lines[:20])
    text = "\n".join(lines)
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    if dialect == "anthropic":
        said = "".join(
            d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta"
        )
        # message_start (sent on admission) came before the held prefill ended.
        assert "event: message_start" in lines[:released]
        assert "event: message_stop" in text
    elif dialect == "openai-chat":
        said = "".join(d["choices"][0]["delta"].get("content") or "" for d in data if d["choices"])
        assert "data: [DONE]" in text
    else:
        said = "".join(
            d.get("delta", "") for d in data if d["type"] == "response.output_text.delta"
        )
        assert "event: response.completed" in text
    assert said == answer
    assert_at_rest(env["engine"])


def test_the_default_ping_interval_is_well_under_common_idle_timeouts() -> None:
    # Proxies and clients commonly give up after 15 to 60 s without a byte.
    assert ServerConfig().ping_interval <= 5
