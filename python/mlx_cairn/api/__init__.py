"""The HTTP server: app factory, auth gate, dialect routes (docs/design.md §1, §6).

Example::

    from mlx_cairn.api import ModelRegistry, ServerConfig, create_app

    app = create_app(ModelRegistry([None]), ServerConfig(api_token="secret"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_cairn.api.app import create_app
    from mlx_cairn.api.registry import ModelRegistry
    from mlx_cairn.api.settings import ServerConfig

__all__ = ["ModelRegistry", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy so that `cairn --help` and the CLI parser do not import FastAPI.
    if name == "create_app":
        from mlx_cairn.api.app import create_app

        return create_app
    if name == "ModelRegistry":
        from mlx_cairn.api.registry import ModelRegistry

        return ModelRegistry
    if name == "ServerConfig":
        from mlx_cairn.api.settings import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'mlx_cairn.api' has no attribute {name!r}")
