"""Load test: 64 concurrent streaming clients against a real ``cairn serve`` on loopback.

Starts ``cairn serve`` (the embedded SmolLM2 unless ``--model``) on a free
port, warms it up, then runs ``--clients`` streaming clients for
``--duration`` seconds. Each client loops over requests that mix

- dialects: Anthropic Messages, OpenAI Chat Completions, OpenAI Responses;
- prompts: short or long user messages, behind a system prompt shared by
  every client (prefix-cache hits) or one made unique by a nonce;
- a third of the clients are "droppers": each request is abandoned at a
  random moment (while queued, or after a few deltas) by closing the socket.

Meanwhile one poller reads ``/health`` anonymously (liveness latency, the
< 50 ms p99 target) and one reads ``/metrics`` (queue peak). When the time is
up, in-flight requests get ``--drain`` seconds to finish, then are dropped;
the server must then come to rest: queue empty, no KV block referenced, and
resident memory within 10% of what it was after warm-up.

``--hostile`` runs two phases against the same server instead: the normal
clients alone (none of them droppers, so anything short of a clean completion
is an error), then the same load with the hostile clients of
``bench/hostile.py`` beside them (slow, half-closing, oversize, deeply nested,
control-token and bad-number requests, in their own process), and reports
both side by side, what each hostile variant got back, and the rest check.

``--auth-timing`` also measures how long the auth gate takes to refuse a
wrong token as a function of how many leading bytes it shares with the real
one (in-process on the gate's own function, and over HTTP).

Run (about 2-3 minutes on 2 cores)::

    .venv/bin/python bench/load.py --auth-timing
    .venv/bin/python bench/load.py --hostile     # about 2.5 minutes: 16 normal + 17 hostile

Prints a Markdown report (paste into bench/RESULTS.md) and ``--json`` a
machine-readable one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hostile import markdown_phases, not_clean  # bench/ is on sys.path when run as a script
from serve_proc import (
    TOKEN,
    free_port,
    metric,
    rest_check,
    rss_bytes,
    server_log_since,
    server_sockets,
    start_server,
    status_counts,
    wait_ready,
)

SHARED_SYSTEM = (
    "You are a concise assistant running on a small local model. Answer in one or two "
    "sentences, plainly, without lists or headings. "
) * 2
LONG_USER = (
    "Here are some notes about trails and cairns. A cairn is a human-made pile of stones "
    "raised as a marker, a memorial or a landmark. Hikers use them above the tree line "
    "where paths are hard to see. "
) * 3
SHORT_USERS = [
    "What is a cairn?",
    "Name a colour.",
    "Say hello in French.",
    "What is 2 + 2?",
    "Give me a word that rhymes with stone.",
]


# --------------------------------------------------------------------- clients


@dataclass
class Result:
    dialect: str
    kind: str  # completed | dropped | cut | error:<kind> | http:<status>
    ttft: float | None = None
    output_tokens: int = 0
    decode_s: float = 0.0
    latency: float | None = None  # request start to final event, completed requests only


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    #: (seconds since the start, ms) of every /health answer slower than 50 ms.
    health_slow: list[tuple[float, float]] = field(default_factory=list)
    start: float = 0.0
    health_errors: int = 0
    queue_peak: float = 0.0
    running_peak: float = 0.0
    #: (seconds since the start, MB) of the server's RSS, one sample a second.
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    stop_at: float = 0.0
    drain_until: float = 0.0
    end: float = 0.0
    #: What bench/hostile.py reported (hostile phase only).
    hostile: dict[str, Any] | None = None


def make_request(rng: random.Random, model: str) -> tuple[str, str, dict[str, Any], bool]:
    """(dialect, path, body, long?) of one random request."""
    dialect = rng.choice(["anthropic", "chat", "responses"])
    long = rng.random() < 0.25
    user = LONG_USER + "Summarize the notes in one sentence." if long else rng.choice(SHORT_USERS)
    system = SHARED_SYSTEM
    if rng.random() < 0.5:  # unshared: a nonce at the front defeats the prefix cache
        system = f"Session {uuid.uuid4().hex}. " + SHARED_SYSTEM
    max_tokens = rng.randint(8, 32)
    if dialect == "anthropic":
        body = {
            "model": model, "max_tokens": max_tokens, "stream": True, "system": system,
            "messages": [{"role": "user", "content": user}], "temperature": 0.7,
        }  # fmt: skip
        return dialect, "/v1/messages", body, long
    if dialect == "chat":
        body = {
            "model": model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }  # fmt: skip
        return dialect, "/v1/chat/completions", body, long
    body = {
        "model": model, "max_output_tokens": max_tokens, "stream": True, "store": False,
        "instructions": system, "input": user, "temperature": 0.7,
    }  # fmt: skip
    return dialect, "/v1/responses", body, long


def classify(event: str | None, data: str) -> tuple[str, Any]:
    """One SSE frame -> ("delta" | "done" | "error" | "other", payload)."""
    if data == "[DONE]":
        return "done", None
    try:
        payload = json.loads(data)
    except ValueError:
        return "other", None
    name = event or payload.get("type") or ""
    if name == "error" or name == "response.failed" or (event is None and "error" in payload):
        err = payload.get("error") or payload.get("response", {}).get("error") or {}
        return "error", err.get("type") or err.get("code") or "unknown"
    if name == "content_block_delta" or name == "response.output_text.delta":
        return "delta", None
    if name == "message_delta":
        return "usage", payload.get("usage", {}).get("output_tokens", 0)
    if name == "message_stop":
        return "done", None
    if name in ("response.completed", "response.incomplete"):  # incomplete: hit the cap
        return "done", payload["response"]["usage"]["output_tokens"]
    choices = payload.get("choices")
    if choices and (choices[0].get("delta") or {}).get("content"):
        return "delta", None
    if event is None and payload.get("usage") and choices == []:
        return "usage", payload["usage"]["completion_tokens"]
    return "other", None


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, model: str, dropper: bool, run: Run
) -> Result:
    dialect, path, body, _ = make_request(rng, model)
    # Droppers leave at a random moment (often while still queued), or after a few deltas.
    drop_after = rng.choice([0, 1, 3, 8]) if dropper else None
    drop_wait = rng.uniform(0.05, 4.0) if drop_after == 0 else None
    t0 = time.perf_counter()
    res = Result(dialect, "cut")

    async def consume() -> Result:
        deltas = 0
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(dialect, f"http:{r.status_code}")
            event: str | None = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    if line == "":
                        event = None
                    continue
                now = time.perf_counter()
                kind, val = classify(event, line[5:].strip())
                if kind == "delta":
                    deltas += 1
                    if res.ttft is None:
                        res.ttft = now - t0
                    if drop_after and deltas >= drop_after:
                        return Result(dialect, "dropped", res.ttft)
                elif kind == "usage":
                    res.output_tokens = int(val or 0)
                elif kind == "error":
                    return Result(dialect, f"error:{val}", res.ttft)
                elif kind == "done":
                    if val is not None:
                        res.output_tokens = int(val)
                    res.kind = "completed"
                    res.latency = now - t0
                    if res.ttft is not None:
                        res.decode_s = now - t0 - res.ttft
                    return res
        return Result(dialect, f"error:truncated:{dialect}", res.ttft)  # no final event

    limit = run.drain_until - time.perf_counter()
    if drop_wait is not None and drop_wait < limit:
        limit, on_timeout = drop_wait, "dropped"
    else:
        on_timeout = "cut"  # still running when the run ended
    try:
        # Leaving the wait closes the socket: the server sees the client go away.
        return await asyncio.wait_for(consume(), max(limit, 0.01))
    except asyncio.TimeoutError:
        return Result(dialect, on_timeout, res.ttft)
    except httpx.HTTPError as e:
        return Result(dialect, f"transport:{type(e).__name__}", res.ttft)


async def client_loop(
    idx: int, url: str, model: str, run: Run, seed: int, *, droppers: bool = True
) -> None:
    rng = random.Random(seed * 1000 + idx)
    dropper = droppers and idx % 3 == 0
    headers = {
        "x-api-key": TOKEN,
        "authorization": f"Bearer {TOKEN}",
        "anthropic-version": "2023-06-01",
    }
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        await asyncio.sleep(rng.uniform(0, 2.0))  # stagger the start
        while time.perf_counter() < run.stop_at:
            run.results.append(await one_request(client, rng, model, dropper, run))


#: The /health prober runs in its own process, so the load generator's busy
#: event loop cannot add to the latency it measures.
HEALTH_PROBE = r"""
import sys, time, httpx
url, until = sys.argv[1], time.time() + float(sys.argv[2])
with httpx.Client(base_url=url, timeout=5.0) as c:
    while time.time() < until:
        t = time.perf_counter()
        try:
            ok = c.get("/health").status_code == 200
        except httpx.HTTPError:
            ok = False
        ms = 1000 * (time.perf_counter() - t)
        print(f"{time.time()} {ms if ok else -1}", flush=True)
        time.sleep(0.1)
"""


async def poll_health(url: str, run: Run, done: asyncio.Event) -> None:
    """Probe ``/health`` every 100 ms (one line per answer, -1 ms: failed) until ``done``."""
    seconds = run.drain_until - time.perf_counter() + 60
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HEALTH_PROBE, url, str(seconds), stdout=asyncio.subprocess.PIPE
    )
    t0 = time.time() - (time.perf_counter() - run.start)  # wall clock of the run's start

    async def read() -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            wall, ms = map(float, line.split())
            if ms < 0:
                run.health_errors += 1
                continue
            run.health_ms.append(ms)
            if ms > 50:
                run.health_slow.append((round(wall - t0, 1), round(ms)))

    reader = asyncio.create_task(read())
    await done.wait()
    if proc.returncode is None:
        proc.terminate()
    await proc.wait()
    await reader


async def poll_metrics(url: str, run: Run, done: asyncio.Event, pid: int = 0) -> None:
    """Queue and running peaks from ``/metrics``, and the RSS of ``pid``, until ``done``."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0, headers={"x-api-key": TOKEN}) as c:
        while not done.is_set():
            try:
                text = (await c.get("/metrics")).text
                run.queue_peak = max(run.queue_peak, metric(text, "cairn_queue_depth"))
                run.running_peak = max(run.running_peak, metric(text, "cairn_running_sequences"))
            except httpx.HTTPError:
                pass
            now = time.perf_counter() - run.start
            if pid and (not run.rss_mb or now - run.rss_mb[-1][0] >= 1.0):
                run.rss_mb.append((round(now, 1), round(rss_bytes(pid) / 2**20)))
            await asyncio.sleep(0.25)


async def load(url: str, model: str, args: argparse.Namespace, *, hostile: bool = False) -> Run:
    """One phase: the clients until ``--duration``, in-flight requests until ``--drain``.

    The phase ends as soon as every client is done (and, with ``hostile``, the
    hostile process has reported), so a short drain costs nothing.
    """
    run = Run()
    start = run.start = time.perf_counter()
    run.stop_at = start + args.duration
    run.drain_until = run.stop_at + args.drain
    done = asyncio.Event()
    pid = getattr(args, "server_pid", 0)
    pollers = [poll_health(url, run, done), poll_metrics(url, run, done, pid)]
    polling = asyncio.gather(*pollers)
    droppers = not args.hostile  # hostile mode: every normal request should complete
    tasks = [
        client_loop(i, url, model, run, args.seed, droppers=droppers) for i in range(args.clients)
    ]
    if hostile:
        tasks.append(run_hostile(url, model, args, run))
    await asyncio.gather(*tasks)
    done.set()
    await polling
    run.end = time.perf_counter()
    return run


async def run_hostile(url: str, model: str, args: argparse.Namespace, run: Run) -> None:
    """bench/hostile.py in its own process for the phase's ``--duration``."""
    cmd = [
        sys.executable, str(Path(__file__).with_name("hostile.py")), "--url", url,
        "--token", TOKEN, "--model", model, "--seconds", str(args.duration),
        "--clients", str(args.hostile_clients), f"--variants={args.hostile_variants}",
        "--max-body-mb", str(args.max_body_mb), "--drip-bps", str(args.drip_bps),
        "--big-count-mb", str(args.big_count_mb), "--pause", str(args.hostile_pause),
        "--seed", str(args.seed),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench/hostile.py exited with {proc.returncode}")
    run.hostile = json.loads(out)


def warm_up(url: str, model: str) -> None:
    """One short non-streamed request per dialect (first compute, allocator pools)."""
    rng = random.Random(0)
    headers = {
        "x-api-key": TOKEN,
        "authorization": f"Bearer {TOKEN}",
        "anthropic-version": "2023-06-01",
    }
    seen: set[str] = set()
    with httpx.Client(base_url=url, headers=headers, timeout=300) as c:
        while len(seen) < 3:
            dialect, path, body, _ = make_request(rng, model)
            if dialect in seen:
                continue
            seen.add(dialect)
            body["stream"] = False
            body.pop("stream_options", None)
            c.post(path, json=body).raise_for_status()


# --------------------------------------------------------------------- auth timing


def auth_timing(url: str, reps: int) -> dict[str, Any]:
    """Median time to refuse a wrong token vs the length of its matching prefix."""
    from mlx_cairn.api.auth import check_credentials, token_digest

    digest = token_digest(TOKEN)
    n = len(TOKEN)
    cases = {
        "0 bytes match": "Y" * n,
        f"{n // 2} bytes match": TOKEN[: n // 2] + "Y" * (n - n // 2),
        f"{n - 1} bytes match": TOKEN[:-1] + "Y",
        "short (1 byte)": "Y",
        "long (4 KiB)": TOKEN + "Y" * 4096,
    }
    inproc: dict[str, float] = {}
    for name, tok in cases.items():
        headers = [(b"x-api-key", tok.encode())]
        samples = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(reps):
                check_credentials(headers, digest)
            samples.append((time.perf_counter_ns() - t) / reps)
        inproc[name] = statistics.median(samples)
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(300):  # interleaved rounds so drift hits every case alike
            for name, tok in cases.items():
                t_http = time.perf_counter()
                r = c.get("/v1/models", headers={"x-api-key": tok})
                rounds[name].append(1e6 * (time.perf_counter() - t_http))
                assert r.status_code == 401
    over_http = {k: statistics.median(v) for k, v in rounds.items()}
    return {"in_process_ns": inproc, "http_us": over_http}


# --------------------------------------------------------------------- report


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def report(run: Run, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    kinds = Counter(r.kind for r in run.results)
    done = [r for r in run.results if r.kind == "completed"]
    ttft = [r.ttft for r in run.results if r.ttft is not None]
    latency = [r.latency for r in done if r.latency is not None]
    tps = [
        (r.output_tokens - 1) / r.decode_s for r in done if r.decode_s > 0 and r.output_tokens > 1
    ]
    by_dialect = Counter(r.dialect for r in done)
    errors = {k: v for k, v in kinds.items() if k not in ("completed", "dropped", "cut")}
    out = {
        "clients": args.clients,
        "duration_s": args.duration,
        "requests": len(run.results),
        "completed": kinds["completed"],
        "completed_by_dialect": dict(by_dialect),
        "dropped_by_client": kinds["dropped"],
        "cut_at_end": kinds["cut"],
        "errors": errors,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "latency_p50_s": pct(latency, 50),
        "latency_p99_s": pct(latency, 99),
        "phase_s": run.end - run.start,
        "tok_s_per_stream_p50": pct(tps, 50),
        "tok_s_per_stream_p99_low": pct(tps, 1),
        "tokens_out": sum(r.output_tokens for r in done),
        "aggregate_tok_s": sum(r.output_tokens for r in done) / args.duration,
        "queue_peak": run.queue_peak,
        "running_peak": run.running_peak,
        "rss_peak_mb": max((mb for _, mb in run.rss_mb), default=float("nan")),
        "rss_trace_mb": run.rss_mb[::5],
        "health_p50_ms": pct(run.health_ms, 50),
        "health_p99_ms": pct(run.health_ms, 99),
        "health_max_ms": max(run.health_ms, default=float("nan")),
        "health_errors": run.health_errors,
        "health_over_50ms": len(run.health_slow),
        "health_slow_samples": run.health_slow[:40],
        **extra,
    }
    return out


def markdown(r: dict[str, Any]) -> str:
    rest = r["at_rest"]
    lines = [
        f"| requests | {r['requests']} ({r['completed']} completed, {r['dropped_by_client']} dropped by "
        f"their client, {r['cut_at_end']} cut at the end) |",
        f"| completed by dialect | {r['completed_by_dialect']} |",
        f"| errors by kind | {r['errors'] or 'none'} |",
        f"| TTFT p50 / p99 | {r['ttft_p50_s']:.2f} s / {r['ttft_p99_s']:.2f} s |",
        f"| decode tok/s per stream p50 / p1 | {r['tok_s_per_stream_p50']:.1f} / {r['tok_s_per_stream_p99_low']:.1f} |",
        f"| aggregate output tok/s | {r['aggregate_tok_s']:.1f} ({r['tokens_out']} tokens) |",
        f"| queue peak / running peak | {r['queue_peak']:.0f} / {r['running_peak']:.0f} |",
        f"| /health p50 / p99 / max | {r['health_p50_ms']:.1f} / {r['health_p99_ms']:.1f} / "
        f"{r['health_max_ms']:.1f} ms ({r['health_errors']} failed) |",
        f"| at rest: queue, running, blocks in use | {rest['queue_depth']}, {rest['running']}, "
        f"{rest['blocks_in_use']} (free {rest['blocks_free']}, cached {rest['blocks_cached']}) |",
        f"| RSS after warm-up -> at rest | {r['rss_warm_mb']:.0f} MB -> {r['rss_rest_mb']:.0f} MB "
        f"({r['rss_change_pct']:+.1f}%) |",
    ]
    if "auth_timing" in r:
        at = r["auth_timing"]
        for name in at["in_process_ns"]:
            lines.append(
                f"| wrong token, {name} | {at['in_process_ns'][name]:.0f} ns in-process, "
                f"{at['http_us'][name]:.0f} us over HTTP (median) |"
            )
    return "| figure | value |\n| --- | --- |\n" + "\n".join(lines)


def hostile_phases(
    url: str,
    model: str,
    proc: subprocess.Popen[bytes],
    args: argparse.Namespace,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Baseline phase, then the same load with the hostile mix; the figures of both."""
    rss_warm = rss_bytes(proc.pid)
    extra["rss_warm_mb"] = rss_warm / 2**20
    extra["sockets_warm"] = server_sockets(proc.pid)
    offset = Path(args.server_log).stat().st_size
    phases: dict[str, Any] = {}
    for name, hostile in (("baseline", False), ("hostile", True)):
        before = status_counts(url)
        load_start = os.getloadavg()[0]
        print(f"{name} phase ({args.duration:g} s + up to {args.drain:g} s)", file=sys.stderr)
        run = asyncio.run(load(url, model, args, hostile=hostile))
        rest = rest_check(url)
        time.sleep(1.0)  # let the last connections close before counting sockets
        rss = rss_bytes(proc.pid)
        statuses = status_counts(url) - before
        offset, log = server_log_since(args.server_log, offset)
        fig = report(run, {}, args)
        fig.update(
            at_rest=rest,
            rss_rest_mb=rss / 2**20,
            rss_change_pct=100.0 * (rss - rss_warm) / rss_warm,
            sockets_rest=server_sockets(proc.pid),
            server_statuses=dict(sorted(statuses.items())),
            server_log=log,
            load_avg_start_end=(load_start, os.getloadavg()[0]),
            hostile=run.hostile,
        )
        phases[name] = fig
    return phases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--clients", type=int, default=None, help="normal clients (64; 16 with --hostile)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of load (100; per phase, 60, with --hostile)",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=None,
        help="seconds for in-flight requests after (20; 30 with --hostile)",
    )
    p.add_argument("--model", default=None, help="model for cairn serve (default: embedded)")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--max-queue", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auth-timing", action="store_true")
    p.add_argument("--auth-reps", type=int, default=20000)
    p.add_argument("--server-log", default="/tmp/cairn-load-server.log")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    g = p.add_argument_group("hostile mode (bench/hostile.py)")
    g.add_argument(
        "--hostile",
        action="store_true",
        help="a baseline phase, then the same load with hostile clients beside it",
    )
    g.add_argument("--hostile-clients", type=int, default=0, help="default: one per variant")
    g.add_argument(
        "--hostile-variants",
        default="",
        help="kinds or variants, comma-separated; -name drops one (write --hostile-variants=-name)",
    )
    g.add_argument("--hostile-pause", type=float, default=1.0, help="seconds between attempts")
    g.add_argument(
        "--big-count-mb", type=float, default=2.0, help="size of the big count_tokens body"
    )
    g.add_argument("--drip-bps", type=float, default=2.0, help="bytes/s of the slow clients")
    g.add_argument(
        "--header-timeout", type=float, default=None, help="for cairn serve (5 with --hostile)"
    )
    g.add_argument(
        "--body-timeout", type=float, default=None, help="for cairn serve (5 with --hostile)"
    )
    g.add_argument(
        "--max-body-mb", type=float, default=None, help="for cairn serve (32 with --hostile)"
    )
    args = p.parse_args(argv)  # fmt: skip
    defaults: dict[str, float] = {"clients": 64, "duration": 100.0, "drain": 20.0}
    if args.hostile:
        defaults = {
            "clients": 16, "duration": 60.0, "drain": 30.0,
            "header_timeout": 5.0, "body_timeout": 5.0, "max_body_mb": 32.0,
        }  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, type(v)(v))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    args.server_pid = proc.pid
    try:
        wait_ready(url, proc)
        model = httpx.get(url + "/v1/models", headers={"x-api-key": TOKEN}).json()["data"][0]["id"]
        extra: dict[str, Any] = {"model": model}
        if args.auth_timing:
            extra["auth_timing"] = auth_timing(url, args.auth_reps)
        t = time.perf_counter()
        warm_up(url, model)
        print(f"warm-up done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        if args.hostile:
            phases = hostile_phases(url, model, proc, args, extra)  # adds to extra
            out = {**extra, "phases": phases}
        else:
            rss_warm = rss_bytes(proc.pid)
            run = asyncio.run(load(url, model, args))
            rest = rest_check(url)
            rss_rest = rss_bytes(proc.pid)
            extra.update(
                at_rest=rest,
                rss_warm_mb=rss_warm / 2**20,
                rss_rest_mb=rss_rest / 2**20,
                rss_change_pct=100.0 * (rss_rest - rss_warm) / rss_warm,
            )
            out = report(run, extra, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    out["server_exit_code"] = proc.returncode
    print(markdown_phases(out) if args.hostile else markdown(out))
    print(json.dumps(out, indent=1, default=str), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if args.hostile:
        figs = list(out["phases"].values())
        unexpected = any(
            v["unexpected"] for v in out["phases"]["hostile"]["hostile"]["variants"].values()
        )
        ok = not unexpected and all(
            not_clean(f) == 0
            and f["at_rest"]["blocks_in_use"] == 0
            and f["at_rest"]["queue_depth"] == 0
            and abs(f["rss_change_pct"]) <= 10
            for f in figs
        )
    else:
        ok = (
            not out["errors"]
            and out["at_rest"]["blocks_in_use"] == 0
            and out["at_rest"]["queue_depth"] == 0
            and abs(out["rss_change_pct"]) <= 10
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
