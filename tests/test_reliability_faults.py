"""Faults inside the engine, seen through the real HTTP server.

- a forward pass that raises (the engine's fault hook) fails only the requests
  of that step, each in its dialect's way (``error`` event on a stream, a 500
  envelope on a JSON request), and the next requests succeed;
- a deliberately tiny KV pool under concurrent load preempts and queues:
  every client gets its full, correct answer, nothing deadlocks, nothing leaks.

The engine runs the scripted test model, so every answer is known exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from live_server import registry_for, serve, wait_until
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

pytestmark = pytest.mark.timeout(120)  # a hang here is a deadlock

HEADERS = {"anthropic-version": "2023-06-01"}
WAIT = 30.0


class FaultHook:
    """Holds the engine thread at its next step, then lets it go on or raise."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False
        self.raised = 0

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.fail = False
        self.armed = True

    def __call__(self) -> None:
        if not self.armed:
            return
        self.armed = False
        self.entered.set()
        self.release.wait(WAIT)
        if self.fail:
            self.raised += 1
            raise RuntimeError("injected forward-pass failure")


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    # max_batch=1: one request per step, the next one waits in the queue.
    single = Engine(
        scripted_model("single"), EngineConfig(num_blocks=128, block_size=8, max_batch=1)
    )
    hook = FaultHook()
    single._fault_hook = hook
    # 13 usable blocks of 8 tokens. Each request below prompts 39-47 tokens (5-6
    # blocks) and answers 17-22 (8-9 blocks in all): two fit at admission, a third
    # queues, and the two cannot both finish without one preempting the other.
    tiny = Engine(
        scripted_model("tiny"), EngineConfig(num_blocks=14, block_size=8, max_batch=8, max_queue=64)
    )
    tiny_hook = FaultHook()
    tiny._fault_hook = tiny_hook
    registry = registry_for({"single": single, "tiny": tiny})
    with serve(registry, ServerConfig(ping_interval=0.2)) as srv:
        yield {"url": srv.url, "single": single, "tiny": tiny, "hook": hook, "tiny_hook": tiny_hook}
    single.close()
    tiny.close()


def request(
    dialect: str, model: str, text: str, *, stream: bool, max_tokens: int = 40
) -> tuple[str, dict[str, Any]]:
    """(path, body) of a request in ``dialect``."""
    if dialect == "anthropic":
        return "/v1/messages", {
            "model": model,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    if dialect == "chat":
        return "/v1/chat/completions", {
            "model": model,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    return "/v1/responses", {
        "model": model,
        "max_output_tokens": max_tokens,
        "stream": stream,
        "store": False,
        "input": text,
    }


def post(url: str, dialect: str, model: str, text: str, *, stream: bool) -> httpx.Response:
    path, body = request(dialect, model, text, stream=stream)
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=WAIT * 2)


def answer_of(dialect: str, r: httpx.Response) -> str:
    """The text of a successful non-streamed response."""
    data = r.json()
    if dialect == "anthropic":
        return "".join(b.get("text", "") for b in data["content"])
    if dialect == "chat":
        return str(data["choices"][0]["message"]["content"])
    return "".join(
        c.get("text", "") for item in data["output"] for c in item.get("content", []) or []
    )


def assert_failed(dialect: str, stream: bool, r: httpx.Response) -> None:
    """The dialect's way of saying a started generation failed."""
    if not stream:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] in ("api_error", "server_error"), err
        return
    assert r.status_code == 200  # the stream had started
    text = r.text
    if dialect == "anthropic":
        assert "event: error" in text and "event: message_stop" not in text, text
    elif dialect == "chat":
        assert '"error"' in text and "[DONE]" not in text, text
    else:
        assert "response.failed" in text or "event: error" in text, text
        assert "response.completed" not in text, text


@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_forward_fault_fails_only_that_step(env, dialect, stream):
    url, engine, hook = env["url"], env["single"], env["hook"]
    before = engine.stats()
    hook.arm()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, dialect, "single", say("first answer"), stream=stream)
        assert hook.entered.wait(WAIT), "the engine never reached the step"
        # The second request arrives while the first is in the failing step: it waits.
        second = pool.submit(post, url, dialect, "single", say("second answer"), stream=False)
        deadline = threading.Event()
        while engine.stats().queue_depth < 1 and not deadline.wait(0.01):
            pass
        hook.fail = True
        hook.release.set()
        r1, r2 = first.result(WAIT), second.result(WAIT)
    assert_failed(dialect, stream, r1)
    assert r2.status_code == 200, r2.text
    assert answer_of(dialect, r2) == "second answer"
    # And the next request after that is fine too.
    r3 = post(url, dialect, "single", say("third answer"), stream=False)
    assert r3.status_code == 200 and answer_of(dialect, r3) == "third answer"
    st = assert_at_rest(engine)
    assert st.requests_failed == before.requests_failed + 1
    assert st.requests_completed == before.requests_completed + 2


def test_tiny_pool_preempts_and_queues_without_client_errors(env):
    url, engine = env["url"], env["tiny"]
    before = engine.stats()
    dialects = ["anthropic", "chat", "responses"]
    jobs = [(dialects[i % 3], f"w{i} " + "z" * (14 + i % 5), i % 2 == 0) for i in range(18)]

    def run(job: tuple[str, str, bool]) -> tuple[str, str, httpx.Response]:
        dialect, text, stream = job
        return dialect, text, post(url, dialect, "tiny", say(text), stream=stream)

    # The engine is held at the first job's step until every other job has queued,
    # so the scheduler meets them all at once however slowly they arrive.
    hook = env["tiny_hook"]
    hook.arm()
    with ThreadPoolExecutor(len(jobs)) as pool:
        first = pool.submit(run, jobs[0])
        assert hook.entered.wait(WAIT), "the engine never reached the step"
        rest = [pool.submit(run, job) for job in jobs[1:]]
        try:
            wait_until(lambda: engine.stats().queue_depth >= len(rest), "never queued", WAIT)
        finally:
            hook.release.set()
        results = [f.result(90) for f in [first, *rest]]
    for (dialect, text, r), (_, _, stream) in zip(results, jobs, strict=True):
        assert r.status_code == 200, (dialect, r.text)
        if stream:
            assert "error" not in r.text.replace('"error":null', ""), r.text
        else:
            assert answer_of(dialect, r) == text
    st = assert_at_rest(engine)
    assert st.preemptions > before.preemptions, "the pool never ran dry: make it smaller"
    assert st.requests_failed == before.requests_failed
    assert st.requests_completed == before.requests_completed + len(jobs)
