"""The serving engine: continuous batching over a paged KV cache (docs/design.md §1, §4).

Example::

    from mlx_cairn.engine import Engine, EngineConfig
    engine = Engine(loaded_model, EngineConfig(kv_cache_gb=1.0))
    stream = engine.submit(request)        # QueueFull past max_queue
    async for ev in stream:                # TextDelta / ReasoningDelta / ToolCall ... Done | Error
        ...

engine.py is the any-thread API, core.py the engine thread that owns MLX, parts.py
what it is built of (sized from the options), config.py the options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_cairn.engine.config import EngineConfig
    from mlx_cairn.engine.engine import Engine
    from mlx_cairn.engine.request import PreparedRequest
    from mlx_cairn.engine.stream import RequestStream

__all__ = ["Engine", "EngineConfig", "PreparedRequest", "RequestStream"]


def __getattr__(name: str) -> Any:
    # Lazy: mlx_cairn.engine.sampler and friends import without building the engine.
    if name == "Engine":
        from mlx_cairn.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from mlx_cairn.engine.config import EngineConfig

        return EngineConfig
    if name == "PreparedRequest":
        from mlx_cairn.engine.request import PreparedRequest

        return PreparedRequest
    if name == "RequestStream":
        from mlx_cairn.engine.stream import RequestStream

        return RequestStream
    raise AttributeError(f"module 'mlx_cairn.engine' has no attribute {name!r}")
