"""mlx-cairn: a local LLM server on MLX with a Rust core.

Public entry points::

    from mlx_cairn import Engine, EngineConfig   # the serving engine and its options
    from mlx_cairn.text import StopScanner, OutputParser
    from mlx_cairn.kv import BlockPool, PrefixCache
    from mlx_cairn.sse import encode_event, SseDecoder
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_cairn.backends.cpu import blas as _blas

_blas.ensure()  # must run before anything imports mlx.core

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mlx_cairn.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import mlx_cairn.text` does not pull in MLX.
    if name == "Engine":
        from mlx_cairn.engine import Engine

        return Engine
    if name == "EngineConfig":
        from mlx_cairn.engine import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'mlx_cairn' has no attribute {name!r}")
