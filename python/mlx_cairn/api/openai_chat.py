"""The OpenAI Chat Completions dialect: ``POST /v1/chat/completions``.

This dialect is the ``shared_default``: ``GET /v1/models`` and unknown paths
answer in the OpenAI shape unless the request carries ``anthropic-version``.
Request mapping and wire format: :mod:`mlx_cairn.protocol.openai_chat`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.registry import ServedModel
from mlx_cairn.api.runner import Generation, GenerationResponse, start_generation
from mlx_cairn.api.state import app_state, read_json
from mlx_cairn.protocol.openai_chat import ChatCodec, parse_chat_request
from mlx_cairn.protocol.openai_common import error_body, models_body, status_for_kind
from mlx_cairn.types import ChatRequest

DIALECT = Dialect(
    name="openai-chat",
    prefixes=("/v1/chat/completions",),
    error_body=error_body,
    models_body=models_body,
    shared_default=True,
    status_for_kind=status_for_kind,
)

router = APIRouter()


async def start_open_ended(
    sm: ServedModel, chat: ChatRequest, *, open_ended: bool, clamp: bool
) -> Generation:
    """Submit ``chat``; without a token cap it may run to the end of the room left.

    The room is the context length, or the KV cache capacity when that is
    smaller, less the prompt; a prompt that leaves no room is the usual 400.
    """
    if open_ended:
        engine = sm.engine
        limit = getattr(engine, "context_length", None) or getattr(
            sm.loaded, "context_length", None
        )
        stats = await asyncio.to_thread(engine.stats)
        blocks, size = stats.get("blocks_total"), stats.get("block_size")
        if blocks and size:
            # Conservative by one block: whether blocks_total counts the null block.
            capacity = (int(blocks) - 1) * int(size)
            limit = min(int(limit), capacity) if limit else capacity
        if limit:
            prompt = await asyncio.to_thread(engine.count_tokens, chat)
            if int(limit) - prompt >= 1:  # else not even one token fits: the usual 400
                chat.max_tokens = min(chat.max_tokens, int(limit) - prompt)
    return await start_generation(sm, chat, clamp_max_tokens=clamp)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Chat Completions: SSE chunks when ``stream`` is true, else one JSON completion."""
    state = app_state(request)
    req = parse_chat_request(
        await read_json(request), max_tokens_limit=state.config.max_tokens_limit
    )
    sm = await state.registry.get(req.model)
    gen = await start_open_ended(
        sm, req.chat, open_ended=req.open_ended, clamp=state.config.clamp_max_tokens
    )
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
