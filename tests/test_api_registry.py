"""Model names, aliases and load failures (no server needed)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlx_cairn.api.registry import DEFAULT_MODEL_NAME, ModelRegistry, names_for_source
from mlx_cairn.errors import ModelLoadError, ModelNotFound


class _Loaded:
    def __init__(self, name: str) -> None:
        self.name = name


def make(**kw: Any) -> ModelRegistry:
    def loader(src: str | None) -> Any:
        if src and "broken" in src:
            raise OSError("no such file")
        return _Loaded(f"loaded-{src}")

    return ModelRegistry(
        kw.pop("sources", ["/models/Qwen3-0.6B/", "/m/small.gguf", "/m/broken"]),
        loader=loader,
        engine_factory=lambda lm: object(),
        **kw,
    )


def test_names_for_source(tmp_path: Any) -> None:
    assert names_for_source(None) == [DEFAULT_MODEL_NAME]
    assert names_for_source("/a/b/Qwen3-0.6B/") == ["Qwen3-0.6B"]
    assert names_for_source("/a/model.Q4.gguf") == ["model.Q4.gguf", "model.Q4"]
    (tmp_path / "dir.v2").mkdir()
    assert names_for_source(str(tmp_path / "dir.v2")) == ["dir.v2"]


def test_resolution_order() -> None:
    reg = make(aliases={"fast": "small", "claude-haiku-*": "small", "claude-*": "Qwen3-0.6B"})
    assert reg.resolve("Qwen3-0.6B").name == "Qwen3-0.6B"
    assert reg.resolve("small.gguf").name == "small.gguf"
    assert reg.resolve("small").name == "small.gguf"
    assert reg.resolve("fast").name == "small.gguf"
    assert reg.resolve("claude-haiku-4-5").name == "small.gguf"  # first matching glob
    assert reg.resolve("claude-sonnet-4-5").name == "Qwen3-0.6B"
    assert reg.resolve("default").name == "Qwen3-0.6B"
    with pytest.raises(ModelNotFound):
        reg.resolve("gpt-4")


def test_claude_names_need_a_default() -> None:
    with pytest.raises(ModelNotFound):
        make().resolve("claude-sonnet-4-5")
    assert make(default_model="small").resolve("claude-opus-4").name == "small.gguf"
    assert make(default_model="").resolve("claude-opus-4").name == "Qwen3-0.6B"
    with pytest.raises(ModelNotFound):
        make(default_model="small").resolve("other")
    with pytest.raises(ValueError, match="not a served model"):
        make(default_model="nope")
    with pytest.raises(ValueError, match="not served"):
        make(aliases={"x": "nope"})


def test_load_failures_are_remembered_and_isolated() -> None:
    reg = make()
    with pytest.raises(ModelLoadError, match="failed to load"):
        asyncio.run(reg.get("broken"))
    with pytest.raises(ModelLoadError):
        asyncio.run(reg.get("broken"))
    sm = asyncio.run(reg.get("small"))
    assert sm.engine is not None
    assert reg.resolve("loaded-/m/small.gguf") is sm.served  # the loader's own name too
    reg.load_all()  # logs the broken one, does not raise
