"""The OpenAI Chat Completions dialect: ``POST /v1/chat/completions``.

This dialect is the ``shared_default``: ``GET /v1/models`` and unknown paths
answer in the OpenAI shape unless the request carries ``anthropic-version``.
Request mapping and wire format: :mod:`mlx_cairn.protocol.openai_chat`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.runner import GenerationResponse, start_generation
from mlx_cairn.api.state import app_state, read_json
from mlx_cairn.protocol.openai_chat import ChatCodec, parse_chat_request
from mlx_cairn.protocol.openai_common import error_body, models_body

DIALECT = Dialect(
    name="openai-chat",
    prefixes=("/v1/chat/completions",),
    error_body=error_body,
    models_body=models_body,
    shared_default=True,
)

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Chat Completions: SSE chunks when ``stream`` is true, else one JSON completion."""
    state = app_state(request)
    req = parse_chat_request(
        await read_json(request), max_tokens_limit=state.config.max_tokens_limit
    )
    sm = await state.registry.get(req.model)
    # Without max_tokens / max_completion_tokens the answer may use all the room left.
    clamp = state.config.clamp_max_tokens or req.open_ended
    gen = await start_generation(sm, req.chat, clamp_max_tokens=clamp)
    chat = req.chat
    codec = ChatCodec(
        model=sm.name,
        input_tokens=gen.input_tokens,
        # A JSON body is the fold of the stream that reports usage.
        include_usage=req.include_usage or not req.stream,
        allow_tools=bool(chat.tools) and chat.tool_choice != "none",
    )
    return GenerationResponse(
        gen, codec, stream=req.stream, dialect=DIALECT, ping_interval=state.config.ping_interval
    )
