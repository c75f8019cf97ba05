"""The Anthropic Messages dialect: ``/v1/messages`` and ``/v1/messages/count_tokens``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect, ModelInfo
from mlx_cairn.api.registry import ServedModel
from mlx_cairn.api.respond import count_prompt_tokens, serve_generation, serve_render
from mlx_cairn.api.settings import AppState, app_state, json_response, read_json
from mlx_cairn.errors import error_kind
from mlx_cairn.protocol.anthropic import (
    AnthropicRequest,
    parse_count_tokens_request,
    parse_messages_request,
)
from mlx_cairn.protocol.anthropic_stream import AnthropicCodec, error_payload
from mlx_cairn.protocol.codec import check_depth
from mlx_cairn.protocol.images import ImageReader, fetch_pending, has_images, refuse_images


def _error_body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    return error_payload(error_kind(kind).anthropic, message)


def _models_body(models: list[ModelInfo]) -> dict[str, Any]:
    import datetime as dt

    data = [
        {
            "type": "model",
            "id": m.id,
            "display_name": m.id,
            "created_at": dt.datetime.fromtimestamp(m.created, dt.timezone.utc)
            .isoformat()
            .replace("+00:00", "Z"),
            # Not in Anthropic's shape: an extra field its clients ignore.
            **({"context_length": m.context_length} if m.context_length is not None else {}),
        }
        for m in models
    ]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


DIALECT = Dialect(
    name="anthropic",
    prefixes=("/v1/messages",),
    error_body=_error_body,
    models_body=_models_body,
    header_hint="anthropic-version",
)

router = APIRouter()


def _parse(body: Any, state: AppState) -> AnthropicRequest:
    return parse_messages_request(
        body,
        max_tokens_limit=state.config.max_tokens_limit,
        images=ImageReader(state.config.images),
    )


def _codec(
    areq: AnthropicRequest, state: AppState, sm: ServedModel, input_tokens: int
) -> AnthropicCodec:
    chat = areq.chat
    return AnthropicCodec(
        model=sm.name,
        input_tokens=input_tokens,
        show_thinking=areq.show_thinking,
        allow_tools=chat.offers_tools,
    )


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    """Anthropic Messages: SSE when ``stream`` is true, else one JSON Message."""
    return await serve_generation(request, DIALECT, _parse, _codec)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}``, N equal to the usage the same request would report."""
    state = app_state(request)
    body = await read_json(request)
    check_depth(body)
    limits = state.config.images
    areq = await asyncio.to_thread(parse_count_tokens_request, body, images=ImageReader(limits))
    if has_images(areq.chat):
        refuse_images(areq.chat, state.registry.resolve(areq.model), areq.model, "messages")
        await fetch_pending(areq.chat, limits)
    sm = await state.registry.get(areq.model)
    try:
        refuse_images(areq.chat, sm, areq.model, "messages")
        n = await asyncio.to_thread(count_prompt_tokens, sm, areq.chat)
    finally:
        sm.release()  # idempotent: count_tokens gives it back already
    return json_response({"input_tokens": n})


@router.post("/v1/messages/render")
async def render_message(request: Request) -> Response:
    """``{"model": ..., "token_ids": [...]}``: the prompt ids the same Messages body
    would prefill, in the shape of ``/v1/chat/completions/render``; nothing is
    generated (no router asks for it yet: see docs/routers.md)."""
    return await serve_render(request, _parse)
