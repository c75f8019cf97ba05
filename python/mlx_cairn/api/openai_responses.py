"""The OpenAI Responses dialect: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

Stored responses (``store`` true, the default) live in memory in a bounded
:class:`ResponseStore`, one per app, so that ``previous_response_id`` can
continue a conversation:

- at most :data:`MAX_STORED_RESPONSES` (1000) responses and
  :data:`MAX_STORED_RESPONSE_BYTES` (256 MiB, counted as the JSON size of
  each one's conversation and body); storing one more drops the oldest until
  it fits, and one larger than the whole bound is not stored at all (the
  response itself is the same; its id is a 404 later, as an evicted one's);
- each for at most :data:`STORED_RESPONSE_TTL_S` (3600 s, one hour) after it
  was stored; an older one is gone;
- an unknown, expired, evicted or deleted id is a 404 ``not_found_error`` naming
  ``previous_response_id``; ``store: false`` keeps nothing;
- only responses that finished (completed, or incomplete at
  ``max_output_tokens``) are stored; nothing survives a restart.

Request mapping: :mod:`mlx_cairn.protocol.openai_responses`; wire format:
:mod:`mlx_cairn.protocol.openai_responses_stream`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from mlx_cairn.api.dialects import Dialect
from mlx_cairn.api.registry import ServedModel
from mlx_cairn.api.respond import serve_generation
from mlx_cairn.api.settings import AppState, app_state, json_response
from mlx_cairn.protocol.frames import json_bytes
from mlx_cairn.protocol.images import ImageReader, strip_marks
from mlx_cairn.protocol.openai_common import error_body, models_body
from mlx_cairn.protocol.openai_responses import (
    ResponseNotFound,
    ResponsesRequest,
    parse_input,
    parse_responses_request,
)
from mlx_cairn.protocol.openai_responses_stream import ResponsesCodec
from mlx_cairn.types import Message

#: Most responses kept for ``previous_response_id`` (the oldest goes first).
MAX_STORED_RESPONSES = 1000
#: Seconds a stored response stays available.
STORED_RESPONSE_TTL_S = 3600.0
#: Most bytes of stored responses (JSON size of conversations + bodies).
MAX_STORED_RESPONSE_BYTES = 256 * 1024 * 1024

DIALECT = Dialect(
    name="openai-responses",
    prefixes=("/v1/responses",),
    error_body=error_body,
    models_body=models_body,
)

router = APIRouter()


@dataclass(slots=True)
class StoredResponse:
    """One finished response: its conversation (input + output) and its body."""

    messages: list[Message]
    body: dict[str, Any]
    stored_at: float
    #: What it counts against the store's byte bound.
    size: int = 0


class ResponseStore:
    """Finished responses by id, bounded by count, bytes and age (see the module doc)."""

    def __init__(
        self,
        max_items: int = MAX_STORED_RESPONSES,
        ttl_s: float = STORED_RESPONSE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_STORED_RESPONSE_BYTES,
    ) -> None:
        if max_items < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError(
                "the response store needs max_items >= 1, max_bytes >= 1 and ttl_s > 0"
            )
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes counted for what is stored now."""
        with self._lock:
            self._expire()
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._items:
            rid, first = next(iter(self._items.items()))
            if first.stored_at > cutoff:
                break
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        gone = self._items.pop(rid, None)
        if gone is not None:
            self._bytes -= gone.size

    def put(self, rid: str, messages: list[Message], body: dict[str, Any]) -> None:
        """Keep a finished response; the oldest ones go beyond ``max_items`` or ``max_bytes``.

        A response larger than ``max_bytes`` on its own is not kept (nor
        does it evict anything).
        """
        # Pictures count as their decoded RGB bytes (what they hold in memory).
        pixels = sum(3 * i.width * i.height for m in messages for i in m.images)
        size = len(orjson.dumps(messages, default=lambda _: None)) + len(json_bytes(body)) + pixels
        with self._lock:
            self._expire()
            self._drop(rid)
            if size > self.max_bytes:
                return
            self._items[rid] = StoredResponse(messages, body, self.clock(), size)
            self._bytes += size
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, rid: str, param: str | None = None) -> StoredResponse:
        """The stored response ``rid``; ResponseNotFound (404) if unknown or expired."""
        with self._lock:
            self._expire()
            hit = self._items.get(rid)
        if hit is None:
            raise ResponseNotFound(
                f"response {rid!r} not found (unknown, expired after {self.ttl_s:g}s, "
                f"or evicted beyond {self.max_items} stored responses or "
                f"{self.max_bytes / 2**20:g} MiB)",
                param=param,
            )
        return hit

    def delete(self, rid: str) -> None:
        """Forget ``rid`` (ResponseNotFound if it is not there)."""
        self.get(rid)
        with self._lock:
            self._drop(rid)


def _store_of(state: AppState) -> ResponseStore:
    """The app's store, created on first use."""
    store = state.dialect_state.get("openai_responses")
    if store is None:
        store = state.dialect_state.setdefault("openai_responses", ResponseStore())
    return store  # type: ignore[no-any-return]


def response_store(request: Request) -> ResponseStore:
    """The store of the app serving ``request``."""
    return _store_of(app_state(request))


def _parse(body: Any, state: AppState) -> ResponsesRequest:
    store = _store_of(state)
    return parse_responses_request(
        body,
        max_tokens_limit=state.config.max_tokens_limit,
        lookup=lambda rid: store.get(rid, "previous_response_id").messages,
        images=ImageReader(state.config.images),
    )


def _codec(
    req: ResponsesRequest, state: AppState, sm: ServedModel, input_tokens: int
) -> ResponsesCodec:
    store = _store_of(state)
    history = req.history

    def keep(body: dict[str, Any]) -> None:
        output = parse_input(strip_marks(body["output"]), "output")  # text only: no images
        store.put(body["id"], history + output, body)

    chat = req.chat
    return ResponsesCodec(
        model=sm.name,
        input_tokens=input_tokens,
        allow_tools=chat.offers_tools,
        echo=req.echo,
        on_finish=keep if req.store else None,
    )


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """Responses: SSE events when ``stream`` is true, else one JSON Response."""
    return await serve_generation(request, DIALECT, _parse, _codec)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response, as it was returned."""
    return json_response(response_store(request).get(response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    """Forget a stored response."""
    response_store(request).delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
