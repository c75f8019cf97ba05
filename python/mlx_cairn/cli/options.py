"""The ``cairn serve`` flags: their types and ``add_arguments``.

Every numeric flag is range-checked by its argparse type, so a bad value is
refused ("argument --flag: <message>", exit status 2) before anything loads.
What needs more than one flag, or the environment, is checked in
``cli/serve.py``'s ``build()``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from mlx_cairn.api.connection import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT
from mlx_cairn.api.registry import DEFAULT_LOAD_WAIT
from mlx_cairn.api.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS_LIMIT, cors_origin
from mlx_cairn.protocol.images import (
    DEFAULT_IMAGE_URL_TIMEOUT,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
)
from mlx_cairn.types import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_NUM_SPECULATIVE,
    KV_BITS,
    KV_GROUP_SIZES,
    MAX_NUM_SPECULATIVE,
    SPECULATIVE_MODES,
)

# ------------------------------------------------------------- flag types
# argparse reports a type's ArgumentTypeError as "argument --flag: <message>"
# and exits 2, before anything is loaded.


def _number(text: str, kind: Callable[[str], float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 1..65535."""
    value = int(_number(text, int))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, got {text}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer flag type that refuses values below ``minimum``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    return parse


def at_most(maximum: int, parse: Callable[[str], int]) -> Callable[[str], int]:
    """``parse``, refusing values above ``maximum`` too."""

    def bounded(text: str) -> int:
        value = parse(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {text}")
        return value

    return bounded


def zmq_endpoint(text: str) -> str:
    """A ZMQ bind address for ``--kv-events`` (tcp://HOST:PORT or ipc://PATH)."""
    from mlx_cairn.engine.kv_events import KVEventsError, check_endpoint

    try:
        return check_endpoint(text)
    except KVEventsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive(text: str) -> float:
    """A finite number above 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def non_negative(text: str) -> float:
    """A finite number, 0 or more."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def share(text: str) -> float:
    """A fraction from 0 to ``MAX_DECODE_SHARE`` (``--decode-share``)."""
    from mlx_cairn.engine.config import MAX_DECODE_SHARE

    value = non_negative(text)
    if value > MAX_DECODE_SHARE:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_DECODE_SHARE}, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``cairn serve`` flags."""
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH_OR_NAME",
        help="model folder, GGUF file or Hugging Face ORG/NAME[@REVISION] to serve (repeatable; "
        "hub names come from the local HF cache, downloaded if missing unless HF_HUB_OFFLINE=1); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--models-dir",
        metavar="DIR",
        help="also offer every model folder (with config.json) and .gguf file under DIR",
    )
    p.add_argument(
        "--preload",
        action="store_true",
        help="load every model at start-up instead of on the first request that names it "
        "(the embedded default model is always preloaded)",
    )
    p.add_argument(
        "--max-loaded-models",
        type=at_least(1),
        default=None,
        metavar="N",
        help="keep at most N models loaded; loading another unloads the least recently used idle one",
    )
    p.add_argument(
        "--memory-budget-gb",
        type=positive,
        default=None,
        metavar="X",
        help="keep loaded models (weights + KV pool) within X GiB, unloading the least recently "
        "used idle ones",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="never unload NAME (repeatable)",
    )
    p.add_argument(
        "--idle-unload",
        type=positive,
        default=None,
        metavar="SECONDS",
        help="unload a model no request has used for SECONDS",
    )
    p.add_argument(
        "--load-wait",
        type=positive,
        default=DEFAULT_LOAD_WAIT,
        metavar="SECONDS",
        help="how long a request waits for room to load its model before a 503",
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
    p.add_argument("--port", type=port_number, default=8080, help="1 to 65535")
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
        type=at_least(1),
        default=64,
        metavar="N",
        help="waiting requests before new ones get 429",
    )
    p.add_argument(
        "--max-batch",
        type=at_least(1),
        default=None,
        metavar="N",
        help="requests generating at once; the rest wait in the queue "
        "(default 32, 16 for models with recurrent layers)",
    )
    p.add_argument(
        "--decode-share",
        type=share,
        default=None,
        metavar="X",
        help="least share of the time streams that are generating get while other "
        "requests prefill, 0 to 0.9 (default 0.5; 0: prefill chunks ride in every step, "
        "the most prefill throughput and the slowest streams meanwhile)",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=positive,
        default=None,
        metavar="X",
        help="KV cache size in GiB (default: sized from free memory)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="store the KV cache quantized to 8 or 4 bits (~2x / ~3.5x the tokens in the "
        "same --kv-cache-gb; default full precision)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=DEFAULT_KV_GROUP_SIZE,
        help="values per scale/bias group with --kv-bits (must divide the head dimension)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="keep evicted KV blocks in DIR (a disk tier that survives restarts)",
    )
    p.add_argument(
        "--kv-disk-gb",
        type=positive,
        default=None,
        metavar="X",
        help="the most the disk tier's directory may hold, in GiB (default 16)",
    )
    p.add_argument(
        "--kv-events",
        type=zmq_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish KV-cache events (vLLM's format: BlockStored / BlockRemoved) on a ZMQ "
        "PUB socket bound here, for vllm-router --policy kv_aware --kv-event-source "
        "WORKER_URL=tcp://HOST:PORT (one model only)",
    )
    p.add_argument(
        "--kv-events-replay",
        type=zmq_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="with --kv-events: a ZMQ ROUTER socket bound here answers a subscriber's "
        "replay request (a start seq) with the batches it missed, from a buffer of the newest",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default=None,
        help="speculative decoding: 'ngram' proposes what followed the latest match of "
        "the last tokens in the prompt and output (exact: greedy output is unchanged)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH_OR_NAME",
        help="speculative decoding with a draft model: a small model with the same "
        "tokenizer (a folder, a GGUF file or a hub name) proposes, the model verifies",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=at_most(MAX_NUM_SPECULATIVE, at_least(1)),
        default=None,
        metavar="K",
        help=f"most draft tokens per step and request, adapted to acceptance "
        f"(default {DEFAULT_NUM_SPECULATIVE})",
    )
    p.add_argument(
        "--context-length",
        type=int,  # range-checked in build() (tests build Namespaces with bad values)
        default=None,
        metavar="N",
        help="serve every model with a context of N tokens instead of its configured one "
        "(warns above the trained length)",
    )
    p.add_argument(
        "--max-body-mb",
        type=positive,
        default=DEFAULT_MAX_BODY_BYTES / 2**20,
        help="largest request body accepted (413 above it)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=at_least(1),
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
        "--max-image-pixels",
        type=at_least(1),
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="largest image accepted, in pixels (width x height), checked from its header "
        f"before it is decoded (400 above it; default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    p.add_argument(
        "--max-image-bytes",
        type=at_least(1),
        default=DEFAULT_MAX_IMAGE_BYTES,
        metavar="N",
        help=f"largest image accepted, in bytes once base64 is decoded or as fetched "
        f"(default {DEFAULT_MAX_IMAGE_BYTES}, 20 MiB)",
    )
    p.add_argument(
        "--max-images",
        type=at_least(0),
        default=DEFAULT_MAX_IMAGES,
        metavar="N",
        help=f"most images in one request (default {DEFAULT_MAX_IMAGES}; 0 refuses images)",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs that requests name (default: such a request is a 400; "
        "only inline images, base64 or data: URLs, are read)",
    )
    p.add_argument(
        "--image-url-timeout",
        type=positive,
        default=DEFAULT_IMAGE_URL_TIMEOUT,
        metavar="SECONDS",
        help=f"time one image URL may take to fetch, with --allow-image-urls "
        f"(default {DEFAULT_IMAGE_URL_TIMEOUT:g})",
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
        type=non_negative,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, time for running generations to finish before they are "
        "ended with an error event",
    )
    p.add_argument(
        "--header-timeout",
        type=positive,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that has not sent a complete request head in this time",
    )
    p.add_argument(
        "--body-timeout",
        type=positive,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="answer 408 and close when a request body makes no progress for this long",
    )
    p.add_argument(
        "--rank-timeout",
        type=positive,
        default=60.0,
        metavar="SECONDS",
        help="across ranks (under mlx.launch): a step or heartbeat that takes longer "
        "means a rank is lost; requests then fail with 503 and every rank exits",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
