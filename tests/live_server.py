"""Run the real app under uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from mlx_cairn.api import ModelRegistry, ServerConfig, create_app
from mlx_cairn.api.connection import http_protocol
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import scripted_model

#: The error types the Anthropic API documents.
ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


class LiveServer:
    """A started uvicorn server; ``url`` is its base URL."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        settings = app.state.cairn.config  # the protocol `cairn serve` runs, with these timeouts
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=2,
            http=http_protocol(settings.header_timeout, settings.body_timeout),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextmanager
def serve(registry: ModelRegistry, config: ServerConfig | None = None) -> Iterator[LiveServer]:
    """Serve ``registry`` for the duration of the block."""
    srv = LiveServer(create_app(registry, config))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_text(folder: Path, prompt: str, max_tokens: int) -> str:
    """The in-process engine's greedy answer for the model saved in ``folder`` (what a
    server on that folder must answer; no speculative decoding)."""
    from mlx_cairn.models import load
    from mlx_cairn.testing.engine_checks import closing_at_rest
    from mlx_cairn.types import ChatRequest, Message, SamplingParams

    lm = load(str(folder))
    req = ChatRequest(
        [Message("user", prompt)], max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
    )
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16))) as engine:
        s = engine.submit(req)
        list(s.iter_sync(timeout=120))
        ids = s.output_ids
    if ids and ids[-1] in lm.eos_token_ids:
        ids = ids[:-1]
    return lm.tokenizer.decode(ids)


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after data counts as a close)."""
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        if not chunks:
            raise
    return b"".join(chunks)


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], log: Path, *, timeout: float = 120, what: str = ""
) -> None:
    """Wait until ``url`` answers /health with 200; fail with ``log`` if ``proc`` exits
    first, or with "``what`` did not start" (default: the url) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what or url} did not start"
        time.sleep(0.2)


@contextmanager
def cairn_serve(args: list[str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``cairn serve`` process on a free loopback port (no API key), up and
    answering /health; yields (url, process) and kills it on exit if still running."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
        "--port", str(port), *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CAIRN_API_KEY"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, what="cairn serve")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def registry_for(models: dict[str, Any], **kwargs: Any) -> ModelRegistry:
    """A registry serving already-built ``{name: engine}`` (the engine's ``loaded`` is used)."""

    by_model = {id(e.loaded): e for e in models.values()}

    def loader(source: str | None) -> Any:
        assert source is not None
        return models[source].loaded

    return ModelRegistry(
        list(models), loader=loader, engine_factory=lambda lm: by_model[id(lm)], **kwargs
    )


class Blocker:
    """Engine fault hook: once armed, lets ``skip`` steps pass, then holds the
    engine thread until released (or raises ``fail`` instead of holding)."""

    def __init__(self) -> None:
        self.armed = False
        self.skip = 0
        self.fail: Exception | None = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def arm(self, skip: int = 0, fail: Exception | None = None) -> None:
        self.entered.clear()
        self.release.clear()
        self.skip, self.fail = skip, fail
        self.armed = True

    def __call__(self) -> None:
        if not self.armed:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.armed = False
        self.entered.set()
        if self.fail is not None:
            raise self.fail
        self.release.wait(30)


@contextmanager
def scripted_server(token: str, aliases: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Serve the scripted test model as ``scripted``, ``tight`` and ``broken``.

    ``scripted`` is roomy, ``tight`` runs one request with one waiting (for
    429) and ``broken``'s loader fails (for 500). Each working engine has a
    :class:`Blocker` as its fault hook. Yields url, app, engines and blockers.
    """
    main = Engine(scripted_model("scripted"), EngineConfig(num_blocks=1024, max_queue=8))
    tight = Engine(scripted_model("tight"), EngineConfig(num_blocks=128, max_queue=1, max_batch=1))
    blockers = {"scripted": Blocker(), "tight": Blocker()}
    main._fault_hook = blockers["scripted"]
    tight._fault_hook = blockers["tight"]
    engines = {"scripted": main, "tight": tight}

    def loader(src: str | None) -> Any:
        if src == "broken":
            raise RuntimeError("weights are corrupt")
        return engines[str(src)].loaded

    by_model = {id(e.loaded): e for e in engines.values()}
    registry = ModelRegistry(
        ["scripted", "tight", "broken"],
        aliases=aliases,
        loader=loader,
        engine_factory=lambda lm: by_model[id(lm)],
    )
    config = ServerConfig(api_token=token, max_body_bytes=64 * 1024, ping_interval=0.05)
    app = create_app(registry, config)
    srv = LiveServer(app)
    srv.start()
    try:
        yield {"url": srv.url, "app": app, "engines": engines, "blockers": blockers}
    finally:
        srv.stop()
        for e in engines.values():
            e.close()


def wait_until(pred: Any, what: str, timeout: float = 10.0) -> None:
    """Poll ``pred`` until true (a functional wait, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def settle_cancel(engine: Engine, blocker: Blocker, before: int) -> EngineStats:
    """After a client left a request the engine is held on: the server cancels it,
    and once ``blocker`` lets go the engine counts the cancel and frees everything.

    ``before`` is ``requests_cancelled`` ahead of the request; returns the
    at-rest stats.
    """
    # The engine thread is held by the blocker, so the cancel waits in its inbox.
    wait_until(lambda: bool(engine._cancels), "the server did not cancel the generation")
    blocker.release.set()
    wait_until(
        lambda: engine.stats().requests_cancelled >= before + 1,
        "the engine never saw the cancel",
    )
    return assert_at_rest(engine)


@contextmanager
def tight_queue_full(env: dict[str, Any], send: Callable[[], Any]) -> Iterator[None]:
    """Hold :func:`scripted_server`'s ``tight`` full for the block: one ``send()``
    running, one queued. Afterwards both must answer 200 and the engine be at rest."""
    eng, blocker = env["engines"]["tight"], env["blockers"]["tight"]
    blocker.arm()
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(send()))
    first.start()
    assert blocker.entered.wait(10)  # admitted and running: the queue is empty again
    second = threading.Thread(target=lambda: results.append(send()))
    second.start()
    wait_until(lambda: eng.stats().queue_depth >= 1, "the second request never queued")
    try:
        yield
    finally:
        blocker.release.set()
    first.join(10)
    second.join(10)
    assert [x.status_code for x in results] == [200, 200]
    assert_at_rest(eng)


def sse_events(text: str) -> list[tuple[str, Any]]:
    """(event name, JSON data) of each frame of an SSE body; comments are skipped."""
    out = []
    for frame in text.split("\n\n"):
        lines = [ln for ln in frame.split("\n") if ln and not ln.startswith(":")]
        if not lines:
            continue
        name = lines[0].removeprefix("event: ")
        data = "\n".join(ln.removeprefix("data: ") for ln in lines[1:])
        out.append((name, json.loads(data)))
    return out
