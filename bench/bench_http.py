"""Over HTTP, side by side: ``cairn serve`` vs ``mlx_lm.server`` on the same weights (issue 17).

The speed claims in the README rest on this benchmark. One invocation:

1. exports the embedded SmolLM2-135M (dequantized to fp32, as both sides
   run it) to an HF folder, the way ``bench/bench_engine.py`` does;
2. starts ``cairn serve`` (embedded default model) and ``mlx_lm.server`` on
   that folder (greedy, OpenBLAS loaded first, as for every side; our decode
   kernel, ``cairn_blas``, is ours alone: ``mlx_lm.server`` runs with
   ``CAIRN_DECODE_GEMM=0``, which leaves it OpenBLAS as it would have it);
3. for each round and each concurrency in ``--levels`` runs, in an order that
   alternates between rounds, ``n`` concurrent OpenAI chat streams of
   ``--tokens`` tokens (distinct story prompts, temperature 0) against each
   server, then the same ``n`` requests on an :class:`Engine` in this process
   (the engine alone: no HTTP, no event loop);
4. reports per side and concurrency: aggregate tokens/s (all generated tokens
   over the wall time from the first request to the last byte), TTFT p50/p99,
   inter-token latency p50/p99 (gaps between text deltas on the client), the
   ratios ours / mlx_lm.server and ours / engine alone, and ``/health`` p99
   of our server while its streams ran.

The clients are the lean raw-socket readers of ``http_stream.py``, in this
process, so they cost both servers the same. ``--anthropic`` adds our
Anthropic Messages endpoint as a third HTTP side.

Run (about 10-15 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_http.py                    # --levels 1,4,8,16 --rounds 2
    .venv/bin/python bench/bench_http.py --levels 8,16,32 --anthropic --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
from http_stream import (  # bench/ is on sys.path
    TOPICS,
    StreamResult,
    greedy_chat_body,
    pct,
    stream_request,
)
from mlx_cairn.engine import Engine
from mlx_cairn.models import load
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams
from serve_proc import cpu_seconds, free_port


def prompt(i: int, rnd: int, side: int) -> str:
    # Round and side in the prompt keep every prefix cache (two of our sides
    # share one server) from serving a prompt that an earlier run sent.
    return f"Write a long story about {TOPICS[i % len(TOPICS)]} (take {rnd}.{side}, part {i})."


def chat_body(i: int, rnd: int, tokens: int, model: str, side: int = 0) -> dict[str, Any]:
    return greedy_chat_body(model, [{"role": "user", "content": prompt(i, rnd, side)}], tokens)


def anthropic_body(i: int, rnd: int, tokens: int, side: int) -> dict[str, Any]:
    return {
        "model": "default",
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": prompt(i, rnd, side)}],
    }


# ----------------------------------------------------------------- servers


def start_ours(port: int, log: Path, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """``cairn serve`` on ``port`` (the embedded default model unless ``extra`` names one)."""
    cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--max-queue", "256", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CAIRN_API_KEY"}
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def start_mlx_lm(port: int, folder: Path, tokens: int, log: Path) -> subprocess.Popen[bytes]:
    code = (
        "import sys, mlx_cairn\n"  # the optimized BLAS before mlx.core, as for our side
        "from mlx_lm.server import main\n"
        "sys.argv = ['mlx_lm.server'] + sys.argv[1:]\n"
        "main()\n"
    )
    cmd = [sys.executable, "-c", code, "--model", str(folder), "--host", "127.0.0.1",
           "--port", str(port), "--temp", "0", "--max-tokens", str(tokens),
           "--log-level", "WARNING"]  # fmt: skip
    env = {**os.environ, "CAIRN_DECODE_GEMM": "0"}  # OpenBLAS alone, untuned
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


async def wait_up(port: int, proc: subprocess.Popen[bytes], path: str, body: dict) -> None:
    """Until one short streamed request succeeds (the model is loaded and warm)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            r = await stream_request("127.0.0.1", port, path, body, timeout=120)
            if r.error is None and r.tokens > 0:
                return
        except OSError:
            pass
        await asyncio.sleep(1.0)
    raise RuntimeError(f"server on port {port} did not come up")


# ----------------------------------------------------------------- one run


async def health_poller(port: int, stop: asyncio.Event, out: list[float]) -> None:
    req = f"GET /health HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n".encode()
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            await reader.read()
            writer.close()
            out.append(time.perf_counter() - t0)
        except OSError:
            pass
        await asyncio.sleep(0.1)


def server_cpu(pid: int | None) -> tuple[float, float]:
    """CPU seconds of ``pid``'s main thread and of the whole process (NaN without a pid).

    Under ``cairn serve`` the main thread runs the event loop and nothing else:
    the engine, MLX and BLAS have threads of their own. So the main thread's
    CPU is what the serving path (HTTP, JSON, SSE, sockets) costs the machine.
    """
    if pid is None:
        return float("nan"), float("nan")
    return cpu_seconds(pid, pid), cpu_seconds(pid)


async def http_run(
    port: int, path: str, bodies: list[dict[str, Any]], health: bool, pid: int | None = None
) -> dict[str, Any]:
    stop = asyncio.Event()
    lat: list[float] = []
    poll = asyncio.ensure_future(health_poller(port, stop, lat)) if health else None
    loop0, proc0 = server_cpu(pid)
    client0 = time.process_time()
    t0 = time.perf_counter()
    rs: list[StreamResult] = await asyncio.gather(
        *(stream_request("127.0.0.1", port, path, b) for b in bodies)
    )
    wall = time.perf_counter() - t0
    client = time.process_time() - client0
    loop1, proc1 = server_cpu(pid)
    stop.set()
    if poll is not None:
        await poll
    errors = [r.error for r in rs if r.error]
    ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
    gaps = [g for r in rs for g in r.gaps_s]
    tokens = sum(r.tokens for r in rs)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_ms": [v * 1000 for v in ttft],
        "itl_ms": [g * 1000 for g in gaps],
        "health_ms": [v * 1000 for v in lat],
        "errors": errors[:3],
        "cpu_s": {"loop": loop1 - loop0, "server": proc1 - proc0, "client": client},
    }


def engine_run(engine: Engine, n: int, rnd: int, tokens: int, side: int = 0) -> dict[str, Any]:
    reqs = [
        ChatRequest(
            messages=[Message("user", prompt(i, rnd, side))],
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    streams = [engine.submit(r) for r in reqs]
    dones = [list(s.iter_sync(timeout=900))[-1] for s in streams]
    wall = time.perf_counter() - t0
    assert all(isinstance(d, Done) for d in dones), dones
    tokens_out = sum(d.usage.output_tokens for d in dones)  # type: ignore[union-attr]
    return {
        "tokens": tokens_out,
        "wall_s": wall,
        "tok_s": tokens_out / wall,
        "ttft_ms": [d.timings.ttft_ms for d in dones],  # type: ignore[union-attr]
        "itl_ms": [],
        "health_ms": [],
        "errors": [],
        "cpu_s": {"loop": float("nan"), "server": float("nan"), "client": float("nan")},
    }


# ----------------------------------------------------------------- report


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    cat = {k: [v for r in runs for v in r[k]] for k in ("ttft_ms", "itl_ms", "health_ms")}
    cpu = {k: sum(r["cpu_s"][k] for r in runs) for k in ("loop", "server", "client")}
    return {
        "tok_s": tokens / wall,
        "loop_ms_per_token": 1000 * cpu["loop"] / tokens,
        "loop_share": cpu["loop"] / cpu["server"] if cpu["server"] else float("nan"),
        "client_share": cpu["client"] / ((os.cpu_count() or 1) * wall),
        "tok_s_runs": [round(r["tok_s"], 2) for r in runs],
        **{f"{k}_p50": pct(v, 50) for k, v in cat.items()},
        **{f"{k}_p99": pct(v, 99) for k, v in cat.items()},
        "errors": [e for r in runs for e in r["errors"]][:3],
    }


def fmt(x: float) -> str:
    return "-" if x != x else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def markdown(table: dict[int, dict[str, dict[str, Any]]], sides: list[str]) -> str:
    lines = [
        "| streams | side | tok/s (runs) | TTFT p50 / p99 ms | ITL p50 / p99 ms | /health p99 ms |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n, per in table.items():
        for side in sides:
            m = per[side]
            runs = ", ".join(f"{x:.1f}" for x in m["tok_s_runs"])
            lines.append(
                f"| {n} | {side} | **{m['tok_s']:.1f}** ({runs}) "
                f"| {fmt(m['ttft_ms_p50'])} / {fmt(m['ttft_ms_p99'])} "
                f"| {fmt(m['itl_ms_p50'])} / {fmt(m['itl_ms_p99'])} "
                f"| {fmt(m['health_ms_p99'])} |"
            )
    lines += ["", "Ratios of pooled tokens/s (all runs' tokens over all runs' wall time), "
              "and in brackets of the medians of the runs:", "",
              "| streams | ours / mlx_lm.server | ours / engine alone | "
              "mlx_lm.server / engine alone | ours ITL p99 / p50 |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n, per in table.items():
        o, m, e = per["cairn (openai chat)"], per["mlx_lm.server"], per["engine alone"]

        def r(a: dict[str, Any], b: dict[str, Any]) -> str:
            med = statistics.median(a["tok_s_runs"]) / statistics.median(b["tok_s_runs"])
            return f"{a['tok_s'] / b['tok_s']:.2f}x ({med:.2f}x)"

        lines.append(
            f"| {n} | {r(o, m)} | {r(o, e)} | {r(m, e)} | {o['itl_ms_p99'] / o['itl_ms_p50']:.2f} |"
        )
    lines += ["", "What serving costs in CPU (our server's event-loop thread, which runs "
              "HTTP, JSON, SSE and the sockets; the benchmark's own clients):", "",
              "| streams | side | loop CPU ms / token | loop share of the server's CPU | "
              "clients' share of the machine |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    for n, per in table.items():
        for side in (s for s in sides if s.startswith("cairn")):
            m = per[side]
            lines.append(
                f"| {n} | {side} | {m['loop_ms_per_token']:.2f} | {100 * m['loop_share']:.1f}% "
                f"| {100 * m['client_share']:.1f}% |"
            )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    lm = load()
    folder = args.export_dir
    if not (folder / "config.json").exists():
        from mlx_cairn.models.export import save_folder

        save_folder(lm, folder)
    engine = Engine(dataclasses.replace(lm))  # the defaults `cairn serve` gives the model
    logs = Path(tempfile.mkdtemp(prefix="cairn-bench-http-"))
    p_ours, p_lm = free_port(), free_port()
    ours = start_ours(p_ours, logs / "cairn.log")
    peer = start_mlx_lm(p_lm, folder, args.tokens, logs / "mlx_lm.log")
    chat = "/v1/chat/completions"
    try:
        await wait_up(p_ours, ours, chat, chat_body(0, -1, 4, "default"))
        await wait_up(p_lm, peer, chat, chat_body(0, -1, 4, str(folder)))
        engine_run(engine, 2, -1, 4)  # warm-up
        # Ours next to the engine alone in every round (ABC, then CBA): the box's
        # speed drifts, and that ratio is the closest bar.
        sides = ["mlx_lm.server", "cairn (openai chat)", "engine alone"]
        if args.anthropic:
            sides.append("cairn (anthropic)")
        raw: dict[int, dict[str, list[dict[str, Any]]]] = {
            n: {s: [] for s in sides} for n in args.levels
        }
        load_seen = [os.getloadavg()[0]]
        print(f"logs in {logs}; load average {os.getloadavg()}", flush=True)
        for rnd in range(args.rounds):
            for k, n in enumerate(args.levels):
                order = sides if (rnd + k) % 2 == 0 else sides[::-1]
                for side in order:
                    s, t = sides.index(side), args.tokens
                    if side == "engine alone":
                        r = await asyncio.to_thread(engine_run, engine, n, rnd, t, s)
                    elif side == "mlx_lm.server":
                        bodies = [chat_body(i, rnd, t, str(folder), s) for i in range(n)]
                        r = await http_run(p_lm, chat, bodies, health=False)
                    elif side == "cairn (anthropic)":
                        bodies = [anthropic_body(i, rnd, t, s) for i in range(n)]
                        r = await http_run(p_ours, "/v1/messages", bodies, True, ours.pid)
                    else:
                        bodies = [chat_body(i, rnd, t, "default", s) for i in range(n)]
                        r = await http_run(p_ours, chat, bodies, True, ours.pid)
                    raw[n][side].append(r)
                    load_seen.append(os.getloadavg()[0])
                    print(
                        f"round {rnd} c={n:2d} {side:22s} {r['tok_s']:6.1f} tok/s "
                        f"({r['tokens']} tokens in {r['wall_s']:.1f}s) errors={r['errors']} "
                        f"load={os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        table = {n: {s: merge(raw[n][s]) for s in sides} for n in args.levels}
        print(
            f"\nload average (1 min) during the run: min {min(load_seen):.1f}, "
            f"median {statistics.median(load_seen):.1f}, max {max(load_seen):.1f}\n"
        )
        print(markdown(table, sides), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"table": table, "raw": raw, "load": load_seen}))
    finally:
        for p in (ours, peer):
            p.terminate()
        for p in (ours, peer):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        engine.close()
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--anthropic", action="store_true", help="also our Anthropic endpoint")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--export-dir", type=Path, default=Path(tempfile.gettempdir()) / "cairn-smollm2-hf"
    )
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
