"""The FastAPI app factory: dialect routers behind one gate, shared routes, errors.

Adding a dialect: write ``mlx_cairn/api/<name>.py`` exposing ``DIALECT`` (a
:class:`~mlx_cairn.api.dialects.Dialect`) and ``router`` (an ``APIRouter``),
and append its module name to :data:`DIALECT_MODULES`. Its routes are then
behind the auth gate and the body limit, and every error raised in them
(:class:`~mlx_cairn.errors.CairnError`) is rendered in its envelope.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from mlx_cairn import __version__
from mlx_cairn.api.auth import Gate, is_authenticated, token_digest
from mlx_cairn.api.dialects import DialectSet, error_response, response_for
from mlx_cairn.api.metrics import install as install_metrics
from mlx_cairn.api.openapi import install as install_openapi
from mlx_cairn.api.registry import ModelRegistry
from mlx_cairn.api.state import AppState, ServerConfig, app_state, json_response
from mlx_cairn.errors import CairnError

log = logging.getLogger("mlx_cairn.api")

#: Dialect modules served by every app, in lookup order.
DIALECT_MODULES: list[str] = [
    "mlx_cairn.api.anthropic",
    "mlx_cairn.api.openai_chat",
    "mlx_cairn.api.openai_responses",
]

_HTTP_KINDS = {404: "not_found", 405: "invalid_request", 413: "too_large"}


def create_app(registry: ModelRegistry, config: ServerConfig | None = None) -> FastAPI:
    """Build the ASGI app serving ``registry``'s models with ``config``."""
    config = config or ServerConfig()
    digest = token_digest(config.api_token) if config.api_token is not None else None
    modules = [importlib.import_module(m) for m in DIALECT_MODULES]
    dialects = DialectSet(m.DIALECT for m in modules)

    app = FastAPI(title="mlx-cairn", version=__version__, docs_url=None, redoc_url=None)
    app.state.cairn = AppState(registry, config, dialects)
    for m in modules:
        app.include_router(m.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])

    @app.exception_handler(CairnError)
    async def _typed(request: Request, exc: CairnError) -> Response:
        return response_for(dialects.for_scope(request.scope), exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        kind = _HTTP_KINDS.get(exc.status_code, "invalid_request")
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(
            dialects.for_scope(request.scope),
            exc.status_code,
            kind,
            message,
            headers=dict(exc.headers or {}),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(dialects.for_scope(request.scope), 400, "invalid_request", str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(
            dialects.for_scope(request.scope), 500, "internal", "internal server error"
        )

    # Outermost: every route, present and future, is behind the gate.
    app.add_middleware(Gate, dialects=dialects, digest=digest, max_body_bytes=config.max_body_bytes)
    install_metrics(app)  # GET /metrics (behind the gate) + a request counter around everything
    install_openapi(app)  # request-body schemas in /openapi.json
    return app


async def health(request: Request) -> Response:
    """Liveness for anyone; models, queue and block-pool figures for authenticated callers."""
    if not is_authenticated(request.scope):
        return json_response({"status": "ok"})
    state = app_state(request)
    models: list[dict[str, Any]] = []
    for sm in state.registry.models:
        entry: dict[str, Any] = {
            "name": sm.name,
            "names": list(sm.names),
            "loaded": sm.engine is not None,
        }
        if sm.error is not None:
            entry["error"] = sm.error
        if sm.engine is not None:
            entry["stats"] = await asyncio.to_thread(sm.engine.stats)
        models.append(entry)
    return json_response({"status": "ok", "version": __version__, "models": models})


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` in the shape of the caller's dialect."""
    state = app_state(request)
    dialect = state.dialects.for_scope(request.scope)
    listing = state.registry.listing()
    if dialect.models_body is None:  # pragma: no cover - every dialect defines one
        dialect = state.dialects.dialects[0]
    assert dialect.models_body is not None
    return json_response(dialect.models_body(listing))
