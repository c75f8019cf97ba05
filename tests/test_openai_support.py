"""Shared set-up for the OpenAI end-to-end tests (no tests here).

One real uvicorn server on a free loopback port serves real engines running
the scripted test model (tests/scripted_model.py): ``scripted`` (roomy),
``tight`` (one request at a time, one waiting: for 429) and ``broken`` (its
loader fails: for 500). A token is configured, so every client
authenticates with ``Authorization: Bearer``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from live_server import LiveServer
from mlx_cairn.api import ModelRegistry, ServerConfig, create_app
from mlx_cairn.engine import Engine
from scripted_model import scripted_model

TOKEN = "openai-s3cret"
BEARER = {"authorization": f"Bearer {TOKEN}"}
#: Volatile fields: ids and timestamps differ between two requests.
VOLATILE = {"id", "created", "created_at", "completed_at", "call_id", "timings"}


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
def openai_env() -> Iterator[dict[str, Any]]:
    """Start the server; yield url, app, engines, blockers and a client."""
    main = Engine(scripted_model("scripted"), num_blocks=1024, max_queue=8)
    tight = Engine(scripted_model("tight"), num_blocks=128, max_queue=1, max_batch=1)
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
        aliases={"gpt-4o-mini": "scripted"},
        loader=loader,
        engine_factory=lambda lm: by_model[id(lm)],
    )
    config = ServerConfig(api_token=TOKEN, max_body_bytes=64 * 1024, ping_interval=0.05)
    app = create_app(registry, config)
    srv = LiveServer(app)
    srv.start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    try:
        yield {
            "url": srv.url,
            "app": app,
            "engines": engines,
            "blockers": blockers,
            "client": client,
        }
    finally:
        client.close()
        srv.stop()
        for e in engines.values():
            e.close()


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


def wait_until(pred: Any, what: str, timeout: float = 10.0) -> None:
    """Poll ``pred`` until true (a functional wait, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


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
