"""Run the real app under uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from mlx_cairn.api import ModelRegistry, ServerConfig, create_app


class LiveServer:
    """A started uvicorn server; ``url`` is its base URL."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", ws="none", timeout_graceful_shutdown=2
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


def registry_for(models: dict[str, Any], **kwargs: Any) -> ModelRegistry:
    """A registry serving already-built ``{name: engine}`` (the engine's ``loaded`` is used)."""

    by_model = {id(e.loaded): e for e in models.values()}

    def loader(source: str | None) -> Any:
        assert source is not None
        return models[source].loaded

    return ModelRegistry(
        list(models), loader=loader, engine_factory=lambda lm: by_model[id(lm)], **kwargs
    )


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
