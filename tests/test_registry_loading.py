"""Requests that arrive while their model loads: one load, answers in arrival order,
pings that keep streams alive, and one error for every waiter when the load fails.

The loaders here are gated on a :class:`threading.Event`, so a load lasts exactly
as long as the test wants; every wait is functional (no timing assertions).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest

from live_server import serve, wait_until
from mlx_cairn.api import ModelRegistry, ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

pytestmark = pytest.mark.timeout(120)

HEADERS = {"anthropic-version": "2023-06-01"}
DIALECTS = ["anthropic", "chat", "responses"]
WAIT = 30.0


class GatedLoader:
    """A loader that blocks until ``gate`` is set, then returns the scripted model or
    raises ``fail``; counts its calls."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.gate = threading.Event()
        self.fail = fail
        self.calls = 0

    def __call__(self, source: str | None) -> Any:
        self.calls += 1
        assert self.gate.wait(WAIT), "the test never let the load finish"
        if self.fail is not None:
            raise self.fail
        return scripted_model("lazy")


class Recording:
    """An Engine that records the order of ``submit`` calls (by prompt text).

    ``prepare`` of a request whose text contains ``slow-to-tokenize`` takes a
    while, so that without ordered submission a later request would overtake it.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.order: list[str] = []
        self._tags: dict[int, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prepare(self, chat: Any, **kwargs: Any) -> Any:
        text = str(chat.messages[-1].content)
        if "slow-to-tokenize" in text:
            time.sleep(0.5)  # a delay injected, not measured
        prepared = self._engine.prepare(chat, **kwargs)
        self._tags[id(prepared)] = text
        return prepared

    def submit(self, prepared: Any) -> Any:
        self.order.append(self._tags.get(id(prepared), "?"))
        return self._engine.submit(prepared)


def request(dialect: str, text: str, *, stream: bool, model: str = "lazy") -> tuple[str, Any]:
    if dialect == "anthropic":
        return "/v1/messages", {
            "model": model,
            "max_tokens": 40,
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    if dialect == "chat":
        return "/v1/chat/completions", {
            "model": model,
            "max_tokens": 40,
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }
    return "/v1/responses", {
        "model": model,
        "max_output_tokens": 40,
        "stream": stream,
        "store": False,
        "input": text,
    }


def frames(raw: str) -> list[tuple[str | None, Any]]:
    """SSE text -> [(event or ":" for a comment, parsed data)]."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln]
        if not lines:
            continue
        if all(ln.startswith(":") for ln in lines):
            out.append((":", lines[0][1:].strip()))
            continue
        event = None
        data = []
        for ln in lines:
            if ln.startswith("event:"):
                event = ln[6:].strip()
            elif ln.startswith("data:"):
                data.append(ln[5:].lstrip())
        text = "\n".join(data)
        out.append((event, text if text == "[DONE]" else orjson.loads(text)))
    return out


def is_ping(dialect: str, f: tuple[str | None, Any]) -> bool:
    if dialect == "anthropic":
        return f[0] == "ping" and f[1] == {"type": "ping"}
    return f == (":", "ping")


def stream_text(dialect: str, fs: list[tuple[str | None, Any]]) -> str:
    """The answer text of a finished stream."""
    parts: list[str] = []
    for event, data in fs:
        if dialect == "anthropic" and event == "content_block_delta":
            parts.append(data["delta"].get("text", ""))
        elif dialect == "chat" and event is None and isinstance(data, dict) and data["choices"]:
            parts.append(data["choices"][0]["delta"].get("content") or "")
        elif dialect == "responses" and event == "response.output_text.delta":
            parts.append(data["delta"])
    return "".join(parts)


def json_text(dialect: str, data: dict[str, Any]) -> str:
    if dialect == "anthropic":
        return "".join(b.get("text", "") for b in data["content"])
    if dialect == "chat":
        return str(data["choices"][0]["message"]["content"])
    return "".join(c.get("text", "") for item in data["output"] for c in item.get("content") or [])


class Client(threading.Thread):
    """One request in its own thread; a stream's lines are kept as they arrive."""

    def __init__(self, url: str, dialect: str, text: str, *, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.dialect, self.text, self.stream = url, dialect, text, stream
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.raw = ""
        self.pings = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        path, body = request(self.dialect, self.text, stream=self.stream)
        try:
            with (
                httpx.Client(timeout=WAIT * 2) as c,
                c.stream("POST", self.url + path, json=body, headers=HEADERS) as r,
            ):
                self.status = r.status_code
                self.headers = dict(r.headers)
                for chunk in r.iter_text():
                    self.raw += chunk
                    if self.stream:
                        whole = frames(self._whole())
                        self.pings = sum(is_ping(self.dialect, f) for f in whole)
        except BaseException as e:  # reported by the test
            self.error = e

    def _whole(self) -> str:
        cut = self.raw.rfind("\n\n")
        return self.raw[: cut + 2] if cut >= 0 else ""

    def result(self) -> list[tuple[str | None, Any]]:
        self.join(WAIT * 2)
        assert not self.is_alive() and self.error is None, self.error
        return frames(self.raw) if self.stream else []


@contextmanager
def lazy_server(
    loader: GatedLoader,
    *,
    engine_kwargs: dict[str, Any] | None = None,
    ping_interval: float = 0.05,
) -> Iterator[tuple[str, ModelRegistry, list[Recording]]]:
    """Serve one model ``lazy`` whose load waits for ``loader.gate``."""
    engines: list[Recording] = []

    def factory(lm: Any) -> Recording:
        eng = Recording(Engine(lm, EngineConfig(num_blocks=512, **(engine_kwargs or {}))))
        engines.append(eng)
        return eng

    reg = ModelRegistry(["lazy"], loader=loader, engine_factory=factory)
    try:
        with serve(reg, ServerConfig(ping_interval=ping_interval)) as srv:
            yield srv.url, reg, engines
    finally:
        reg.close()


# ------------------------------------------------------------- in arrival order


def test_requests_waiting_for_a_load_share_it_and_are_answered_in_arrival_order() -> None:
    loader = GatedLoader()
    # One row at a time: the engine admits and answers in the order of submission.
    with lazy_server(loader, engine_kwargs={"max_batch": 1}) as (url, reg, engines):
        sm = reg.models[0]
        texts = [f"answer {i}" for i in range(6)]
        # The first to arrive is the slowest to tokenize: it must still go first.
        prompts = [f"slow-to-tokenize {say(texts[0])}"] + [say(t) for t in texts[1:]]
        clients = []
        for i, (prompt, dialect) in enumerate(zip(prompts, DIALECTS * 2, strict=True)):
            c = Client(url, dialect, prompt, stream=i % 2 == 0)
            c.start()
            clients.append(c)
            wait_until(lambda n=i + 1: sm.waiting == n, f"request {i} is not waiting")
        assert sm.state == "loading" and loader.calls == 1
        loader.gate.set()
        for c, text in zip(clients, texts, strict=True):
            fs = c.result()
            assert c.status == 200, c.raw
            got = (
                stream_text(c.dialect, fs)
                if c.stream
                else json_text(c.dialect, orjson.loads(c.raw))
            )
            assert got == text, (c.dialect, c.raw)
        assert loader.calls == 1 and sm.loads == 1
        (engine,) = engines
        assert engine.order == prompts  # admitted in arrival order, the slow one first
        assert sm.waiting == 0 and sm.active == 0
        assert_at_rest(engine._engine)


# ------------------------------------------------------------------- pings


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_stream_to_a_loading_model_gets_pings_before_its_first_event(dialect: str) -> None:
    loader = GatedLoader()
    with lazy_server(loader) as (url, reg, engines):
        c = Client(url, dialect, say("Hello there"), stream=True)
        c.start()
        # The load is held until the client has seen pings: they came while it loaded.
        wait_until(lambda: c.pings >= 3 or not c.is_alive(), "no pings while the model loads")
        assert c.status == 200 and reg.models[0].state == "loading"
        assert c.headers["content-type"].startswith("text/event-stream")
        loader.gate.set()
        fs = c.result()
        pings = [i for i, f in enumerate(fs) if is_ping(dialect, f)]
        content = [i for i, f in enumerate(fs) if not is_ping(dialect, f) and f[0] != ":"]
        assert len(pings) >= 3 and content and pings[:3] == [0, 1, 2]
        first = fs[content[0]]
        if dialect == "anthropic":
            assert first[0] == "message_start"  # after admission, as for a loaded model
            assert first[1]["message"]["usage"]["input_tokens"] > 0
            assert fs[content[-1]][0] == "message_stop"
        elif dialect == "chat":
            assert first[1]["choices"][0]["delta"]["role"] == "assistant"
            assert fs[content[-1]] == (None, "[DONE]")
        else:
            assert [fs[i][0] for i in content[:2]] == ["response.created", "response.in_progress"]
            assert fs[content[-1]][0] == "response.completed"
        assert stream_text(dialect, fs) == "Hello there"
        assert_at_rest(engines[0]._engine)


def test_a_model_that_loads_within_the_ping_interval_starts_the_stream_as_before() -> None:
    loader = GatedLoader()
    loader.gate.set()
    # The whole load and answer fit many times in a minute: no ping is due at all.
    with lazy_server(loader, ping_interval=60) as (url, reg, _):
        for _ in range(2):  # loading on this request, then loaded
            c = Client(url, "anthropic", say("Hi"), stream=True)
            c.start()
            fs = c.result()
            assert fs[0][0] == "message_start" and stream_text("anthropic", fs) == "Hi"
            assert not any(is_ping("anthropic", f) for f in fs)
        assert loader.calls == 1 and reg.models[0].loads == 1


# ------------------------------------------------------------- failed loads


def test_a_failed_load_gives_every_waiting_request_the_error() -> None:
    loader = GatedLoader(fail=OSError("weights are corrupt"))
    with lazy_server(loader) as (url, reg, _):
        sm = reg.models[0]
        streams = [Client(url, d, say("x"), stream=True) for d in DIALECTS]
        plain = [Client(url, d, say("x"), stream=False) for d in DIALECTS]
        for c in streams:
            c.start()
        # Every stream has started (pings) before the load fails.
        wait_until(lambda: all(c.pings >= 1 for c in streams), "the streams did not start")
        for c in plain:
            c.start()
        wait_until(lambda: sm.waiting == 6, "not every request waits for the load")
        loader.gate.set()
        for c in streams:
            fs = c.result()
            assert c.status == 200  # the stream had started: the error is in it
            content = [f for f in fs if not is_ping(c.dialect, f) and f[0] != ":"]
            if c.dialect == "anthropic":
                assert [f[0] for f in content] == ["error"], content
                err = content[0][1]["error"]
                assert err["type"] == "api_error"
            elif c.dialect == "chat":
                assert len(content) == 1 and "[DONE]" not in c.raw, content
                err = content[0][1]["error"]
                assert err["type"] == "server_error"
            else:
                names = [f[0] for f in content]
                expect = ["response.created", "response.in_progress", "error", "response.failed"]
                assert names == expect, names
                err = content[2][1]
                assert err["code"] == "server_error"
                failed = content[3][1]["response"]
                assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
            assert "failed to load" in err["message"] and "weights are corrupt" in err["message"]
        for c in plain:  # not streamed: an HTTP status, as before
            c.result()
            assert c.status == 500, c.raw
            err = orjson.loads(c.raw)["error"]
            assert err["type"] == ("api_error" if c.dialect == "anthropic" else "server_error")
            assert "weights are corrupt" in err["message"]
        assert loader.calls == 1 and sm.state == "unloaded" and sm.waiting == 0
        # A later request retries the load.
        loader.fail = None
        path, body = request("anthropic", say("again"), stream=False)
        r = httpx.post(url + path, json=body, headers=HEADERS, timeout=WAIT)
        assert r.status_code == 200 and json_text("anthropic", r.json()) == "again"
        assert loader.calls == 2 and sm.error is None


def test_validation_errors_stay_http_statuses_and_load_nothing() -> None:
    loader = GatedLoader()
    with lazy_server(loader) as (url, reg, _):
        for dialect in DIALECTS:
            path, body = request(dialect, "x", stream=True)
            body["max_tokens" if dialect != "responses" else "max_output_tokens"] = -1
            r = httpx.post(url + path, json=body, headers=HEADERS, timeout=WAIT)
            assert r.status_code == 400, r.text
            assert "text/event-stream" not in r.headers.get("content-type", "")
        path, body = request("anthropic", "x", stream=True, model="no-such-model")
        r = httpx.post(url + path, json=body, headers=HEADERS, timeout=WAIT)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert loader.calls == 0 and reg.models[0].state == "unloaded"


def test_no_room_is_still_a_503_for_a_stream() -> None:
    """A load that waits for room sends nothing, so "no room" stays a 503 + Retry-After."""
    engines = {
        n: Engine(scripted_model(n), EngineConfig(num_blocks=256)) for n in ("pinned", "other")
    }
    reg = ModelRegistry(
        list(engines),
        loader=lambda src: engines[str(src)].loaded,
        engine_factory=lambda lm: engines[lm.name],
        max_loaded=1,
        pins=["pinned"],
        load_wait=0.5,  # ten ping intervals
    )
    try:
        reg.lease("pinned").release()
        with serve(reg, ServerConfig(ping_interval=0.05)) as srv:
            for dialect in DIALECTS:
                path, body = request(dialect, say("x"), stream=True, model="other")
                r = httpx.post(srv.url + path, json=body, headers=HEADERS, timeout=WAIT)
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
                etype = r.json()["error"]["type"]
                assert etype == ("overloaded_error" if dialect == "anthropic" else "server_error")
    finally:
        reg.close()
        for e in engines.values():
            e.close()


# ------------------------------------------------------------ the registry


def test_a_waiter_that_gives_up_leaves_the_load_to_the_others() -> None:
    loader = GatedLoader()
    reg = ModelRegistry(["lazy"], loader=loader, engine_factory=lambda lm: Engine(lm))

    async def scenario() -> Any:
        quitter = asyncio.ensure_future(reg.get("lazy"))
        stayer = asyncio.ensure_future(reg.get("lazy"))
        while reg.models[0].waiting < 2:
            await asyncio.sleep(0.01)
        quitter.cancel()  # e.g. its client went away
        with pytest.raises(asyncio.CancelledError):
            await quitter
        loader.gate.set()
        return await asyncio.wait_for(stayer, WAIT)

    try:
        lease = asyncio.run(scenario())
        assert loader.calls == 1 and reg.models[0].state == "loaded"
        lease.release()
        assert reg.models[0].active == 0 and reg.models[0].waiting == 0
    finally:
        reg.close()


def test_turns_follow_arrival_and_a_failed_wait_passes_its_turn() -> None:
    loader = GatedLoader(fail=ModelLoadError("no"))
    reg = ModelRegistry(["lazy"], loader=loader, engine_factory=lambda lm: Engine(lm))

    async def scenario() -> list[str]:
        order: list[str] = []

        async def one(tag: str, hold: float = 0.0) -> None:
            lease = await reg.get("lazy")
            await asyncio.sleep(hold)  # a slow prepare
            await lease.turn()
            order.append(tag)
            lease.release()

        first = asyncio.ensure_future(reg.get("lazy"))  # this load fails for all
        while reg.models[0].waiting < 1:
            await asyncio.sleep(0.01)
        loader.gate.set()
        with pytest.raises(ModelLoadError):
            await first
        loader.gate.clear()
        loader.fail = None
        jobs = []
        for i, hold in enumerate([0.3, 0.0, 0.1]):
            jobs.append(asyncio.ensure_future(one(f"r{i}", hold)))
            while reg.models[0].waiting < i + 1:
                await asyncio.sleep(0.01)
        loader.gate.set()
        await asyncio.wait_for(asyncio.gather(*jobs), WAIT)
        return order

    try:
        assert asyncio.run(scenario()) == ["r0", "r1", "r2"]
        assert not reg.models[0]._turns.outstanding()
    finally:
        reg.close()


# ------------------------------------------------------------- official SDKs


@pytest.mark.parametrize("sdk", ["anthropic", "openai-chat", "openai-responses"])
def test_the_sdks_stream_through_a_load(sdk: str) -> None:
    """The SDKs skip the early pings and read the answer (the load is let go only
    once the stream's head came, so the pings did go out first)."""
    import anthropic
    import httpx2
    import openai

    loader = GatedLoader()
    headed = threading.Event()

    def on_response(response: Any) -> None:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            headed.set()

    def release_when_headed() -> None:
        assert headed.wait(WAIT), "the stream never started"
        loader.gate.set()

    with lazy_server(loader) as (url, _, _):
        # The anthropic SDK runs on httpx2 (a fork with the same API), openai on httpx.
        client_class: Any = httpx2.Client if sdk == "anthropic" else httpx.Client
        http = client_class(event_hooks={"response": [on_response]}, timeout=WAIT * 2)
        releaser = threading.Thread(target=release_when_headed, daemon=True)
        releaser.start()
        text = say("through the load")
        if sdk == "anthropic":
            with (
                anthropic.Anthropic(
                    base_url=url, api_key="x", max_retries=0, http_client=http
                ) as client,
                client.messages.stream(
                    model="lazy", max_tokens=40, messages=[{"role": "user", "content": text}]
                ) as s,
            ):
                msg = s.get_final_message()
            got = "".join(b.text for b in msg.content if b.type == "text")
            assert msg.stop_reason == "end_turn"
        elif sdk == "openai-chat":
            with openai.OpenAI(
                base_url=url + "/v1", api_key="x", max_retries=0, http_client=http
            ) as client:
                chunks = client.chat.completions.create(
                    model="lazy",
                    max_tokens=40,
                    stream=True,
                    messages=[{"role": "user", "content": text}],
                )
                got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            with openai.OpenAI(
                base_url=url + "/v1", api_key="x", max_retries=0, http_client=http
            ) as client:
                events = client.responses.create(model="lazy", input=text, stream=True)
                got = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        releaser.join(WAIT)
        assert headed.is_set() and got == "through the load"
