"""llama.cpp's fill-in-the-middle endpoint: ``POST /infill`` (llama.vim, llama.vscode).

Request mapping and wire format: :mod:`mlx_cairn.protocol.llama_infill`.
The prompt is built as for ``/v1/completions`` with a ``suffix``, so both
routes give the same answer and share cached prefixes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.respond import serve_generation
from mlx_cairn.api.settings import AppState
from mlx_cairn.protocol.llama_infill import (
    InfillCodec,
    InfillRequest,
    error_body,
    parse_infill_request,
)

DIALECT = Dialect(name="llama-infill", prefixes=("/infill",), error_body=error_body)

router = APIRouter()


def _parse(body: Any, state: AppState) -> InfillRequest:
    return parse_infill_request(
        body,
        max_tokens_limit=state.config.max_tokens_limit,
        default_model=state.registry.models[0].name,  # llama.cpp serves one model
    )


def _codec(req: InfillRequest, state: AppState, sm: Any, input_tokens: int) -> InfillCodec:
    engine = getattr(sm, "engine", None)  # none yet while the model loads (pings only)
    n_ctx = int(getattr(engine, "context_length", 0) or 0)
    return InfillCodec(model=sm.name, input_tokens=input_tokens, context_length=n_ctx)


@router.post("/infill")
async def infill(request: Request) -> Response:
    """Fill in the middle: SSE ``data:`` chunks when ``stream`` is true, else one JSON answer."""
    return await serve_generation(request, DIALECT, _parse, _codec)
