"""One model on one process vs over 2 ranks (MLX distributed, ring over loopback TCP).

Starts ``cairn serve`` alone, then as 2 ranks (``MLX_HOSTFILE`` / ``MLX_RANK`` set
by hand, both on this machine), on the same folder, and measures greedy
generation through the OpenAI API: one stream, then N streams at once
(aggregate output tokens per second over the wall time).

    python bench/bench_distributed.py FOLDER [--streams 8] [--tokens 64]

Both ranks share this machine's cores here, so this measures the cost of the
step broadcast and the collectives, not a gain: the gain of splitting comes
from a second machine's memory bandwidth and memory (README, "One model over
several machines").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(folder: str, ranks: int, tmp: Path) -> tuple[str, list[subprocess.Popen[bytes]]]:
    port = _port()
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--port", str(port)]
    cmd += ["--model", folder, "--log-level", "warning"]
    procs = []
    if ranks == 1:
        procs.append(subprocess.Popen(cmd, env=env))
    else:
        hosts = tmp / "hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{_port()}"] for _ in range(ranks)]))
        for r in range(ranks):
            procs.append(
                subprocess.Popen(cmd, env={**env, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(r)})
            )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, procs
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def _run(url: str, model: str, streams: int, tokens: int) -> float:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    counts = [0] * streams

    def one(i: int) -> None:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell me a story number {i}."}],
            max_tokens=tokens,
            temperature=0,
        )
        counts[i] = r.usage.completion_tokens if r.usage else 0

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    opts = p.parse_args()
    model = Path(opts.folder).name
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            url, procs = _start(opts.folder, ranks, Path(tmp))
            try:
                _run(url, model, 1, 8)  # warm up
                one = _run(url, model, 1, opts.tokens)
                many = _run(url, model, opts.streams, opts.tokens)
            finally:
                for proc in procs:  # rank 0 first: its engine tells the others to stop
                    proc.terminate()
                    proc.wait(60)
            rows.append((ranks, one, many))
    print(f"| ranks | 1 stream tok/s | {opts.streams} streams tok/s |")
    print("|---|---|---|")
    for ranks, one, many in rows:
        print(f"| {ranks} | {one:.1f} | {many:.1f} |")


if __name__ == "__main__":
    main()
