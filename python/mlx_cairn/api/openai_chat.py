"""The OpenAI Chat Completions dialect: ``POST /v1/chat/completions``.

This dialect is the ``shared_default``: ``GET /v1/models`` and unknown paths
answer in the OpenAI shape unless the request carries ``anthropic-version``.
Request mapping and wire format: :mod:`mlx_cairn.protocol.openai_chat`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.registry import ServedModel
from mlx_cairn.api.respond import serve_generation, serve_render
from mlx_cairn.api.settings import AppState
from mlx_cairn.protocol.images import ImageReader
from mlx_cairn.protocol.openai_chat import ChatCodec, OpenAIChatRequest, parse_chat_request
from mlx_cairn.protocol.openai_common import error_body, models_body

DIALECT = Dialect(
    name="openai-chat",
    prefixes=("/v1/chat/completions",),
    error_body=error_body,
    models_body=models_body,
    shared_default=True,
)

router = APIRouter()


def _parse(body: Any, state: AppState) -> OpenAIChatRequest:
    return parse_chat_request(
        body,
        max_tokens_limit=state.config.max_tokens_limit,
        images=ImageReader(state.config.images),
    )


def _codec(
    req: OpenAIChatRequest, state: AppState, sm: ServedModel, input_tokens: int
) -> ChatCodec:
    chat = req.chat
    return ChatCodec(
        model=sm.name,
        input_tokens=input_tokens,
        # A JSON body is the fold of the stream that reports usage.
        include_usage=req.include_usage or not req.stream,
        allow_tools=chat.offers_tools,
        logprobs=chat.sampling.logprobs,
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Chat Completions: SSE chunks when ``stream`` is true, else one JSON completion."""
    return await serve_generation(request, DIALECT, _parse, _codec)


@router.post("/v1/chat/completions/render")
async def render_chat_completion(request: Request) -> Response:
    """``{"model": ..., "token_ids": [...]}``: the prompt ids the same body would prefill
    (vLLM's render route, which vllm-router's ``cache_aware`` policy asks every
    worker for); nothing is generated."""
    return await serve_render(request, _parse)
