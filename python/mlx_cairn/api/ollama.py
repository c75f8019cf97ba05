"""The Ollama API: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``; model management answers 501.

Clients that speak only Ollama's API (Open WebUI, the ``ollama`` Python and
JS libraries, Raycast, Home Assistant, ...) point their base URL at this
server (they default to port 11434: ``cairn serve --port 11434``). Every
route is behind the same auth gate as the others; errors are Ollama's
``{"error": "..."}`` with the status of the error table (:mod:`mlx_cairn.errors`).

- Generation (:func:`chat`, :func:`generate`) runs on the shared runner:
  NDJSON lines when ``stream`` is true (Ollama's default), else one JSON
  object that is the fold of those very lines (:mod:`mlx_cairn.protocol.ollama_stream`).
  A body with no messages / no prompt only loads the model (``done_reason:
  "load"``) or with ``keep_alive: 0`` unloads it (``"unload"``).
- Model names are the server's (``/api/tags`` lists them), aliases, hub names
  and ``default``; a ``:latest`` tag, which Ollama clients add, is dropped
  when the name without it is served.
- ``/api/embed`` and ``/api/embeddings`` live in their own module.
- ``/api/pull`` of a served name answers ``success`` (it is here already),
  so clients that pull before use go on; ``pull`` of anything else, ``push``,
  ``create``, ``copy``, ``delete`` and ``blobs`` are 501 Not Implemented:
  the request is well formed, this server just does not manage models (it
  serves what ``cairn serve`` was started with), and 501 tells clients not to
  retry where 400 would blame their request.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn import __version__
from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.registry import ModelRegistry, ServedModel
from mlx_cairn.api.respond import serve_generation
from mlx_cairn.api.settings import AppState, app_state, json_response, read_json
from mlx_cairn.errors import InvalidRequest, ModelNotFound, NotSupported
from mlx_cairn.protocol.codec import check_depth, required_model
from mlx_cairn.protocol.images import ImageReader, takes_images
from mlx_cairn.protocol.ollama import (
    LoadRequest,
    OllamaRequest,
    Shape,
    error_body,
    load_request,
    parse_chat_request,
    parse_generate_request,
)
from mlx_cairn.protocol.ollama_stream import OllamaCodec, created_at

DIALECT = Dialect(name="ollama", prefixes=("/api",), error_body=error_body)

router = APIRouter()

#: The Ollama release whose API this dialect follows (routes, fields, ``think``,
#: tool calls with ids). ``/api/version`` reports it: clients gate features on it.
OLLAMA_API_VERSION = "0.12.0"
#: ``expires_at`` of a model that is never unloaded (as far as Ollama's own "forever").
NEVER = "2318-01-01T00:00:00Z"


# ------------------------------------------------------------------ generation


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    """Ollama chat: NDJSON lines, or one JSON object with ``"stream": false``."""
    return await _generation(request, "chat")


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    """Ollama generate: a prompt (templated, ``raw``, or fill-in-the-middle with ``suffix``)."""
    return await _generation(request, "generate")


async def _generation(request: Request, shape: Shape) -> Response:
    arrived = time.perf_counter_ns()
    state = app_state(request)
    body = await read_json(request)
    load = load_request(body, shape)
    if load is not None:
        check_depth(body)  # as every body (the runner checks the others)
        return await _load_only(state, load)
    parse = parse_chat_request if shape == "chat" else parse_generate_request

    def parsed(b: Any, st: AppState) -> OllamaRequest:
        req = parse(
            b, max_tokens_limit=st.config.max_tokens_limit, images=ImageReader(st.config.images)
        )
        # Leased under its served name; the answers echo the name as written.
        req.model = req.chat.model = served_name(st.registry, req.echo)
        return req

    def codec(req: OllamaRequest, st: AppState, sm: ServedModel, input_tokens: int) -> OllamaCodec:
        st.registry.keep_alive(sm.name, req.keep_alive)  # Ollama: each request sets it
        return OllamaCodec(
            model=req.echo,
            shape=req.shape,
            allow_tools=req.chat.offers_tools,
            logprobs=req.chat.sampling.logprobs,
            arrived_ns=arrived,
        )

    return await serve_generation(request, DIALECT, parsed, codec, body=body)


async def _load_only(state: AppState, load: LoadRequest) -> Response:
    """Load a model ahead of its first request, or with ``keep_alive: 0`` unload it."""
    name = served_name(state.registry, load.model)
    if load.keep_alive == 0:
        state.registry.keep_alive(name, 0)  # busy now: it goes when its requests end
        await asyncio.to_thread(state.registry.unload, name)
        reason = "unload"
    else:
        lease = await state.registry.get(name)
        lease.release()
        state.registry.keep_alive(name, load.keep_alive)
        reason = "load"
    body: dict[str, Any] = {"model": load.model, "created_at": created_at()}
    if load.shape == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done=True, done_reason=reason)
    return json_response(body)


def served_name(registry: ModelRegistry, name: str) -> str:
    """``name`` as the registry knows it: a ``:latest`` tag that is not part of a served
    name is dropped (Ollama clients add it). Raises ModelNotFound (404) for none.

    Example: ``served_name(registry, "SmolLM2-135M-Instruct:latest")``.
    """
    try:
        registry.resolve(name)
        return name
    except ModelNotFound:
        if not name.endswith(":latest"):
            raise
        bare = name.removesuffix(":latest")
        registry.resolve(bare)
        return bare


# ------------------------------------------------------------------ models


@router.get("/api/version")
async def version(request: Request) -> Response:
    """``{"version": ...}``: the Ollama API version followed, and this server's own."""
    return json_response(
        {"version": OLLAMA_API_VERSION, "server": "mlx-cairn", "server_version": __version__}
    )


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    """Every name a request may use, loaded or not (as ``/v1/models``)."""
    state = app_state(request)
    models = []
    for info in state.registry.listing():
        sm = state.registry.resolve(info.id)
        models.append({"name": info.id, "model": info.id, **_summary(sm)})
    return json_response({"models": models})


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    """The models loaded now, with when they will be unloaded if left idle."""
    state = app_state(request)
    registry = state.registry
    models = []
    for sm in registry.models:
        if sm.engine is None:
            continue
        limit = registry.idle_limit(sm)
        expires = NEVER if limit is None else _iso((sm.last_used or time.time()) + limit)
        entry = {"name": sm.name, "model": sm.name, **_summary(sm), "expires_at": expires}
        # Apple silicon's memory is the GPU's; elsewhere MLX runs on the CPU here.
        entry["size_vram"] = entry["size"] if sys.platform == "darwin" else 0
        entry["context_length"] = sm.context_length
        models.append(entry)
    return json_response({"models": models})


@router.post("/api/show")
async def show(request: Request) -> Response:
    """Details of one model: template, context length, capabilities. Loads it when it
    has never been loaded (what it can do is read from the model itself)."""
    state = app_state(request)
    body = await read_json(request)
    check_depth(body)
    if isinstance(body, dict) and "model" not in body and isinstance(body.get("name"), str):
        body = {**body, "model": body["name"]}  # the older spelling
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    name = served_name(state.registry, required_model(body))
    lease = await state.registry.get(name)
    try:
        facts = _facts(lease.loaded)
    finally:
        lease.release()
    sm = state.registry.resolve(name)
    ctx = sm.context_length or facts["context_length"]
    arch = facts["family"] or "unknown"
    return json_response(
        {
            "license": "",
            "modelfile": f"# served by mlx-cairn\nFROM {sm.source or sm.name}\n"
            f"PARAMETER num_ctx {ctx}\n",
            "parameters": f"num_ctx {ctx}",
            "template": facts["template"],
            "details": _details(sm, facts),
            "model_info": {
                "general.architecture": arch,
                "general.basename": sm.name,
                "general.parameter_count": facts["parameters"],
                f"{arch}.context_length": ctx,
            },
            "capabilities": facts["capabilities"],
            "modified_at": _iso(sm.created),
        }
    )


def _summary(sm: ServedModel) -> dict[str, Any]:
    """The fields ``/api/tags`` and ``/api/ps`` share (details as far as known without a load)."""
    facts = _facts(sm.loaded) if sm.loaded is not None else None
    return {
        "modified_at": _iso(sm.created),
        "size": sm.memory_bytes,
        # A stable id for the weights (Ollama's is the manifest's sha256).
        "digest": hashlib.sha256((sm.source or sm.name).encode()).hexdigest(),
        "details": _details(sm, facts),
    }


def _details(sm: ServedModel, facts: dict[str, Any] | None) -> dict[str, Any]:
    source = getattr(sm.loaded, "path", "") or sm.source or ""
    fmt = "gguf" if source.lower().endswith(".gguf") else "safetensors" if source else ""
    quant = re.search(r"(?i)\b(I?Q\d[A-Z0-9_]*|F16|F32|BF16)\b", source.rsplit("/", 1)[-1])
    family = facts["family"] if facts else ""
    return {
        "parent_model": "",
        "format": fmt,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": _count(facts["parameters"]) if facts else "",
        "quantization_level": quant.group(1).upper() if quant else (facts or {}).get("dtype", ""),
    }


def _facts(loaded: Any) -> dict[str, Any]:
    """What a loaded model says about itself."""
    from mlx.utils import tree_flatten

    from mlx_cairn.chat.fim import fim_family

    model = loaded.model
    family = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", ""
    )
    flat: list[tuple[str, Any]] = []
    if hasattr(model, "parameters"):
        flat = tree_flatten(model.parameters())  # type: ignore[assignment]
    params = sum(int(v.size) for _, v in flat)
    dtype = str(getattr(model, "dtype", "")).rsplit(".", 1)[-1].upper().replace("FLOAT", "F")
    if getattr(loaded, "kind", None) == "embedding":  # no template, no generation
        return {
            "family": str(getattr(loaded, "model_type", "") or family or ""),
            "parameters": params,
            "capabilities": ["embedding"],
            "template": "",
            "context_length": loaded.context_length,
            "dtype": dtype,
        }
    caps = ["completion"]
    if loaded.parser_family is not None:
        caps.append("tools")
    if loaded.reasoning.supported:
        caps.append("thinking")
    if fim_family(loaded.tokenizer) is not None:
        caps.append("insert")
    if takes_images(loaded):
        caps.append("vision")
    return {
        "family": str(family or ""),
        "parameters": params,
        "capabilities": caps,
        "template": loaded.template.source,
        "context_length": loaded.context_length,
        "dtype": dtype,
    }


def _count(n: int) -> str:
    """A parameter count as Ollama writes it: ``135M``, ``1.5B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------- model management


@router.post("/api/pull", include_in_schema=False)
async def pull(request: Request) -> Response:
    """Success for a served name (nothing to download); 501 for anything else."""
    state = app_state(request)
    body = await read_json(request)
    name = body.get("model", body.get("name")) if isinstance(body, dict) else None
    if isinstance(name, str) and name:
        try:
            served_name(state.registry, name)
            return json_response({"status": "success"})
        except ModelNotFound:
            pass
    raise _unsupported("/api/pull", "it serves the models `cairn serve` was started with")


def _unsupported(route: str, why: str) -> NotSupported:
    return NotSupported(
        f"{route} is not supported by this server (mlx-cairn): {why}; "
        "name a model when starting it: cairn serve MODEL (a folder, a .gguf file or a "
        "hub name) or --models-dir DIR"
    )


_MANAGEMENT = {
    "/api/push": ("POST", "it does not publish models"),
    "/api/create": ("POST", "it does not build models from Modelfiles"),
    "/api/copy": ("POST", "it does not copy models; add a name with --alias NAME=MODEL"),
    "/api/delete": ("DELETE", "it does not delete models"),
}


def _refuse(route: str, why: str) -> Any:
    async def refuse(request: Request) -> Response:
        raise _unsupported(route, why)

    refuse.__doc__ = f"``{route}``: 501, this server does not manage models."
    return refuse


# Out of the OpenAPI document: they only refuse, there is nothing to call.
for _route, (_method, _why) in _MANAGEMENT.items():
    router.add_api_route(_route, _refuse(_route, _why), methods=[_method], include_in_schema=False)
router.add_api_route(
    "/api/blobs/{digest}",
    _refuse("/api/blobs", "it does not store model files"),
    methods=["POST", "HEAD"],
    include_in_schema=False,
)
