"""One run of several ranks (under ``mlx.launch``) that serves each model in turn.

Rank 0 serves each folder over HTTP (``cairn serve``'s own ``build`` with its
flags), runs :func:`workload` on it through the official OpenAI SDK and writes
what it got to ``--out``; the other ranks follow each model's steps until rank 0
closes its engine. The test (test_distributed.py) runs the same workload on a
single-process server and compares.

    mlx.launch --backend ring -n 2 --python PY tests/distributed_ranks.py --out F DIR...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
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
    }


def serve_args(folder: str, timeout: float) -> argparse.Namespace:
    from mlx_cairn.api import server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return parser.parse_args(["--model", folder, "--rank-timeout", str(timeout)])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("folders", nargs="+")
    opts = p.parse_args()
    logging.basicConfig(level="WARNING")
    from mlx_cairn.api import server
    from mlx_cairn.engine import distributed

    group = distributed.group_from_env()
    assert group is not None, "run under mlx.launch with 2 or more ranks"
    results: dict[str, Any] = {}
    for folder in opts.folders:
        args = serve_args(folder, opts.timeout)
        assert not distributed.startup_problems(args)
        if group.rank() > 0:
            if distributed.serve_follower(args, group) != 0:
                return 1
            continue
        from live_server import serve

        registry, config = server.build(args, {}, problems=[], group=group)
        name = registry.models[0].name
        registry.preload([name])
        assert registry.models[0].state == "loaded", registry.models[0].error
        try:
            with serve(registry, config) as srv:
                results[name] = workload(srv.url, name)
                stats = registry.models[0].engine.stats()
                results[name]["prefix_hit_tokens"] = stats.prefix_hit_tokens
        finally:
            registry.close()  # the engine says STOP: the other ranks move on
    if group.rank() == 0:
        Path(opts.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
