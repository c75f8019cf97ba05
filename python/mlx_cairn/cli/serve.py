"""``cairn serve``: settings from flags and environment, checks, then uvicorn.

Start-up order, so that a mistake costs no model load::

    parse flags      cli/options.py: numeric flags are range-checked by their types
    build()          --context-length, token, aliases, names: ServeError
    bind_sockets()   the port is taken now (busy: ServeError)
    preload models   the embedded default (no --model / --models-dir) and, with
                     --preload, every model; then each KV pool is checked
                     against --kv-cache-gb. Other models load on first request.
    uvicorn          on the sockets bound above

Every refusal is one line naming the flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_cairn.engine.stats import EngineStats

from mlx_cairn.api.connection import http_protocol
from mlx_cairn.api.registry import DEFAULT_LOAD_WAIT, ModelRegistry
from mlx_cairn.api.settings import ServerConfig
from mlx_cairn.cli.options import add_arguments as add_arguments  # the subcommand's flags
from mlx_cairn.errors import KVPoolSizeError
from mlx_cairn.protocol.images import (
    DEFAULT_IMAGE_URL_TIMEOUT,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
)
from mlx_cairn.types import DEFAULT_KV_GROUP_SIZE

log = logging.getLogger("mlx_cairn.api")


class ServeError(Exception):
    """A setting that stops the server from starting."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(api_key_file: str | None, env: dict[str, str]) -> str | None:
    """The configured token (file first, then CAIRN_API_KEY); empty is an error."""
    if api_key_file is not None:
        try:
            token = Path(api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ServeError(f"cannot read --api-key-file: {e}") from None
        if not token:
            raise ServeError(f"--api-key-file {api_key_file} is empty; refusing to start")
        return token
    if "CAIRN_API_KEY" in env:
        token = env["CAIRN_API_KEY"].strip()
        if not token:
            raise ServeError("CAIRN_API_KEY is set but empty; refusing to start")
        return token
    return None


def parse_aliases(items: list[str]) -> dict[str, str]:
    """``NAME=MODEL`` pairs."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, target = item.partition("=")
        if not sep or not name or not target:
            raise ServeError(f"--alias expects NAME=MODEL, got {item!r}")
        out[name] = target
    return out


#: Claude Code's prompt is 12k-32k tokens (system prompt, 12-25 tools); with room
#: for an answer a model needs this much context to serve it.
CLAUDE_CODE_CONTEXT = 32768


def override_context(loaded: Any, tokens: int) -> None:
    """``--context-length``: serve ``loaded`` with ``tokens`` of context (warns above its training)."""
    trained = int(loaded.extra.setdefault("trained_context_length", loaded.context_length))
    if tokens > trained:
        log.warning(
            "%s: --context-length %d is above the %d tokens it was trained for; "
            "quality may drop past that point",
            loaded.name,
            tokens,
            trained,
        )
    loaded.context_length = tokens


def claude_code_fit(name: str, context: int) -> str:
    """One line saying whether a model's context can hold Claude Code's prompt."""
    if context >= CLAUDE_CODE_CONTEXT:
        return f"Claude Code: {name} has {context} tokens of context, enough for its prompt"
    return (
        f"Claude Code: {name} has {context} tokens of context, too few for its 12k-32k-token "
        f"prompt; serve a model with at least {CLAUDE_CODE_CONTEXT} "
        "(make serve SERVE_ARGS='--model PATH --default-model --clamp-max-tokens'), "
        f"or raise it with --context-length {2 * CLAUDE_CODE_CONTEXT}"
    )


def build(
    args: argparse.Namespace,
    env: dict[str, str],
    *,
    problems: list[str] | None = None,
    group: Any = None,
) -> tuple[ModelRegistry, ServerConfig]:
    """Validate the flags and build the (not yet loaded) registry and config.

    ``problems``: the engine factory appends there what a loaded model shows
    to be wrong with the flags (a KV pool too small for any request); the
    caller refuses to serve when it is not empty.
    """
    token = read_token(args.api_key_file, env)
    if token is None and not is_loopback(args.host) and not args.allow_no_auth:
        raise ServeError(
            f"refusing to serve on {args.host} without a token: set CAIRN_API_KEY or "
            "--api-key-file, or pass --allow-no-auth to accept anyone who can reach the port"
        )
    # The argparse types refuse these already; a Namespace built in code is checked here.
    for flag, value, low, inclusive in (
        ("--max-queue", args.max_queue, 1, True),
        ("--max-batch", getattr(args, "max_batch", None), 1, True),
        ("--context-length", args.context_length, 2, True),
        ("--max-tokens-limit", args.max_tokens_limit, 1, True),
        ("--max-body-mb", args.max_body_mb, 0, False),
        ("--kv-cache-gb", args.kv_cache_gb, 0, False),
        ("--kv-disk-gb", getattr(args, "kv_disk_gb", None), 0, False),
        ("--shutdown-grace", args.shutdown_grace, 0, True),
        ("--header-timeout", args.header_timeout, 0, False),
        ("--body-timeout", args.body_timeout, 0, False),
        ("--max-image-pixels", getattr(args, "max_image_pixels", None), 1, True),
        ("--max-image-bytes", getattr(args, "max_image_bytes", None), 1, True),
        ("--max-images", getattr(args, "max_images", None), 0, True),
        ("--image-url-timeout", getattr(args, "image_url_timeout", None), 0, False),
        ("--decode-share", getattr(args, "decode_share", None), 0, True),
    ):
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            bound = f"at least {low}" if inclusive else f"above {low}"
            raise ServeError(f"{flag} must be {bound}, got {value}")
    kv_bits = getattr(args, "kv_bits", None)
    kv_group_size = getattr(args, "kv_group_size", None) or DEFAULT_KV_GROUP_SIZE
    if kv_bits is not None or kv_group_size != DEFAULT_KV_GROUP_SIZE:
        from mlx_cairn.engine.paged_quant import check_kv_quant

        try:  # the head dimension is checked when each model's engine starts
            check_kv_quant(kv_bits, kv_group_size, [])
        except ValueError as e:
            raise ServeError(f"--kv-bits/--kv-group-size: {e}") from None
    if getattr(args, "speculative", None) and getattr(args, "draft_model", None):
        raise ServeError("--speculative and --draft-model are two ways to speculate: pick one")
    max_body_bytes = int(args.max_body_mb * 1024 * 1024)
    if max_body_bytes < 1:
        raise ServeError(f"--max-body-mb {args.max_body_mb:g} allows no body at all")

    kv_events = getattr(args, "kv_events", None)
    kv_replay = getattr(args, "kv_events_replay", None)
    if kv_replay is not None and kv_events is None:
        raise ServeError("--kv-events-replay replays what --kv-events publishes: give both")
    publisher: Any = None
    if kv_events is not None:
        if getattr(args, "models_dir", None) or len(args.model or []) > 1:
            raise ServeError(
                "--kv-events publishes one model's KV cache (a router's --kv-event-model): "
                "serve one model with --model"
            )
        from mlx_cairn.engine.kv_events import KVEventPublisher, KVEventsError

        try:  # bound now, so a busy port is refused before any model loads
            publisher = KVEventPublisher(kv_events, replay_endpoint=kv_replay)
        except KVEventsError as e:  # a bad address (the publisher checks it) or a busy port
            raise ServeError(f"--kv-events: {e}") from None

    draft_source = getattr(args, "draft_model", None)
    drafts: list[Any] = []  # the draft model, loaded once for every model that needs it
    draft_lock = threading.Lock()

    def draft_model() -> Any:
        if draft_source is None:
            return None
        with draft_lock:
            if not drafts:
                from mlx_cairn.models import load

                drafts.append(load(draft_source))
            return drafts[0]

    def engine_factory(loaded: Any) -> object:
        from mlx_cairn.engine import Engine, EngineConfig

        if getattr(loaded, "kind", None) == "embedding":  # models/embedding.py: no KV pool
            from mlx_cairn.engine.embedder import EmbeddingEngine

            if publisher is not None:
                log.warning(
                    "--kv-events: %s is an embedding model: it has no KV cache", loaded.name
                )

            return EmbeddingEngine(loaded, max_queue=args.max_queue)
        if args.context_length is not None:
            override_context(loaded, args.context_length)
        engine_class: Any = Engine
        extra: dict[str, Any] = {}
        if group is not None:  # rank 0 of several (engine/distributed.py)
            from mlx_cairn.engine.distributed import distributed_engine_class

            engine_class = distributed_engine_class()
            extra = {"group": group, "timeout": float(args.rank_timeout)}
        try:
            disk = getattr(args, "kv_disk_dir", None)
            config = EngineConfig(
                kv_cache_gb=args.kv_cache_gb,
                max_queue=args.max_queue,
                max_batch=getattr(args, "max_batch", None),
                kv_disk_dir=disk,
                kv_disk_gb=getattr(args, "kv_disk_gb", None),
                speculative=getattr(args, "speculative", None),
                num_speculative_tokens=getattr(args, "num_speculative_tokens", None),
                draft_model=draft_model(),
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
                decode_share=getattr(args, "decode_share", None),
                kv_events=publisher,
            )
            engine = engine_class(loaded, config, **extra)
        except ValueError as e:
            from mlx_cairn.engine.paged_quant import KVQuantError

            # The pool is sized from the model's shapes, so this is known only now.
            if (
                problems is not None
                and args.kv_cache_gb is not None
                and isinstance(e, KVPoolSizeError)
            ):
                problems.append(
                    f"--kv-cache-gb {args.kv_cache_gb:g} does not suit {loaded.name}: {e}"
                )
            # So is the head dimension a --kv-group-size must divide.
            if problems is not None and isinstance(e, KVQuantError):
                problems.append(
                    f"--kv-bits {kv_bits} --kv-group-size {kv_group_size} "
                    f"does not suit {loaded.name}: {e}"
                )
            raise
        if problems is not None:
            problem = kv_pool_problem(
                loaded.name, engine.stats(), engine.context_length, args.kv_cache_gb
            )
            if problem is not None and registry.serving.is_set():
                # Loaded on a request: that request (and its waiters) get the reason.
                engine.close()
                raise ValueError(problem)
            if problem is not None:
                problems.append(problem)
        return engine

    models_dir = getattr(args, "models_dir", None)
    sources: list[str | None] = list(args.model) if args.model or models_dir else [None]
    try:
        registry = ModelRegistry(
            sources,
            aliases=parse_aliases(args.alias),
            default_model=args.default_model,
            engine_factory=engine_factory,
            models_dir=models_dir,
            max_loaded=getattr(args, "max_loaded_models", None),
            memory_budget_gb=getattr(args, "memory_budget_gb", None),
            pins=getattr(args, "pin", []),
            idle_unload=getattr(args, "idle_unload", None),
            load_wait=getattr(args, "load_wait", DEFAULT_LOAD_WAIT),
            loader=None if group is None else _rank_loader(group),
        )
    except ValueError as e:
        raise ServeError(str(e)) from None
    config = ServerConfig(
        api_token=token,
        max_body_bytes=max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        clamp_max_tokens=args.clamp_max_tokens,
        cors_origins=tuple(dict.fromkeys(args.cors_origin)),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        images=ImageLimits(
            max_pixels=getattr(args, "max_image_pixels", None) or DEFAULT_MAX_IMAGE_PIXELS,
            max_bytes=getattr(args, "max_image_bytes", None) or DEFAULT_MAX_IMAGE_BYTES,
            max_images=_or(getattr(args, "max_images", None), DEFAULT_MAX_IMAGES),
            allow_urls=bool(getattr(args, "allow_image_urls", False)),
            url_timeout=getattr(args, "image_url_timeout", None) or DEFAULT_IMAGE_URL_TIMEOUT,
        ),
    )
    return registry, config


def _rank_loader(group: Any) -> Any:
    from mlx_cairn.engine.distributed import loader

    return loader(group)


def _or(value: Any, default: Any) -> Any:
    """``value``, or ``default`` where it is None (0 is a value)."""
    return default if value is None else value


#: The fewest tokens a KV pool must hold to serve anything useful (a short chat
#: turn and its answer); a model with a shorter context needs only its context.
MIN_KV_TOKENS = 1024


def kv_pool_problem(
    name: str, stats: EngineStats, context: int, kv_cache_gb: float | None
) -> str | None:
    """What makes a loaded model's KV pool unfit to serve, or None.

    ``stats`` is the engine's (``blocks_total`` usable blocks of ``block_size``
    tokens, ``kv_cache_bytes`` with the null block). A pool below
    :data:`MIN_KV_TOKENS` (or the whole ``context``, if shorter) is a problem;
    one below a full context only warns: longer requests get a 400 naming it.
    """
    blocks, block_size = stats.blocks_total, stats.block_size
    tokens = blocks * block_size
    per_block = float(stats.kv_cache_bytes) / (blocks + 1)

    def gib_for(n: int) -> str:  # rounded up to the MiB, as a --kv-cache-gb value
        need = (-(-n // block_size) + 1) * per_block
        return f"{math.ceil(need / 2**20) / 1024:.3f}".rstrip("0").rstrip(".")

    floor = min(MIN_KV_TOKENS, context)
    flag = f"--kv-cache-gb {kv_cache_gb:g}" if kv_cache_gb is not None else "the KV cache"
    if tokens < floor:
        return (
            f"{flag} holds {tokens} tokens for {name} ({blocks} blocks of {block_size}), "
            f"fewer than the {floor} a request may need; use --kv-cache-gb {gib_for(floor)} "
            "or more"
        )
    if tokens < context:
        log.warning(
            "%s: %s holds %d tokens, less than its %d-token context; a prompt plus max_tokens "
            "above %d gets a 400 (--kv-cache-gb %s holds a full context)",
            name,
            flag,
            tokens,
            context,
            tokens,
            gib_for(context),
        )
    return None


def bind_sockets(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to (``localhost``:
    IPv4 and IPv6), bound now so a busy port is refused before any model loads."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG
        )
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # As uvicorn and asyncio do: a restart may reuse a port in TIME_WAIT,
            # never one that another process is listening on.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ServeError(
                        f"--port {port}: {host}:{port} is already in use "
                        "(another server is listening there)"
                    ) from None
                raise ServeError(
                    f"--host {host} --port {port}: cannot listen: {e.strerror}"
                ) from None
            sock.listen(backlog)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def run(args: argparse.Namespace) -> int:
    """Entry point of ``cairn serve``."""

    from mlx_cairn.api.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    problems: list[str] = []
    group = None
    if "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        # One model over several ranks (engine/distributed.py): rank 0 serves HTTP.
        from mlx_cairn.engine import distributed

        for problem in distributed.startup_problems(args):
            print(f"cairn serve: {problem}", file=sys.stderr)
            problems.append(problem)
        if problems:
            return 2
        group = distributed.group_from_env()
        if group is not None and group.rank() > 0:
            return distributed.serve_follower(args, group)
    try:
        registry, config = build(args, dict(os.environ), problems=problems, group=group)
        sockets = bind_sockets(args.host, args.port)
    except ServeError as e:
        print(f"cairn serve: {e}", file=sys.stderr)
        return 2
    try:
        if group is not None:  # every rank loads its shard now
            registry.preload([registry.models[0].name])
            if registry.models[0].state != "loaded":
                problems.append(str(registry.models[0].error or "the model did not load"))
        elif args.preload:
            registry.load_all()
        elif not args.model and not getattr(args, "models_dir", None):
            registry.preload([registry.models[0].name])  # `make serve` is ready when it says so
        registry.serving.set()
        if problems:
            for problem in problems:
                print(f"cairn serve: {problem}", file=sys.stderr)
            registry.close()
            return 2
        app = create_app(registry, config)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    for sm in registry.models:
        if sm.loaded is not None and getattr(sm.loaded, "kind", None) != "embedding":
            print(claude_code_fit(sm.name, int(sm.loaded.context_length)), flush=True)
    names = ", ".join(registry.names())
    log.info(
        "serving %s on http://%s:%d (auth: %s)",
        names,
        args.host,
        args.port,
        "token" if config.api_token else "none",
    )
    try:
        _serve(app, registry, args, sockets, config)
    finally:
        if getattr(args, "kv_events", None):
            from mlx_cairn.engine.kv_events import close_all

            close_all()  # after the engines: their last AllBlocksCleared goes out
    return 0


#: After the grace period, uvicorn gets this long to send the final error frames.
_FLUSH_SECONDS = 5.0


def _serve(
    app: object,
    registry: ModelRegistry,
    args: argparse.Namespace,
    sockets: list[socket.socket],
    settings: ServerConfig,
) -> None:
    """Run uvicorn until SIGTERM / Ctrl-C, then shut down so that every stream ends properly.

    On the first signal uvicorn stops accepting connections and waits for the
    open ones. In-flight generations get ``--shutdown-grace`` seconds to
    finish; then the engines are closed, which ends every generation still
    running with an Error event, so each client sees its dialect's ``error``
    frame (or a 500 envelope) instead of a cut connection. A clean shutdown
    exits 0.
    """
    import uvicorn

    grace = float(args.shutdown_grace)
    timers: list[threading.Timer] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                timer = threading.Timer(grace, registry.close)
                timer.daemon = True
                timers.append(timer)
                timer.start()

    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(grace + _FLUSH_SECONDS),
        http=http_protocol(settings.header_timeout, settings.body_timeout),
        ws="none",  # no WebSocket routes: an Upgrade request is plain HTTP here
    )
    # uvicorn re-raises the signal it shut down for once it is done, which
    # would kill the process with it; after a clean shutdown that is a no-op.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for timer in timers:
            timer.cancel()
        registry.close()


def _ignore(sig: int, frame: FrameType | None) -> None:
    return None
