"""Sessions sent together with one shared prefix: is the prefix computed once? (issue 33)

Starts ``cairn serve`` (embedded default model, SmolLM2-135M) on a free loopback
port, warms it with one short request, then sends ``--sessions`` OpenAI chat
streams at once: the same system prompt of about ``--prefix-tokens`` tokens,
each with its own user message of about ``--part-tokens`` tokens. It reports:

- prefill tokens computed, from the server's ``/health`` figures: the prompt
  tokens of the burst less its prefix hits (``prefix_hit_tokens``, partial-block
  copies included), and the engine's ``prefill_tokens`` counter where the server
  has one (they agree when nothing is preempted);
- the ideal: the shared token prefix once, plus each session's own tokens
  (prompts rendered and tokenized in this process, the way the server does);
- their ratio (the bar: at most 1.1x), the wall time of the burst, and TTFT
  per session.

Run (about 2-4 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_shared_prefix.py
    .venv/bin/python bench/bench_shared_prefix.py --sessions 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import httpx

from http_stream import greedy_chat_body, stream_request  # bench/ is on sys.path
from serve_proc import TOKEN, free_port, wait_ready

WORDS = [
    "the", "a", "river", "stone", "path", "north", "light", "keeper", "harbour", "winter",
    "engine", "signal", "map", "ledger", "garden", "tower", "bridge", "market", "lantern",
    "archive", "copper", "valley", "orchard", "station", "letter", "clock", "mountain",
    "ferry", "island", "meadow", "compass", "quarry", "canal", "mill", "forest", "beacon",
    "road", "carries", "holds", "marks", "follows", "crosses", "shelters", "records",
    "guards", "measures", "opens", "under", "beside", "through", "before", "after",
    "slowly", "quietly", "every", "each", "old", "new", "small", "long",
]  # fmt: skip


def text(seed: int, n_words: int) -> str:
    """Deterministic prose-like filler (sentences of 8-16 words)."""
    rnd = random.Random(seed)
    out: list[str] = []
    while len(out) < n_words:
        k = rnd.randint(8, 16)
        s = [rnd.choice(WORDS) for _ in range(k)]
        s[0] = s[0].capitalize()
        out.extend(s)
        out[-1] += "."
    return " ".join(out[:n_words])


def fit(tok_len: Any, seed: int, target: int) -> str:
    """Filler of about ``target`` tokens (``tok_len(text)`` counts them)."""
    lo, hi = 1, target * 2
    while lo < hi:  # the most words whose token count stays within the target
        mid = (lo + hi + 1) // 2
        if tok_len(text(seed, mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return text(seed, lo)


def messages(system: str, part: str, i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Notes from session {i}: {part} Summarise them."},
    ]


def plan(args: argparse.Namespace) -> tuple[list[list[dict[str, str]]], list[list[int]]]:
    """The sessions' messages, and their prompt ids as the server renders them."""
    from mlx_cairn.engine.prepare import prepare
    from mlx_cairn.models import load
    from mlx_cairn.types import ChatRequest, Message

    lm = load()

    def ids(msgs: list[dict[str, str]]) -> list[int]:
        req = ChatRequest(messages=[Message(m["role"], m["content"]) for m in msgs], max_tokens=1)
        return prepare(lm, req, context_length=1 << 20, max_tokens_capacity=1 << 20).prompt_ids

    def n_tokens(s: str) -> int:
        return len(lm.tokenizer.encode(s))

    system = fit(n_tokens, 1, args.prefix_tokens)
    parts = [fit(n_tokens, 100 + i, args.part_tokens) for i in range(args.sessions)]
    msgs = [messages(system, p, i) for i, p in enumerate(parts)]
    return msgs, [ids(m) for m in msgs]


def shared_len(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def stats(url: str) -> dict[str, Any]:
    h = httpx.get(url + "/health", headers={"x-api-key": TOKEN}, timeout=30).json()
    return h["models"][0]["stats"]  # type: ignore[no-any-return]


def body(msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return greedy_chat_body("default", msgs, max_tokens)


async def burst(port: int, bodies: list[dict[str, Any]]) -> tuple[float, list[Any]]:
    path = "/v1/chat/completions"
    hdr = {"x-api-key": TOKEN}
    t0 = time.perf_counter()
    res = await asyncio.gather(*(stream_request("127.0.0.1", port, path, b, hdr) for b in bodies))
    return time.perf_counter() - t0, list(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="shared system prompt")
    ap.add_argument("--part-tokens", type=int, default=300, help="each session's own message")
    ap.add_argument("--max-tokens", type=int, default=8, help="generated tokens per session")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--server-log", type=Path, default=Path(tempfile.gettempdir()) / "cairn-shared-prefix.log"
    )
    args = ap.parse_args()

    msgs, prompts = plan(args)
    gc.collect()  # the model loaded to tokenize goes before the server starts
    shared = shared_len(prompts)
    total = sum(len(p) for p in prompts)
    ideal = total - (len(prompts) - 1) * shared
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    env = dict(os.environ, CAIRN_API_KEY=TOKEN)
    proc = subprocess.Popen(
        cmd, env=env, stdout=args.server_log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        wait_ready(url, proc)
        warm = body([{"role": "user", "content": "Say hello."}], 4)
        _, (r,) = asyncio.run(burst(port, [warm]))  # loads the model; shares nothing
        if r.error:
            raise RuntimeError(f"warm-up failed: {r.error}")
        before = stats(url)
        wall, results = asyncio.run(burst(port, [body(m, args.max_tokens) for m in msgs]))
        time.sleep(0.5)  # the stats snapshot follows the engine's last step
        after = stats(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors}")
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    computed = total - hits
    counter = (
        after["prefill_tokens"] - before["prefill_tokens"] if "prefill_tokens" in after else None
    )
    ttft = [round(1000 * (r.ttft_s or 0.0)) for r in results]
    out = {
        "sessions": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "shared_prefix_tokens": shared,
        "prompt_tokens_total": total,
        "ideal_prefill_tokens": ideal,
        "computed_prefill_tokens": computed,
        "engine_prefill_tokens": counter,
        "ratio": round(computed / ideal, 3),
        "join_waits": after.get("prefix_join_waits", 0) - before.get("prefix_join_waits", 0),
        "preemptions": after["preemptions"] - before["preemptions"],
        "wall_s": round(wall, 2),
        "ttft_ms": ttft,
    }
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
