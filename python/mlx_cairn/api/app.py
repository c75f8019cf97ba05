"""The FastAPI app factory: dialect routers behind one gate, shared routes, errors.

Adding a dialect: write ``mlx_cairn/api/<name>.py`` exposing ``DIALECT`` (a
:class:`~mlx_cairn.api.dialects.Dialect`) and ``router`` (an ``APIRouter``),
and append its module name to :data:`DIALECT_MODULES`. Its routes are then
behind the auth gate and the body limit, and every error raised in them
(:class:`~mlx_cairn.errors.CairnError`) is rendered in its envelope.

Layers, outermost first (a request goes down, its response comes back up)::

    Cors            only with --cors-origin: answers preflights, adds the headers
    ServerErrorMiddleware   unhandled exception -> 500 envelope
    RequestCounter  /metrics counts every answer below, 401s and 413s included
    Gate            auth, then the body limit and read timeout
    ExceptionMiddleware     CairnError / HTTPException -> the dialect's envelope
    routes

CORS sits above everything so that every answer to an allowed origin carries
its headers (the gate's 401s and the 500s too) and preflights, which carry no
credentials, never reach the gate.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Collection, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_cairn import __version__
from mlx_cairn.api.auth import Gate, is_authenticated, token_digest
from mlx_cairn.api.dialects import Dialect, DialectSet, error_response, log_safe, response_for
from mlx_cairn.api.metrics import install as install_metrics
from mlx_cairn.api.openapi import install as install_openapi
from mlx_cairn.api.registry import ModelRegistry
from mlx_cairn.api.settings import AppState, ServerConfig, app_state, json_response
from mlx_cairn.errors import CairnError, kind_for_status

log = logging.getLogger("mlx_cairn.api")

#: Dialect modules served by every app, in lookup order.
DIALECT_MODULES: list[str] = [
    "mlx_cairn.api.anthropic",
    "mlx_cairn.api.openai_chat",
    "mlx_cairn.api.openai_responses",
    "mlx_cairn.api.openai_completions",
    "mlx_cairn.api.llama_infill",
    "mlx_cairn.api.ollama",
    "mlx_cairn.api.embeddings",
    "mlx_cairn.api.ollama_embed",
]

#: Methods a browser script may use here (OPTIONS is the preflight itself).
CORS_METHODS = ("GET", "HEAD", "POST", "DELETE", "OPTIONS")
#: Request headers a browser may send besides the CORS-safelisted ones (Accept,
#: Accept-Language, Content-Language, Content-Type: CORSMiddleware always allows
#: those): what the official anthropic and openai SDKs (Python and TypeScript)
#: and Claude Code send. tests/test_api_cors.py checks the installed SDKs against it.
CORS_ALLOW_HEADERS = (
    "authorization",
    "x-api-key",
    "user-agent",
    "idempotency-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "openai-organization",
    "openai-project",
    "openai-beta",
    "x-stainless-arch",
    "x-stainless-async",
    "x-stainless-custom-event-handler",
    "x-stainless-custom-poll-interval",
    "x-stainless-helper",
    "x-stainless-helper-method",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-poll-helper",
    "x-stainless-raw-response",
    "x-stainless-read-timeout",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-stream-helper",
    "x-stainless-timeout",
)
#: Response headers a browser script may read (the SDKs' retry timing, cache figures).
CORS_EXPOSE_HEADERS = ("retry-after", "x-session-cache", "x-cached-tokens")


class Cors:
    """Starlette's CORSMiddleware, for requests from an allowed origin only.

    A request with no ``Origin`` or another one passes by untouched (only
    ``Vary: Origin`` is added when the answer depends on the origin), so it
    gets no CORS header at all and its ``OPTIONS`` is answered as without the
    flag (401 behind a token, else 405). A preflight the middleware refuses
    (a method or header it does not allow) is logged like every other 4xx.
    """

    def __init__(self, app: ASGIApp, origins: Collection[str]) -> None:
        self.app = app
        self.cors = CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=CORS_METHODS,
            allow_headers=CORS_ALLOW_HEADERS,
            expose_headers=CORS_EXPOSE_HEADERS,
            # A page on the web calling this server on localhost is the point
            # of the flag: Chrome's private-network preflight must pass too.
            allow_private_network=True,
        )
        self.vary = "*" not in origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or not self.cors.is_allowed_origin(origin):
            await self.app(scope, receive, self._vary(send) if self.vary else send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            resp = self.cors.preflight_response(request_headers=headers)
            if resp.status_code >= 400:
                log.info(
                    "%d OPTIONS %s: cors: %s (method %s, headers %s)",
                    resp.status_code,
                    log_safe(scope["path"]),
                    bytes(resp.body).decode(),
                    log_safe(headers["access-control-request-method"], 100),
                    log_safe(headers.get("access-control-request-headers", ""), 500),
                )
            await resp(scope, receive, send)
            return
        await self.cors.simple_response(scope, receive, send, request_headers=headers)

    @staticmethod
    def _vary(send: Send) -> Send:
        async def wrapped(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg.setdefault("headers", [])
                MutableHeaders(scope=msg).add_vary_header("Origin")
            await send(msg)

        return wrapped


class CairnApp(FastAPI):
    """FastAPI with :class:`Cors` (when origins are set) around the whole stack.

    ``add_middleware`` can only place middleware inside FastAPI's own
    ServerErrorMiddleware, where the 500s it sends would miss the CORS headers.
    """

    cors_origins: tuple[str, ...] = ()

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return Cors(stack, self.cors_origins) if self.cors_origins else stack


def create_app(registry: ModelRegistry, config: ServerConfig | None = None) -> FastAPI:
    """Build the ASGI app serving ``registry``'s models with ``config``."""
    config = config or ServerConfig()
    digest = token_digest(config.api_token) if config.api_token is not None else None
    modules = [importlib.import_module(m) for m in DIALECT_MODULES]
    dialects = DialectSet(m.DIALECT for m in modules)

    # No trailing-slash redirects: their Location would echo the request's Host
    # (the gate drops a trailing slash instead, so /v1/messages/ is served).
    app = CairnApp(
        title="mlx-cairn",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.cors_origins = tuple(config.cors_origins)
    app.state.cairn = AppState(registry, config, dialects)
    for m in modules:
        app.include_router(m.router)
    for path, probe in (("/", root), ("/health", health)):
        app.add_api_route(path, probe, methods=["GET"])
        # HEAD is GET without the body; one route per method keeps OpenAPI ids unique.
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    # What sglang-router asks each worker at registration (and sglang's older names).
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])

    @app.exception_handler(CairnError)
    async def _typed(request: Request, exc: CairnError) -> Response:
        return response_for(dialects.for_scope(request.scope), exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        kind = kind_for_status(exc.status_code)
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
    app.add_middleware(
        Gate,
        dialects=dialects,
        digest=digest,
        max_body_bytes=config.max_body_bytes,
        body_timeout=config.body_timeout,
    )
    install_metrics(app)  # GET /metrics (behind the gate) + a request counter around everything
    install_openapi(app)  # request-body schemas in /openapi.json
    return app


async def root(request: Request) -> Response:
    """``GET /`` and ``HEAD /`` (Claude Code's and Ollama clients' start-up probe): liveness.

    ``Ollama is running`` in plain text, the answer Ollama clients look for;
    a caller that asks for JSON (``Accept: application/json``) gets it as
    ``/health`` does, with the server's name and version once authenticated.
    """
    if "application/json" not in request.headers.get("accept", ""):
        return PlainTextResponse("Ollama is running")
    if not is_authenticated(request.scope):
        return json_response({"status": "ok"})
    return json_response({"status": "ok", "name": "mlx-cairn", "version": __version__})


async def health(request: Request) -> Response:
    """Liveness for anyone; models, queue and block-pool figures for authenticated callers."""
    if not is_authenticated(request.scope):
        return json_response({"status": "ok"})
    state = app_state(request)
    models: list[dict[str, Any]] = []
    for sm in state.registry.models:
        # State, memory, last use, load time, download progress (registry.ServedModel.describe).
        entry: dict[str, Any] = sm.describe()
        engine = sm.engine
        if engine is not None:
            entry["stats"] = (await asyncio.to_thread(engine.stats)).as_dict()
        models.append(entry)
    return json_response({"status": "ok", "version": __version__, "models": models})


def _model_info(state: AppState) -> dict[str, Any]:
    """sglang's ``/model_info`` for the first served model (the one ``default`` names):
    ``model_path`` is the name requests use, so a router keys its workers by it."""
    from mlx_cairn.models.embedding import model_kind

    sm = state.registry.models[0]
    info = state.registry.info(sm.name)
    body: dict[str, Any] = {
        "model_path": sm.name,
        "tokenizer_path": None,
        "served_model_name": sm.name,
        "is_generation": model_kind(sm.loaded, sm.source) != "embedding",
        "preferred_sampling_params": None,
        "weight_version": "default",
        "supports_vision": bool(info.vision),
        "has_image_understanding": bool(info.vision),
        "has_audio_understanding": False,
        "max_context_length": info.context_length,
        "max_req_input_len": info.context_length,
    }
    loaded = sm.loaded
    if loaded is not None:
        eos = sorted(int(t) for t in getattr(loaded, "eos_token_ids", ()) or ())
        body["eos_token_ids"] = eos
    return body


async def model_info(request: Request) -> Response:
    """``GET /model_info`` (and ``/get_model_info``): sglang's model description,
    which sglang-router reads when a worker registers (docs/routers.md)."""
    return json_response(_model_info(app_state(request)))


async def server_info(request: Request) -> Response:
    """``GET /server_info`` (and ``/get_server_info``): sglang's server description
    (its server arguments and version), for sglang-router's worker registration."""
    state = app_state(request)
    sm = state.registry.models[0]
    engine = sm.engine
    body = _model_info(state)
    body.update(
        {
            "version": __version__,
            "server": "mlx-cairn",
            "context_length": body["max_context_length"],
            "page_size": getattr(engine, "block_size", None),
            "tp_size": 1,
            "dp_size": 1,
        }
    )
    return json_response(body)


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` in the shape of the caller's dialect, with ``loaded`` on each entry."""
    state = app_state(request)
    infos = state.registry.listing()
    return json_response(_with_loaded(_models_body(state.dialects, request.scope)(infos), infos))


async def get_model(request: Request, model_id: str) -> Response:
    """``GET /v1/models/{id}``: the same entry as in the listing, in the caller's shape.

    The id resolves as in a generation request (aliases, globs, ``default``,
    ``--default-model``) without loading anything; an unknown one is a 404.
    """
    state = app_state(request)
    info = state.registry.info(model_id)
    body = _with_loaded(_models_body(state.dialects, request.scope)([info]), [info])
    return json_response(body["data"][0])


def _with_loaded(body: dict[str, Any], infos: list[Any]) -> dict[str, Any]:
    """Add ``loaded`` (bool) to each entry of either shape: every name that can be
    served is listed, loaded or not (it loads on the first request that names it);
    and ``capabilities.vision``: whether the model takes images."""
    for entry, info in zip(body["data"], infos, strict=True):
        entry["loaded"] = bool(info.loaded)
        entry["capabilities"] = {"vision": bool(info.vision)}
    return body


def _models_body(
    dialects: DialectSet, scope: MutableMapping[str, Any]
) -> Callable[..., dict[str, Any]]:
    dialect: Dialect = dialects.for_scope(scope)
    if dialect.models_body is None:  # pragma: no cover - every dialect defines one
        dialect = dialects.default
    assert dialect.models_body is not None
    return dialect.models_body
