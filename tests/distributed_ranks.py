"""One run of several ranks (under ``mlx.launch``) that serves each model in turn.

Rank 0 serves each folder over HTTP (``cairn serve``'s own ``build`` with its
flags), runs :func:`workload` on it through the official OpenAI SDK (with
``--preempt``, that folder once more in a tiny pool: :func:`preempt_workload`),
checks its engine is at rest and writes what it got (and ``/health``'s figures)
to ``--out``; the other ranks follow each model's steps until rank 0
closes its engine. The test (test_distributed.py) runs the same workload on a
single-process server and compares.

    mlx.launch --backend ring -n 2 --python PY tests/distributed_ranks.py --out F \
        [--preempt DIR]... DIR...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import mlx_cairn  # noqa: F401  (optimized BLAS before mlx)

#: A system prompt of several KV blocks (16 tokens each), re-sent by every request.
SYSTEM = (
    "You are a helpful assistant. Answer the question of the user. "
    "The capital of France is Paris. Hello world! How are you today? I am fine. "
    "def add(x, y): return x + y"
)
QUESTIONS = ["What is the capital of France?", "Hello world!", "def add(x, y):", "How are you?"]
MAX_TOKENS = 10
#: Tokens the request beside a cancelled stream generates (it runs on past the cancel).
BESIDE_TOKENS = 16
#: Usable KV blocks (16 tokens) of the pool :func:`preempt_workload` runs in: fewer
#: than its 4 requests need at once (3 blocks each), more than one needs alone.
TINY_POOL_BLOCKS = 6
PREEMPT_TOKENS = 24


def workload(url: str, model: str) -> dict[str, Any]:
    """Two rounds of the same 4 requests, each round sent at once (batched); the
    second round hits the prefix cache. Greedy (temperature 0)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int, out: list[Any]) -> None:
        r = client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTIONS[i]},
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        details = r.usage.prompt_tokens_details if r.usage else None
        out[i] = (r.choices[0].message.content, (details.cached_tokens or 0) if details else 0)

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    rounds = []
    try:
        # Constrained decoding (grammar masks, rows sampled after their last token is
        # read back) and a streamed answer, each beside a plain request.
        extra: list[Any] = [None, None]
        plain = threading.Thread(target=one, args=(0, extra))
        plain.start()
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Where is Paris? Answer in JSON."}],
            max_tokens=24,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": schema, "strict": True},
            },
        )
        constrained = r.choices[0].message.content
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[1]}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        plain.join()
        beside, cancelled_chunks, outlived = cancel_beside(client, model)
        for _ in range(2):
            got: list[Any] = [None] * len(QUESTIONS)
            threads = [threading.Thread(target=one, args=(i, got)) for i in range(len(QUESTIONS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rounds.append(got)
    finally:
        client.close()
    return {
        "texts": [[g[0] for g in r] for r in rounds],
        "cached": [[g[1] for g in r] for r in rounds],
        "constrained": constrained,
        "streamed": streamed,
        "beside_cancelled": beside,
        "cancelled_chunks": cancelled_chunks,
        "beside_outlived_cancel": outlived,
    }


def cancel_beside(client: Any, model: str) -> tuple[str | None, int, bool]:
    """A streamed request the client closes after a few chunks, while a plain request
    (sent once the stream's first chunk came) runs beside it; returns the plain one's answer, the chunks read before closing,
    and whether the plain one was still running then."""
    other: list[Any] = [None, 0.0]

    def plain() -> None:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[2]}],
            max_tokens=BESIDE_TOKENS,
            temperature=0,
        )
        other[:] = [r.choices[0].message.content, time.monotonic()]

    t = threading.Thread(target=plain)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTIONS[3]}],
        max_tokens=500,
        temperature=0,
        stream=True,
    )
    seen = 0
    for c in stream:
        seen += bool(c.choices and c.choices[0].delta.content)
        if seen == 1 and t.ident is None:
            t.start()  # once the stream runs: the plain one cannot finish first
        if seen >= 2:
            break
    stream.close()  # the server notices the closed connection and cancels
    closed = time.monotonic()
    if t.ident is None:  # the stream said nothing: the plain one runs alone
        t.start()
    t.join()
    return other[0], seen, other[1] > closed


def preempt_workload(url: str, model: str) -> list[str | None]:
    """4 requests with no prefix in common, sent at once, greedy: in a pool of
    :data:`TINY_POOL_BLOCKS` blocks they preempt each other."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    got: list[str | None] = [None] * len(QUESTIONS)

    def one(i: int) -> None:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[i]}],
            max_tokens=PREEMPT_TOKENS,
            temperature=0,
        )
        got[i] = r.choices[0].message.content

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        client.close()
    return got


def serve_args(folder: str, timeout: float) -> argparse.Namespace:
    from mlx_cairn.cli import serve as server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return parser.parse_args(["--model", folder, "--rank-timeout", str(timeout)])


@contextlib.contextmanager
def tiny_pool(distributed: Any) -> Iterator[None]:
    """Engines rank 0 builds meanwhile get a pool of :data:`TINY_POOL_BLOCKS` usable
    blocks (the other ranks size theirs from rank 0's)."""
    base = distributed.distributed_engine_class

    def tiny() -> type:
        class TinyPool(base()):  # type: ignore[misc]
            def __init__(self, loaded: Any, config: Any = None, **kwargs: Any) -> None:
                from mlx_cairn.engine import EngineConfig

                config = dataclasses.replace(
                    config or EngineConfig(), kv_cache_gb=None, num_blocks=TINY_POOL_BLOCKS + 1
                )
                super().__init__(loaded, config, **kwargs)
                self._fault_hook = self._gather_first_step

            def _gather_first_step(self) -> None:
                # The first step waits (bounded) until the other requests have
                # queued: they meet in the pool at once, however slowly they arrive.
                self._fault_hook = None
                for _ in range(500):
                    if self.stats().queue_depth >= len(QUESTIONS) - 1:
                        return
                    time.sleep(0.01)

        return TinyPool

    distributed.distributed_engine_class = tiny
    try:
        yield
    finally:
        distributed.distributed_engine_class = base


def at_rest(engine: Any) -> str | None:
    """Why rank 0's engine is not at rest (a block or state slot still held), or None."""
    from mlx_cairn.testing.engine_checks import assert_at_rest

    try:
        assert_at_rest(engine)
    except AssertionError as e:
        return str(e) or "not at rest"
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument(
        "--preempt",
        action="append",
        default=[],
        metavar="FOLDER",
        help="last, serve FOLDER again in a pool of TINY_POOL_BLOCKS blocks and run "
        "preempt_workload on it (repeatable)",
    )
    p.add_argument("folders", nargs="+")
    opts = p.parse_args()
    logging.basicConfig(level="WARNING")
    import httpx

    from mlx_cairn.cli import serve as server
    from mlx_cairn.engine import distributed

    group = distributed.group_from_env()
    assert group is not None, "run under mlx.launch with 2 or more ranks"
    results: dict[str, Any] = {}
    runs = [(folder, False) for folder in opts.folders]
    runs += [(folder, True) for folder in opts.preempt]
    for folder, tiny in runs:
        args = serve_args(folder, opts.timeout)
        assert not distributed.startup_problems(args)
        if group.rank() > 0:
            if distributed.serve_follower(args, group) != 0:
                return 1
            continue
        from live_server import serve

        registry, config = server.build(args, {}, problems=[], group=group)
        name = registry.models[0].name
        with tiny_pool(distributed) if tiny else contextlib.nullcontext():
            registry.preload([name])
        assert registry.models[0].state == "loaded", registry.models[0].error
        engine = registry.models[0].engine
        try:
            with serve(registry, config) as srv:
                if tiny:
                    texts = preempt_workload(srv.url, name)
                    got = results[f"{name} (preempted)"] = {"texts": texts}
                else:
                    got = results[name] = workload(srv.url, name)
                got["at_rest"] = at_rest(engine)
                health = httpx.get(srv.url + "/health", timeout=10).json()
                got["stats"] = health["models"][0]["stats"]
        finally:
            registry.close()  # the engine says STOP: the other ranks move on
    if group.rank() == 0:
        Path(opts.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
