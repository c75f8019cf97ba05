"""Models by name: hub names from a local HF cache, --models-dir, lazy single-flight
loading, LRU unloading under a budget, pins, idle unload. Nothing here touches the network."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_cairn.api.registry import ModelRegistry, names_for_source, scan_models_dir
from mlx_cairn.errors import ModelLoadError, ModelUnavailable, error_kind
from mlx_cairn.models import hub
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Error, Message, SamplingParams, TextDelta

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("named-models")
    return {
        "a": save_folder(tiny_model("qwen3", seed=1), root / "dir" / "tiny-a"),
        "b": save_folder(tiny_model("llama", seed=2), root / "dir" / "nested" / "tiny-b"),
        "c": save_folder(tiny_model("qwen2", seed=3), root / "dir" / "tiny-c"),
    }


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def chat(text: str = "Hello") -> ChatRequest:
    return ChatRequest(
        messages=[Message("user", text)], max_tokens=6, sampling=SamplingParams(temperature=0)
    )


async def answer(reg: ModelRegistry, name: str, text: str = "Hello") -> str:
    lease = await reg.get(name)
    prepared = await asyncio.to_thread(lease.engine.prepare, chat(text))
    out = []
    async for ev in lease.engine.submit(prepared):
        if isinstance(ev, TextDelta):
            out.append(ev.text)
        elif isinstance(ev, Error):
            raise AssertionError(ev)
    return "".join(out)


# ------------------------------------------------------------------ hub names


def test_hub_names_parse_and_name_the_model() -> None:
    assert hub.is_hub_name("mlx-community/Qwen3-4B-4bit")
    assert hub.is_hub_name("org/name@v1.0")
    assert not hub.is_hub_name("/abs/path") and not hub.is_hub_name("a/b.gguf")
    assert hub.split_name("org/name@abc") == ("org/name", "abc")
    assert names_for_source("mlx-community/Qwen3-4B-4bit") == [
        "mlx-community/Qwen3-4B-4bit",
        "Qwen3-4B-4bit",
    ]
    assert names_for_source("org/m@v2") == ["org/m@v2", "org/m", "m"]


def test_a_cached_hub_model_loads_offline(folders: dict[str, Path], offline_cache: Path) -> None:
    assert hub.cache_dir() == offline_cache and hub.offline()
    hub.write_cache_entry(offline_cache, "org/tiny-a", folders["a"])
    snap_v2 = hub.write_cache_entry(offline_cache, "org/tiny-a", folders["c"], revision="v2")
    reg = ModelRegistry(["org/tiny-a", "org/tiny-a@v2"], aliases={"fast": "tiny-a"})
    try:
        assert not any(sm.engine for sm in reg.models)  # nothing loads before a request
        assert reg.resolve("fast").name == "org/tiny-a"
        lease = asyncio.run(reg.get("fast"))
        assert lease.loaded.model.args.model_type == "qwen3"
        lease.release()
        v2 = reg.lease("org/tiny-a@v2")
        assert v2.loaded.model.args.model_type == "qwen2"
        v2.release()
        assert hub.resolve(f"org/tiny-a@{snap_v2.name}") == snap_v2  # a commit works too
    finally:
        reg.close()


def test_a_missing_hub_model_says_why(offline_cache: Path) -> None:
    reg = ModelRegistry(["org/absent"])
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        asyncio.run(reg.get("absent"))
    assert "HF_HUB_OFFLINE" in (reg.models[0].error or "")
    assert reg.models[0].describe()["state"] == "unloaded"


# ---------------------------------------------------------------- models dir


def test_models_dir_offers_every_folder_and_gguf(folders: dict[str, Path]) -> None:
    root = folders["a"].parent
    (root / "loose.gguf").write_bytes(b"GGUF")
    found = scan_models_dir(root)
    assert [Path(f).name for f in found] == ["loose.gguf", "tiny-b", "tiny-a", "tiny-c"]
    reg = ModelRegistry([], models_dir=root, loader=lambda s: s, engine_factory=lambda lm: lm)
    ids = {i.id: i.loaded for i in reg.listing()}
    assert ids == {
        "loose.gguf": False,
        "loose": False,
        "tiny-a": False,
        "tiny-b": False,
        "tiny-c": False,
    }
    (root / "loose.gguf").unlink()


# ------------------------------------------------------ single-flight loading


def test_concurrent_requests_wait_for_one_load_and_share_its_failure() -> None:
    calls: list[str | None] = []
    gate = threading.Event()
    fail = [True]

    def loader(src: str | None) -> Any:
        calls.append(src)
        gate.wait(10)
        if fail[0]:
            raise OSError("disk on fire")
        return object()

    reg = ModelRegistry(["/m/one"], loader=loader, engine_factory=lambda lm: object())

    async def many() -> list[Any]:
        tasks = [asyncio.ensure_future(reg.get("one")) for _ in range(6)]
        await asyncio.sleep(0.2)
        assert reg.models[0].waiting == 6 and reg.models[0].state == "loading"
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(many())
    assert len(calls) == 1
    assert all(isinstance(r, ModelLoadError) and "disk on fire" in r.message for r in results)
    fail[0] = False  # a later request retries
    lease = asyncio.run(reg.get("one"))
    assert len(calls) == 2 and reg.models[0].error is None
    lease.release()
    assert reg.models[0].active == 0


# ------------------------------------------------------------ budgets, swaps


def test_swapping_under_load_with_room_for_one(folders: dict[str, Path]) -> None:
    paths = [str(folders["a"]), str(folders["b"])]
    with ModelRegistry(paths, max_loaded=1) as reg:
        expect = {}
        for name in ("tiny-a", "tiny-b"):
            expect[name] = asyncio.run(answer(reg, name))
        assert expect["tiny-a"] != expect["tiny-b"]

        async def storm() -> list[tuple[str, str]]:
            names = ["tiny-a", "tiny-b"] * 6
            outs = await asyncio.gather(*(answer(reg, n) for n in names))
            return list(zip(names, outs, strict=True))

        for name, out in asyncio.run(storm()):
            assert out == expect[name], name
        loaded = [sm for sm in reg.models if sm.engine is not None]
        assert len(loaded) == 1 and all(sm.active == 0 and sm.waiting == 0 for sm in reg.models)
        assert sum(sm.unloads for sm in reg.models) >= 2
        assert_at_rest(loaded[0].engine)


def test_no_room_and_nothing_can_go_is_503(folders: dict[str, Path]) -> None:
    reg = ModelRegistry(
        [str(folders["a"]), str(folders["b"])], max_loaded=1, pins=["tiny-a"], load_wait=0.3
    )
    try:
        reg.lease("tiny-a").release()
        with pytest.raises(ModelUnavailable) as e:
            reg.lease("tiny-b")
        assert e.value.retry_after >= 1 and "pinned or serving" in e.value.message
        row = error_kind(e.value.kind)
        assert (row.status, row.anthropic, row.openai) == (503, "overloaded_error", "server_error")
        assert reg.models[0].engine is not None  # the pin held
        assert reg.models[1].state == "unloaded"  # and a later request may try again
    finally:
        reg.close()


def test_a_busy_model_is_not_unloaded_until_its_lease_ends(folders: dict[str, Path]) -> None:
    reg = ModelRegistry([str(folders["a"]), str(folders["b"])], max_loaded=1, load_wait=10)
    try:
        held = reg.lease("tiny-a")
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(reg.lease("tiny-b")))
        t.start()
        time.sleep(0.3)
        assert reg.models[0].engine is not None and not got  # b waits for a
        held.release()
        t.join(10)
        assert got and reg.models[0].engine is None and reg.models[1].engine is not None
        got[0].release()
    finally:
        reg.close()


def test_memory_budget_counts_measured_sizes(folders: dict[str, Path]) -> None:
    with ModelRegistry([str(folders["a"])]) as probe:
        probe.lease("tiny-a").release()
        size = probe.models[0].memory_bytes
    assert size > 0
    # Room for tiny-a (qwen3, the largest) alone or the two others; sizes are disk guesses until measured.
    reg = ModelRegistry(
        [str(f) for f in folders.values()], memory_budget_gb=1.2 * size / 2**30, load_wait=1
    )
    try:
        for name in ("tiny-a", "tiny-c", "tiny-b", "tiny-a", "tiny-c"):
            reg.lease(name).release()
            loaded = [sm for sm in reg.models if sm.engine is not None]
            used = sum(sm.memory_bytes for sm in loaded)
            assert used <= reg.lifecycle.memory_budget or len(loaded) == 1, name
            assert reg.resolve(name).engine is not None
        assert sum(sm.unloads for sm in reg.models) >= 3
    finally:
        reg.close()


def test_idle_unload_gives_memory_back(folders: dict[str, Path]) -> None:
    import mlx.core as mx

    reg = ModelRegistry([str(folders["a"])], idle_unload=0.2)
    try:
        before = mx.get_active_memory()
        asyncio.run(answer(reg, "tiny-a"))
        loaded = mx.get_active_memory()
        assert loaded > before
        deadline = time.monotonic() + 10
        while reg.models[0].state != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reg.models[0].state == "unloaded" and reg.models[0].unloads == 1
        assert mx.get_active_memory() <= before + (loaded - before) // 10
        assert asyncio.run(answer(reg, "tiny-a"))  # and loads again on the next request
    finally:
        reg.close()


# ------------------------------------------------------------------ over HTTP


def test_http_lists_unloaded_models_loads_on_request_and_reports(folders: dict[str, Path]) -> None:
    from fastapi.testclient import TestClient

    from mlx_cairn.api import ServerConfig, create_app

    reg = ModelRegistry(
        [str(folders["a"]), str(folders["b"])], max_loaded=1, pins=["tiny-a"], load_wait=0.2
    )
    key = {"x-api-key": "k"}
    body = {"model": "tiny-a", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    with TestClient(create_app(reg, ServerConfig(api_token="k"))) as c:
        listing = c.get("/v1/models", headers=key).json()["data"]
        assert {m["id"]: m["loaded"] for m in listing} == {"tiny-a": False, "tiny-b": False}
        r = c.post("/v1/messages", json=body, headers={**key, "anthropic-version": "2023-06-01"})
        assert r.status_code == 200, r.text
        health = {m["name"]: m for m in c.get("/health", headers=key).json()["models"]}
        a = health["tiny-a"]
        assert a["state"] == "loaded" and a["memory_bytes"] > 0 and a["load_seconds"] > 0
        assert a["last_used"] and a["pinned"] and health["tiny-b"]["state"] == "unloaded"
        text = c.get("/metrics", headers=key).text
        assert 'cairn_model_memory_bytes{model="tiny-a"}' in text
        assert 'cairn_model_loads_total{model="tiny-a"} 1.0' in text
        # tiny-a is pinned and there is room for one: tiny-b cannot load.
        r = c.post(
            "/v1/messages",
            json={**body, "model": "tiny-b"},
            headers={**key, "anthropic-version": "2023-06-01"},
        )
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "overloaded_error"
        r = c.post("/v1/chat/completions", json={**body, "model": "tiny-b"}, headers=key)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    reg.close()


# ----------------------------------------------------- property: schedules


_ANSWERS: dict[str, str] = {}


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.sampled_from(["tiny-a", "tiny-b", "tiny-c"]), min_size=1, max_size=5),
        min_size=1,
        max_size=4,
    ),
    cancel_some=st.booleans(),
)
def test_any_schedule_over_three_models_with_room_for_two(
    folders: dict[str, Path], batches: list[list[str]], cancel_some: bool
) -> None:
    with ModelRegistry([str(f) for f in folders.values()], max_loaded=2, load_wait=30) as reg:
        if not _ANSWERS:
            for name in ("tiny-a", "tiny-b", "tiny-c"):
                _ANSWERS[name] = asyncio.run(answer(reg, name))

        async def cancelled(name: str) -> None:
            lease = await reg.get(name)
            prepared = await asyncio.to_thread(lease.engine.prepare, chat())
            stream = lease.engine.submit(prepared)
            stream.cancel()

        async def run_batch(names: list[str]) -> list[str]:
            jobs = [answer(reg, n) for n in names]
            extra = [cancelled(names[0])] if cancel_some else []
            outs = await asyncio.wait_for(asyncio.gather(*jobs, *extra), timeout=60)
            return list(outs[: len(names)])

        for names in batches:
            outs = asyncio.run(run_batch(names))
            assert outs == [_ANSWERS[n] for n in names]
            assert sum(sm.engine is not None for sm in reg.models) <= 2
        assert all(sm.active == 0 and sm.waiting == 0 for sm in reg.models)
        for sm in reg.models:
            if sm.engine is not None:
                assert_at_rest(sm.engine)


def test_a_failed_load_is_each_dialects_server_error_and_flags_build_the_registry(
    folders: dict[str, Path],
) -> None:
    import argparse

    from fastapi.testclient import TestClient

    from mlx_cairn.api import create_app
    from mlx_cairn.cli.serve import add_arguments, build

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = f"--models-dir {folders['a'].parent} --model /nonexistent/broken"
    argv += " --max-loaded-models 2 --pin tiny-a --idle-unload 30 --memory-budget-gb 4"
    args = p.parse_args([*argv.split(), "--load-wait", "5", "--alias", "claude-*=tiny-c"])
    reg, config = build(args, {})
    life = reg.lifecycle
    try:
        assert (life.max_loaded, life.idle_unload, life.load_wait) == (2, 30, 5)
        assert life.memory_budget == 4 * 2**30 and reg.resolve("tiny-a").pinned
        assert reg.resolve("claude-sonnet-4-5").name == "tiny-c"  # before it is loaded
        assert all(sm.engine is None for sm in reg.models)
        body = {"model": "broken", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        with TestClient(create_app(reg, config)) as c:
            r = c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
            assert "failed to load" in r.json()["error"]["message"]
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            r = c.post("/v1/chat/completions", json={**body, "model": "claude-x"})
            assert r.status_code == 200, r.text
    finally:
        reg.close()
