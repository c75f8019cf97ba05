"""The OpenAI legacy Completions dialect: ``POST /v1/completions`` (and FIM through ``suffix``).

Editor autocomplete (Continue, Zed, Tabby, Twinny, llama.vscode ...) sends
the text around the cursor here on every keystroke; the prompt is raw text
(no chat template), so a prompt that extends the last one reads it from the
prefix cache. Request mapping and wire format:
:mod:`mlx_cairn.protocol.openai_completions`.

Every choice (each prompt of a list, ``n`` per prompt) is its own engine
request; they are prepared (400s) before any is submitted, and answered as
one response (:mod:`mlx_cairn.api.choices`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.choices import ChoiceStreams
from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.respond import (
    Generation,
    GenerationResponse,
    prepare_generation,
    respond,
    serve_generation,
    serve_render,
)
from mlx_cairn.api.settings import AppState
from mlx_cairn.protocol.codec import Codec
from mlx_cairn.protocol.openai_common import error_body, models_body
from mlx_cairn.protocol.openai_completions import (
    CompletionCodec,
    OpenAICompletionRequest,
    parse_completion_request,
)

DIALECT = Dialect(
    name="openai-completions",
    prefixes=("/v1/completions",),
    error_body=error_body,
    models_body=models_body,
)

router = APIRouter()


def _parse(body: Any, state: AppState) -> OpenAICompletionRequest:
    return parse_completion_request(body, max_tokens_limit=state.config.max_tokens_limit)


def _codec(
    req: OpenAICompletionRequest, state: AppState, sm: Any, input_tokens: int
) -> CompletionCodec:
    echo = None
    engine = getattr(sm, "engine", None)  # none yet while the model loads (pings only)
    if req.echo and engine is not None:
        tok = engine.loaded.tokenizer
        echo = [
            c.raw.text if c.raw.ids is None else tok.decode(c.raw.ids)
            for c in req.choices
            if c.raw is not None
        ]
    return CompletionCodec(
        model=sm.name,
        input_tokens=input_tokens,
        include_usage=req.include_usage or not req.stream,
        echo=echo,
        num_choices=len(req.choices),
        logprobs=req.chat.sampling.logprobs,
    )


async def _start(
    state: AppState,
    dialect: Dialect,
    req: OpenAICompletionRequest,
    make_codec: Any,
) -> GenerationResponse:
    """Lease, prepare every choice, build the codec, submit every choice (see the module doc).

    Each choice holds its own lease (the model is not unloaded while any
    runs); a failure before the last submit cancels what was submitted and
    gives every lease back.
    """
    lease: Any = await state.registry.get(req.model)
    leases: list[Any] = [lease]
    streams: list[Any] = []
    announce = getattr(lease.engine, "announce", None)
    arrived = announce() if announce is not None else None
    try:
        clamp = state.config.clamp_max_tokens or req.open_ended
        prepared = []
        for chat in req.choices:
            prepared.append(
                await prepare_generation(
                    lease, chat, clamp_max_tokens=clamp, params=(req.prompt_param, "max_tokens")
                )
            )
        # Prompt tokens once per prompt (the codec's figure until the usage is known).
        n = sum(int(p.num_prompt_tokens) for p in prepared[:: req.n])
        codec: Codec = make_codec(req, state, lease, n)
        opening = codec.open()
        # The model is loaded and held by ``lease``: these leases are taken at once.
        leases += [state.registry.lease(req.model) for _ in prepared[1:]]
        await lease.turn()  # those who waited for the same load submit in arrival order
        for held, p in zip(leases, prepared, strict=True):
            streams.append(held.engine.submit(p))  # QueueFull at once when the queue is full
    except BaseException:
        for s in streams:
            s.cancel()
        for held in leases:
            held.release()
        raise
    finally:
        if arrived is not None:
            arrived()
    merged = ChoiceStreams(streams, [i // req.n for i in range(len(streams))])
    return respond(state, dialect, req, Generation(merged, n, lease), codec, opening)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    """Legacy Completions: SSE chunks when ``stream`` is true, else one JSON ``text_completion``."""
    return await serve_generation(request, DIALECT, _parse, _codec, start=_start)


@router.post("/v1/completions/render")
async def render_completion(request: Request) -> Response:
    """The prompt ids each prompt of the body would prefill, as
    ``/v1/chat/completions/render`` (one object, or a list for several prompts)."""
    return await serve_render(request, _parse, lambda req: req.choices[:: req.n])
