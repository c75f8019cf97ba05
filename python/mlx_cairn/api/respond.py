"""Run one ChatRequest on an engine and answer with SSE or one folded JSON body.

This is the dialect-neutral half of every generation route::

    gen = await start_generation(served_model, chat_request, clamp_max_tokens=False)
    #   ^ 400 (validation / context), 429 (queue full) raised here, before any byte
    return GenerationResponse(gen, codec, stream=wants_sse, dialect=DIALECT)

:class:`GenerationResponse` is an ASGI response that

- streams ``codec.open()`` then ``codec.feed(event)`` frames as SSE, with a
  ``codec.ping()`` frame whenever nothing was sent for ``ping_interval``
  seconds (queued, prefilling, slow decode), or
- folds exactly those frames with ``codec.fold`` into one JSON body;
- watches the ASGI receive channel for ``http.disconnect`` the whole time and
  cancels the engine stream at once when the client goes away (both modes);
- sets ``X-Session-Cache`` (``fresh`` | ``prefix_hit`` on JSON, ``streaming``
  on SSE) and ``X-Cached-Tokens``.

A streamed request whose model is still loading: the wait for the model is
the one step that may move inside the stream. Everything that validates the
body runs first, so a 400 is always an HTTP status. Then, while the model is
not there yet::

    model loaded (or ready within ping_interval)   -> exactly as above
    load waiting for room (another model must go)  -> no bytes yet: "no room" is
                                                      still a 503 + Retry-After
    model being read / downloaded > ping_interval  -> 200 + SSE head, a ping
                                                      frame every ping_interval
                                                      (:class:`LoadingStreamResponse`)

Once such a stream has started, the generation continues in it unchanged
(``message_start`` after admission ...), and anything that fails before the
first event (the load, "no room" after an unload race, the context check, a
full queue) is the dialect's in-stream error: Anthropic ``event: error``
(never ``message_stop``), an OpenAI error chunk, a Responses ``error`` +
``response.failed``.

Trailers: on a stream the cached-token count is known only at the end. When the
ASGI server offers the ``http.response.trailers`` extension (HTTP/2 servers,
Starlette's test client) ``X-Cached-Tokens`` and ``X-Session-Cache`` are sent as
HTTP trailers. uvicorn's HTTP/1.1 protocols (h11, httptools) do not implement
that extension, so under ``cairn serve`` the same two values end the stream as
an SSE comment line (``: x-session-cache=prefix_hit x-cached-tokens=128``),
which every SSE client ignores, and the count is in the final usage
(``cache_read_input_tokens`` for Anthropic) as well.

Framing: a codec streams SSE unless it names another
:class:`~mlx_cairn.protocol.codec.Framing` (the Ollama API's NDJSON, whose
pings and closing note are empty: its clients parse every line as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mlx_cairn.api.dialects import Dialect, error_response
from mlx_cairn.api.metrics import CLIENT_GONE_SCOPE_KEY, observe_event
from mlx_cairn.api.registry import ModelLease, ServedModel
from mlx_cairn.api.settings import AppState, app_state, json_response, read_json
from mlx_cairn.errors import CairnError, ContextLengthExceeded, error_kind
from mlx_cairn.models.embedding import model_kind, not_a_chat_model
from mlx_cairn.protocol.codec import Codec, Framing, WireEvent, check_depth, framing_of
from mlx_cairn.protocol.frames import json_bytes
from mlx_cairn.protocol.images import fetch_pending, has_images, refuse_images, strip_marks
from mlx_cairn.types import ChatRequest, Done, Error, Event

log = logging.getLogger("mlx_cairn.api")

#: Default seconds of silence before a keep-alive frame.
PING_INTERVAL = 3.0
TRAILERS_EXT = "http.response.trailers"
#: Request bodies of this many bytes or more are checked and parsed in a worker
#: thread: validation walks every message and tool schema, so its cost grows
#: with the prompt, and the event loop serves every other stream meanwhile.
PARSE_OFF_LOOP_BYTES = 64 * 1024
#: Wire events above which a JSON answer is folded in a worker thread, so a
#: long answer never holds the event loop (other streams, /health).
FOLD_OFF_LOOP_EVENTS = 512


@dataclass(slots=True)
class Generation:
    """A submitted request: the engine's event stream and the prompt size."""

    stream: Any  # mlx_cairn.engine RequestStream: next_batch(), interrupt(), drained, cancel()
    input_tokens: int
    model: ServedModel


class DialectRequest(Protocol):
    """What a dialect's request parser returns (the fields the route reads)."""

    chat: ChatRequest
    model: str
    stream: bool
    #: No max_tokens given: the answer may use all the room the prompt leaves.
    open_ended: bool
    #: The request fields that hold the prompt and the token cap, as a
    #: context-length error names them (``input`` / ``max_output_tokens`` ...).
    prompt_param: str
    max_tokens_param: str
    # Optional: ``context_limit`` (int | None), a smaller context than the
    # model's that this request asks for (Ollama's ``options.num_ctx``), read
    # by :func:`prepare_generation` with getattr: most dialects have none.


R = TypeVar("R", bound=DialectRequest)


async def serve_generation(
    request: Request,
    dialect: Dialect,
    parse: Callable[[Any, AppState], R],
    make_codec: Callable[[R, AppState, ServedModel, int], Codec],
    *,
    body: Any = None,
    start: Callable[[AppState, Dialect, R, Any], Awaitable[GenerationResponse]] | None = None,
) -> Response:
    """The one route body of every generation dialect: parse -> lease -> prepare -> codec -> submit.

    ``body``: the request's JSON when the route has decoded it already (else it is read here).
    ``start``: lease -> prepare -> codec -> submit for a dialect that runs
    several generations per request (legacy Completions: api/choices.py);
    the default runs ``req.chat``.

    Everything that can fail on the request's content runs before
    :meth:`Engine.submit`: body decoding and its nesting bound, the dialect's
    validation, model lookup, template + tokenization + context checks, and
    the codec with its opening frames (which copy the request's echoed
    fields). After submit nothing can leave the generation behind: any
    exception cancels it, and :class:`GenerationResponse` cancels it whenever
    it stops early. A stream whose model takes long to load starts before the
    lease (see the module doc).
    """
    state = app_state(request)
    if body is None:
        body = await read_json(request)
    if len(await request.body()) >= PARSE_OFF_LOOP_BYTES:  # the bytes are cached by now
        req = await asyncio.to_thread(_check_and_parse, parse, body, state)
    else:
        req = _check_and_parse(parse, body, state)
    sm = state.registry.resolve(req.model)  # ModelNotFound (404) for an unknown name
    if model_kind(sm.loaded, sm.source) == "embedding":  # refused before it loads
        raise not_a_chat_model(req.model)
    if has_images(req.chat):
        if sm.loaded is not None:  # known without a load: refused before any fetch
            refuse_images(req.chat, sm, req.model, req.prompt_param)
        await fetch_pending(req.chat, state.config.images)  # --allow-image-urls only
    begin = start or _start
    if not req.stream:
        return await begin(state, dialect, req, make_codec)
    starting = asyncio.ensure_future(begin(state, dialect, req, make_codec))
    try:
        if not await _loads_too_long(state, req.model, starting):
            return await starting
        slot = state.registry.resolve(req.model)
        return LoadingStreamResponse(
            starting,
            make_codec(req, state, slot, 0),  # pings and errors only: no opening is sent
            dialect=dialect,
            model=slot.name,
            ping_interval=state.config.ping_interval,
        )
    except BaseException:
        starting.cancel()
        raise


def _check_and_parse(parse: Callable[[Any, AppState], R], body: Any, state: AppState) -> R:
    check_depth(body)
    # Every mark in a prompt is an image the wire placed (the image dialects strip
    # their bodies too; this covers the rest: completions, infill).
    return parse(strip_marks(body), state)


async def _start(
    state: AppState,
    dialect: Dialect,
    req: R,
    make_codec: Callable[[R, AppState, ServedModel, int], Codec],
) -> GenerationResponse:
    """Lease the model (waiting for its load), prepare, build the codec, submit in turn."""
    lease: Any = await state.registry.get(req.model)
    # An idle engine lets a burst gather before its first step (Engine.announce).
    announce = getattr(lease.engine, "announce", None)
    arrived = announce() if announce is not None else None
    try:
        refuse_images(req.chat, lease, req.model, req.prompt_param)  # a text model: 400
        clamp = state.config.clamp_max_tokens or req.open_ended
        prepared = await prepare_generation(
            lease,
            req.chat,
            clamp_max_tokens=clamp,
            params=(req.prompt_param, req.max_tokens_param),
            context_limit=getattr(req, "context_limit", None),
        )
        n = int(prepared.num_prompt_tokens)
        codec = make_codec(req, state, lease, n)
        opening = codec.open()
        await lease.turn()  # those who waited for the same load submit in arrival order
        stream = lease.engine.submit(prepared)  # QueueFull at once when the queue is full
    except BaseException:
        lease.release()
        raise
    finally:
        if arrived is not None:
            arrived()
    return respond(state, dialect, req, Generation(stream, n, lease), codec, opening)


def respond(
    state: AppState, dialect: Dialect, req: Any, gen: Generation, codec: Codec, opening: Any
) -> GenerationResponse:
    """The response for a submitted generation (SSE or JSON as ``req.stream`` asks); if
    it cannot be built, the generation is cancelled instead of running unread."""
    try:
        return GenerationResponse(
            gen,
            codec,
            stream=req.stream,
            dialect=dialect,
            ping_interval=state.config.ping_interval,
            opening=opening,
        )
    except BaseException:
        gen.stream.cancel()
        raise


async def _loads_too_long(state: AppState, name: str, start: asyncio.Future[Any]) -> bool:
    """Wait for ``start``; True once it has waited ``ping_interval`` while the model loads
    (then the stream must start to stay alive), False when it is done first."""
    loop = asyncio.get_running_loop()
    patience = state.config.ping_interval
    deadline = loop.time() + patience
    step = max(0.01, min(patience, 0.25))  # how often the model's state is looked at
    while True:
        done, _ = await asyncio.wait({start}, timeout=step)
        if done:
            return False
        if loop.time() >= deadline and state.registry.loading(name):
            return True


async def prepare_generation(
    sm: ServedModel,
    chat: ChatRequest,
    *,
    clamp_max_tokens: bool = False,
    params: tuple[str, str] = ("messages", "max_tokens"),
    context_limit: int | None = None,
) -> Any:
    """Template, tokenize and check ``chat`` off the event loop (400s raised here).

    With ``clamp_max_tokens`` a request whose prompt fits but whose
    ``max_tokens`` does not is given the room that is left instead of a 400:
    the cap in effect is the prepared request's ``max_tokens``; ``chat`` is
    never changed.
    ``params`` are the request's names for its prompt and its token cap, as a
    context-length error names them. ``context_limit``: the request's own
    context, checked (and clamped to) like the model's where it is smaller.
    """
    try:
        prepared = await asyncio.to_thread(
            sm.engine.prepare, chat, clamp_max_tokens=clamp_max_tokens
        )
        if context_limit is not None:
            _within(prepared, context_limit, clamp_max_tokens)
    except ContextLengthExceeded as e:
        e = e.named(*params)
        if not clamp_max_tokens:
            e = e.with_clamp_advice()  # only a max_tokens overflow carries the advice
        raise e from None
    return prepared


def _within(prepared: Any, limit: int, clamp: bool) -> None:
    """Hold ``prepared`` to a request's own context of ``limit`` tokens (see above)."""
    n = int(prepared.num_prompt_tokens)
    what = "the context this request asked for"
    if n > limit:
        raise ContextLengthExceeded(prompt_tokens=n, limit=limit, what=what)
    if clamp and n + prepared.max_tokens > limit:
        prepared.max_tokens = max(limit - n, 1)  # a prompt that fills it still fails below
    if n + prepared.max_tokens > limit:
        raise ContextLengthExceeded(
            prompt_tokens=n, limit=limit, max_tokens=prepared.max_tokens, what=what
        )


async def start_generation(
    sm: ServedModel, chat: ChatRequest, *, clamp_max_tokens: bool = False
) -> Generation:
    """Prepare and submit (for callers without a dialect route, e.g. tests and tools)."""
    prepared = await prepare_generation(sm, chat, clamp_max_tokens=clamp_max_tokens)
    turn = getattr(sm, "turn", None)  # a ModelLease keeps arrival order after a load
    if turn is not None:
        await turn()
    stream = sm.engine.submit(prepared)
    return Generation(stream, int(prepared.num_prompt_tokens), sm)


async def serve_render(
    request: Request,
    parse: Callable[[Any, AppState], R],
    chats: Callable[[R], list[ChatRequest]] = lambda req: [req.chat],
) -> Response:
    """The prompt token ids a generation route would prefill for this body, nothing generated.

    vLLM's render routes (``POST /v1/chat/completions/render`` ...), which
    vllm-router's ``cache_aware`` and ``kv_aware`` policies ask every worker
    for: ``{"model": ..., "token_ids": [...]}``, one object per prompt (a list
    of them for a legacy Completions body with several prompts). The body goes
    through the dialect's own parser (unknown fields ignored, bad ones a 400
    in its envelope) and the engine's own template + tokenizer path
    (:func:`mlx_cairn.engine.prepare.render`, the one ``Engine.prepare``
    takes), so the ids are exactly the ones a generation would prefill.
    Neither ``max_tokens`` nor the context is checked: a router only needs the
    prefix.
    """
    state = app_state(request)
    body = await read_json(request)
    req = await asyncio.to_thread(_check_and_parse, parse, body, state)
    sm = state.registry.resolve(req.model)
    if model_kind(sm.loaded, sm.source) == "embedding":
        raise not_a_chat_model(req.model)
    prompts = chats(req)
    if any(has_images(c) for c in prompts):
        if sm.loaded is not None:
            for c in prompts:
                refuse_images(c, sm, req.model, req.prompt_param)
        for c in prompts:
            await fetch_pending(c, state.config.images)
    lease: Any = await state.registry.get(req.model)
    try:
        for c in prompts:
            refuse_images(c, lease, req.model, req.prompt_param)
        loaded = lease.loaded
        ids = [await asyncio.to_thread(_prompt_ids, loaded, c) for c in prompts]
    finally:
        lease.release()
    out = [{"model": lease.names[0], "token_ids": t} for t in ids]
    return json_response(out[0] if len(out) == 1 else out)


def _prompt_ids(loaded: Any, chat: ChatRequest) -> list[int]:
    from mlx_cairn.engine.prepare import render

    return [int(t) for t in render(loaded, chat).ids]


def count_prompt_tokens(sm: ServedModel | ModelLease, chat: ChatRequest) -> int:
    """Prompt tokens of ``chat`` (== usage.input_tokens), even when it exceeds the context.

    A conversation longer than the context still has a size, and clients use
    it to decide when to compact; it is the prompt the engine would build.
    """
    return int(sm.engine.count_tokens(chat))


class _Disconnected(Exception):
    pass


class GenerationResponse(Response):
    """ASGI response for one generation: SSE or folded JSON (see module doc)."""

    def __init__(
        self,
        gen: Generation,
        codec: Codec,
        *,
        stream: bool,
        dialect: Dialect,
        ping_interval: float = PING_INTERVAL,
        opening: list[WireEvent] | None = None,
    ) -> None:
        # Response.__init__ is not called: this class writes its own messages.
        self.status_code = 200
        self.background = None
        self.gen = gen
        self.codec = codec
        self.stream = stream
        self.dialect = dialect
        self.ping_interval = ping_interval
        #: ``codec.open()``, built before submit by :func:`serve_generation`.
        self.opening = codec.open() if opening is None else opening
        self._gone = False  # the client left (set by the disconnect watcher)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await self.run(scope, receive, send, watcher)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        watcher: asyncio.Future[None],
        *,
        head_sent: bool = False,
    ) -> None:
        """Serve the generation; ``watcher`` ends when the client leaves. ``head_sent``:
        the SSE head (and pings) already went out (:class:`LoadingStreamResponse`)."""
        self._scope = scope  # for the /metrics observations of final events
        watcher.add_done_callback(self._on_gone)
        try:
            if self.stream:
                await self._run_stream(scope, send, head_sent)
            else:
                await self._run_json(scope, receive, send)
        except _Disconnected:
            log.info("client disconnected; generation cancelled")
            if not self.stream:  # nothing was sent: /metrics counts a 499, not a 500
                scope[CLIENT_GONE_SCOPE_KEY] = True
            observe_event(scope, self.gen.model.name, Error("disconnected", "client went away"))
        finally:
            watcher.remove_done_callback(self._on_gone)
            self.gen.stream.cancel()  # no-op once the stream has finished

    def _on_gone(self, watcher: asyncio.Future[None]) -> None:
        """The disconnect watcher ended: cancel at once and wake the reader."""
        if watcher.cancelled():
            return
        self._gone = True
        self.gen.stream.cancel()
        self.gen.stream.interrupt()

    async def _batch(self) -> list[Event]:
        """The Events queued now (waiting for one), ``[]`` when woken early (ping
        timer); raises _Disconnected when the client left.

        One wait per engine step, however many events it brought: no task, no
        ``asyncio.wait``, one future (:meth:`RequestStream.next_batch`).
        """
        if self._gone:
            raise _Disconnected
        stream = self.gen.stream
        events: list[Event] = await stream.next_batch()
        if self._gone and not (events and isinstance(events[-1], (Done, Error))):
            raise _Disconnected
        if not events and stream.drained:  # pragma: no cover - an engine always ends a stream
            events = [Error("internal", "the generation ended without a final event")]
        for ev in events:
            if isinstance(ev, (Done, Error)):
                observe_event(self._scope, self.gen.model.name, ev)
        return events

    # ------------------------------------------------------------ SSE

    async def _run_stream(self, scope: Scope, send: Send, head_sent: bool) -> None:
        framing = framing_of(self.codec)
        if not head_sent:
            await _send_stream_head(scope, send, framing)
        loop = asyncio.get_running_loop()
        if self.opening:
            await send(_body(b"".join(framing.encode(f) for f in self.opening)))
        stream = self.gen.stream
        interval = self.ping_interval
        last_sent = loop.time()
        timer: asyncio.TimerHandle | None = None

        # One timer per ping interval, not one per event: when it fires and
        # nothing was sent for ``interval`` it wakes the reader, which pings.
        def tick() -> None:
            nonlocal timer
            quiet = loop.time() - last_sent
            if quiet >= interval:
                stream.interrupt()
                quiet = 0.0
            timer = loop.call_later(interval - quiet, tick)

        timer = loop.call_later(interval, tick)
        done: Done | None = None
        final = False
        try:
            while not final:
                events = await self._batch()
                if not events:
                    if loop.time() - last_sent >= interval * 0.999:
                        await send(_body(self.codec.ping()))
                        last_sent = loop.time()
                    continue
                frames: list[WireEvent] = []
                for ev in events:
                    frames += self.codec.feed(ev)
                    if isinstance(ev, (Done, Error)):
                        done = ev if isinstance(ev, Done) else None
                        final = True
                        break
                if frames:
                    await send(_body(b"".join(framing.encode(f) for f in frames)))
                    last_sent = loop.time()
        finally:
            if timer is not None:
                timer.cancel()
        await _end_stream(scope, send, framing, done.usage.cached_tokens if done is not None else 0)

    # ----------------------------------------------------------- JSON

    async def _run_json(self, scope: Scope, receive: Receive, send: Send) -> None:
        wire = list(self.opening)
        ev: Event | None = None
        while not isinstance(ev, Done):
            for ev in await self._batch():
                if isinstance(ev, Error):
                    status = error_kind(ev.kind).status
                    resp = error_response(self.dialect, status, ev.kind, ev.message)
                    await resp(scope, receive, send)
                    return
                wire += self.codec.feed(ev)
                if isinstance(ev, Done):
                    break
        if len(wire) > FOLD_OFF_LOOP_EVENTS:  # a long answer: fold and encode it off the loop
            body = await asyncio.to_thread(_fold_bytes, self.codec, wire)
        else:
            body = _fold_bytes(self.codec, wire)
        cached = ev.usage.cached_tokens
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-session-cache", b"prefix_hit" if cached > 0 else b"fresh"),
            (b"x-cached-tokens", str(cached).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _body(data: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": True}


class LoadingStreamResponse(Response):
    """SSE for a streamed request whose model is still loading (see the module doc).

    Sends the SSE head and a ping at once (the client has waited
    ``ping_interval`` already), then one every ``ping_interval`` while
    ``start`` (lease -> prepare -> submit) runs; then hands the stream to the
    :class:`GenerationResponse` that ``start`` built, or ends it with the
    dialect's in-stream error. ``codec`` serves only for pings and that error.
    A client that leaves cancels ``start`` (its wait gives up; the load goes on
    for the others).
    """

    def __init__(
        self,
        start: asyncio.Future[GenerationResponse],
        codec: Codec,
        *,
        dialect: Dialect,
        model: str,
        ping_interval: float = PING_INTERVAL,
    ) -> None:
        # Response.__init__ is not called: this class writes its own messages.
        self.status_code = 200
        self.background = None
        self.start = start
        self.codec = codec
        self.dialect = dialect
        self.model = model
        self.ping_interval = ping_interval

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        gen: GenerationResponse | None = None
        try:
            await _send_stream_head(scope, send, framing_of(self.codec))
            while True:
                await send(
                    {"type": "http.response.body", "body": self.codec.ping(), "more_body": True}
                )
                waiting: set[asyncio.Future[Any]] = {self.start, watcher}
                done, _ = await asyncio.wait(
                    waiting,
                    timeout=self.ping_interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if self.start in done:
                    break
                if watcher in done:
                    log.info("client disconnected while its model loaded")
                    observe_event(scope, self.model, Error("disconnected", "client went away"))
                    return
            try:
                gen = self.start.result()
            except CairnError as e:
                await self._fail(scope, send, e.kind, e.message_for(self.dialect.name))
                return
            except Exception:
                log.exception("starting a generation after its model loaded")
                await self._fail(scope, send, "internal", "internal server error")
                return
            await gen.run(scope, receive, send, watcher, head_sent=True)
        finally:
            watcher.cancel()
            if not self.start.done():
                self.start.cancel()
            elif gen is None and not self.start.cancelled() and self.start.exception() is None:
                self.start.result().gen.stream.cancel()  # built, never served
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _fail(self, scope: Scope, send: Send, kind: str, message: str) -> None:
        err = Error(kind, message)
        frames = self.codec.open() + self.codec.feed(err)
        framing = framing_of(self.codec)
        body = b"".join(framing.encode(f) for f in frames)
        await send({"type": "http.response.body", "body": body, "more_body": True})
        observe_event(scope, self.model, err)
        await _end_stream(scope, send, framing, 0)


async def _send_stream_head(scope: Scope, send: Send, framing: Framing) -> None:
    """``http.response.start`` of a streamed answer (trailers announced when the server has them)."""
    trailers = TRAILERS_EXT in (scope.get("extensions") or {})
    headers = [
        (b"content-type", framing.media_type),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"x-session-cache", b"streaming"),
    ]
    if trailers:
        headers.append((b"trailer", b"X-Session-Cache, X-Cached-Tokens"))
    await send(
        {"type": "http.response.start", "status": 200, "headers": headers, "trailers": trailers}
    )


async def _end_stream(scope: Scope, send: Send, framing: Framing, cached: int) -> None:
    """End a streamed answer with its session-cache figures (trailers, else a line
    clients skip: an SSE comment; nothing in NDJSON, which has no such line)."""
    session = b"prefix_hit" if cached > 0 else b"fresh"
    if TRAILERS_EXT in (scope.get("extensions") or {}):
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        await send(
            {
                "type": "http.response.trailers",
                "headers": [
                    (b"x-session-cache", session),
                    (b"x-cached-tokens", str(cached).encode()),
                ],
                "more_trailers": False,
            }
        )
    else:
        tail = framing.note(f"x-session-cache={session.decode()} x-cached-tokens={cached}")
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _fold_bytes(codec: Codec, wire: list[WireEvent]) -> bytes:
    return json_bytes(codec.fold(wire))


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
