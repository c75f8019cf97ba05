"""The OpenAI embeddings dialect, ``POST /v1/embeddings``, and the route body every
embedding shape shares (:func:`serve_embedding`; Ollama's two routes are in
:mod:`mlx_cairn.api.ollama_embed`).

A request goes::

    parse (400)  ->  model kind from its folder (400 for a chat model, before loading)
      -> lease (loads it)  ->  dimensions, tokenize, lengths (400)  ->  submit (429)
      -> wait, cancelled if the client leaves  ->  cut to dimensions  ->  JSON

Wire format: :mod:`mlx_cairn.protocol.embeddings`; the engine:
:mod:`mlx_cairn.engine.embedder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.metrics import CLIENT_GONE_SCOPE_KEY
from mlx_cairn.api.settings import AppState, app_state, json_response, read_json
from mlx_cairn.errors import CairnError
from mlx_cairn.models.embedding import EmbeddingModel, model_kind, not_an_embedding_model
from mlx_cairn.protocol.codec import check_depth
from mlx_cairn.protocol.embeddings import (
    EmbeddingRequest,
    check_dimensions,
    check_total,
    cut,
    openai_body,
    parse_openai,
)
from mlx_cairn.protocol.openai_common import error_body, models_body

log = logging.getLogger("mlx_cairn.api")

DIALECT = Dialect(
    name="openai-embeddings",
    prefixes=("/v1/embeddings",),
    error_body=error_body,
    models_body=models_body,
)

router = APIRouter()

#: Vectors above which the JSON answer is built off the event loop.
ENCODE_OFF_LOOP_FLOATS = 65_536


@dataclass(slots=True)
class Embedded:
    """What a served embedding request gives its dialect to answer with."""

    #: [inputs, dimensions or the model's width], unit-length rows.
    vectors: np.ndarray
    tokens: int
    #: The served model's primary name.
    model: str
    #: Seconds spent waiting for the model to load, and in all.
    load_seconds: float
    total_seconds: float


class ClientGone(Exception):
    """The client left before its vectors were ready (the request was dropped)."""


async def serve_embedding(request: Request, state: AppState, req: EmbeddingRequest) -> Embedded:
    """Run ``req`` (see the module doc); every refusal is a CairnError raised before
    anything is queued, and a client that leaves drops its queued work."""
    start = time.perf_counter()
    sm = state.registry.resolve(req.model)  # ModelNotFound (404) for an unknown name
    if model_kind(sm.loaded, sm.source) == "chat":  # refused before a load
        raise not_an_embedding_model(req.model)
    lease: Any = await state.registry.get(req.model)
    loaded = time.perf_counter()
    try:
        model = lease.loaded
        if not isinstance(model, EmbeddingModel):
            raise not_an_embedding_model(req.model)
        check_dimensions(req.dimensions, model)
        engine = lease.engine
        if req.texts is not None:
            seqs = await asyncio.to_thread(engine.tokenize, req.texts, truncate=req.truncate)
        else:
            seqs = engine.check_ids(req.ids or [], truncate=req.truncate, param=req.param)
        check_total(sum(len(s) for s in seqs), req.param)
        await lease.turn()  # those who waited for the same load submit in arrival order
        stream = engine.submit(seqs)  # QueueFull (429) at once when the queue is full
    except BaseException:
        lease.release()
        raise
    try:
        result = await _result_unless_gone(request, stream)
    finally:
        stream.cancel()  # gives the lease back; drops the work if it is not done
    vectors = cut(result.vectors, req.dimensions)
    return Embedded(
        vectors,
        result.prompt_tokens,
        lease.name,
        loaded - start,
        time.perf_counter() - start,
    )


async def _result_unless_gone(request: Request, stream: Any) -> Any:
    """The stream's one result, or ClientGone as soon as the client disconnects."""
    result = asyncio.ensure_future(stream.__anext__())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    if result.done():
        return result.result()
    result.cancel()
    with contextlib.suppress(asyncio.CancelledError, CairnError):
        await result
    raise ClientGone


async def _disconnect(request: Request) -> None:
    # The body is read: the next message is http.disconnect, when the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer(request: Request, build: Any, *args: Any) -> Response:
    """``json_response(build(*args))``, built off the event loop when it is large."""
    vectors = args[0]
    if vectors.size > ENCODE_OFF_LOOP_FLOATS:
        body = await asyncio.to_thread(build, *args)
    else:
        body = build(*args)
    return json_response(body)


class _Nothing(Response):
    """Sends nothing: the client is gone (as the generation routes do)."""

    def __init__(self) -> None:
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


def gone_response(request: Request) -> Response:
    """No answer for a client that left; /metrics counts a 499."""
    log.info("client disconnected; embedding request dropped")
    request.scope[CLIENT_GONE_SCOPE_KEY] = True
    return _Nothing()


async def run_route(
    request: Request,
    parse: Callable[[Any], Any],
    reply: Callable[[Any, Embedded], Awaitable[Response]],
) -> Response:
    """The body of every embedding route: read and ``parse`` the body, serve it,
    ``reply(req, done)`` (nothing for a client that left)."""
    state = app_state(request)
    body = await read_json(request)
    check_depth(body)
    req = parse(body)
    try:
        done = await serve_embedding(request, state, req)
    except ClientGone:
        return gone_response(request)
    return await reply(req, done)


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    """Embeddings of a string, a list of strings or token ids (OpenAI's shape)."""
    return await run_route(
        request,
        parse_openai,
        lambda req, done: answer(request, openai_body, done.vectors, req, done.model, done.tokens),
    )
