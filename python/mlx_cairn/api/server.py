"""``cairn serve``: settings from flags and environment, checks, then uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from mlx_cairn.api.registry import ModelRegistry
from mlx_cairn.api.state import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_LIMIT,
    ServerConfig,
    cors_origin,
)

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


def build(args: argparse.Namespace, env: dict[str, str]) -> tuple[ModelRegistry, ServerConfig]:
    """Validate the flags and build the (not yet loaded) registry and config."""
    token = read_token(args.api_key_file, env)
    if token is None and not is_loopback(args.host) and not args.allow_no_auth:
        raise ServeError(
            f"refusing to serve on {args.host} without a token: set CAIRN_API_KEY or "
            "--api-key-file, or pass --allow-no-auth to accept anyone who can reach the port"
        )
    if args.max_queue < 1:
        raise ServeError("--max-queue must be at least 1")

    if args.context_length is not None and args.context_length < 2:
        raise ServeError("--context-length must be at least 2")

    def engine_factory(loaded: Any) -> object:
        from mlx_cairn.engine import Engine

        if args.context_length is not None:
            override_context(loaded, args.context_length)
        return Engine(loaded, kv_cache_gb=args.kv_cache_gb, max_queue=args.max_queue)

    sources: list[str | None] = list(args.model) if args.model else [None]
    try:
        registry = ModelRegistry(
            sources,
            aliases=parse_aliases(args.alias),
            default_model=args.default_model,
            engine_factory=engine_factory,
        )
    except ValueError as e:
        raise ServeError(str(e)) from None
    config = ServerConfig(
        api_token=token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_tokens_limit=args.max_tokens_limit,
        clamp_max_tokens=args.clamp_max_tokens,
        cors_origins=tuple(dict.fromkeys(args.cors_origin)),
    )
    return registry, config


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``cairn serve`` flags."""
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH_OR_NAME",
        help="model folder or GGUF file to serve (repeatable); default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="another name for a served model; NAME may be a glob such as 'claude-*' (repeatable)",
    )
    p.add_argument(
        "--default-model",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL",
        help="serve any unknown claude-* model name with MODEL (no value: the first served model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="file holding the shared API token (else env CAIRN_API_KEY; else no auth)",
    )
    p.add_argument(
        "--allow-no-auth", action="store_true", help="allow a non-loopback --host without a token"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="waiting requests before new ones get 429",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        metavar="X",
        help="KV cache size in GiB (default: sized from free memory)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        metavar="N",
        help="serve every model with a context of N tokens instead of its configured one "
        "(warns above the trained length)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / 2**20,
        help="largest request body accepted (413 above it)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=DEFAULT_MAX_TOKENS_LIMIT,
        help="largest max_tokens accepted (400 above it)",
    )
    p.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        help="when prompt + max_tokens exceed the context, generate up to the context "
        "instead of answering 400 (useful for Claude Code, which asks for 32k)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        type=cors_origin,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (e.g. http://localhost:5173, or '*' for any) "
        "call the server: CORS headers and preflight answers (repeatable; default: none)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, time for running generations to finish before they are "
        "ended with an error event",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Entry point of ``cairn serve``."""

    from mlx_cairn.api.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        registry, config = build(args, dict(os.environ))
    except ServeError as e:
        print(f"cairn serve: {e}", file=sys.stderr)
        return 2
    registry.load_all()
    app = create_app(registry, config)
    for sm in registry.models:
        if sm.loaded is not None:
            print(claude_code_fit(sm.name, int(sm.loaded.context_length)), flush=True)
    names = ", ".join(registry.names())
    log.info(
        "serving %s on http://%s:%d (auth: %s)",
        names,
        args.host,
        args.port,
        "token" if config.api_token else "none",
    )
    _serve(app, registry, args)
    return 0


#: After the grace period, uvicorn gets this long to send the final error frames.
_FLUSH_SECONDS = 5.0


def _serve(app: object, registry: ModelRegistry, args: argparse.Namespace) -> None:
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
    )
    # uvicorn re-raises the signal it shut down for once it is done, which
    # would kill the process with it; after a clean shutdown that is a no-op.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for timer in timers:
            timer.cancel()
        registry.close()


def _ignore(sig: int, frame: FrameType | None) -> None:
    return None
