"""Ollama's embedding routes: ``POST /api/embed`` and the legacy ``POST /api/embeddings``.

Their own dialect, so every refusal on these paths (auth, body size, bad
input, a chat model named) is Ollama's ``{"error": "..."}`` with the status of
:data:`mlx_cairn.errors.ERROR_KINDS`. The rest of the Ollama API lives in its
own module; the route body is the one every embedding shape shares
(:func:`mlx_cairn.api.embeddings.serve_embedding`).

Example (the official client)::

    ollama.Client(host="http://127.0.0.1:8080").embed(model="bge-small", input=["a", "b"])
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.embeddings import Embedded, answer, run_route
from mlx_cairn.protocol.embeddings import (
    ollama_embed_body,
    ollama_embeddings_body,
    parse_ollama_embed,
    parse_ollama_embeddings,
)


def error_body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    """Ollama's error envelope: the message alone (the status says the rest)."""
    return {"error": message}


DIALECT = Dialect(
    name="ollama-embed",
    prefixes=("/api/embed", "/api/embeddings"),
    error_body=error_body,
)

router = APIRouter()

_NS = 1_000_000_000


@router.post("/api/embed")
async def embed(request: Request) -> Response:
    """Vectors of one string or a list (``truncate`` defaults to true, as in Ollama)."""

    def body(vectors: Any, req: Any, done: Embedded) -> dict[str, Any]:
        total, load = int(done.total_seconds * _NS), int(done.load_seconds * _NS)
        return ollama_embed_body(vectors, req.model, done.tokens, total_ns=total, load_ns=load)

    return await run_route(
        request,
        parse_ollama_embed,
        lambda req, done: answer(request, body, done.vectors, req, done),
    )


@router.post("/api/embeddings")
async def embeddings(request: Request) -> Response:
    """The legacy route: one ``prompt``, one ``embedding``."""
    return await run_route(
        request,
        parse_ollama_embeddings,
        lambda req, done: answer(request, ollama_embeddings_body, done.vectors),
    )
