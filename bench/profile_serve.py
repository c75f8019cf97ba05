"""Where one streamed token's time goes between the engine thread and the socket (issue 17).

Runs ``cairn serve`` (the embedded SmolLM2 unless ``--model``) in a child
process with wall-clock counters patched in from outside (no server code
knows about them), then drives it with ``--levels`` concurrent OpenAI chat
streams of ``--tokens`` tokens each (the lean client of ``http_stream.py``,
in this process). Per generated token it reports, as medians and p90 over all
tokens of a level:

    push ──handoff──► codec.feed ──encode──► send() ──send──► returned
    (engine thread)   (event loop has it)    (ASGI)           (uvicorn wrote it)

and per level the CPU seconds of the event-loop thread and of the engine
thread per token (``/proc/self/task``), the event loop's lag (a 20 ms ticker's
lateness, what ``/health`` would wait), and aggregate tokens/s. ``--py-spy``
runs the server under ``py-spy record --nonblocking`` and sorts the loop thread's samples
into categories (asyncio machinery, codec + JSON, SSE framing, uvicorn + h11,
Starlette, the stream hand-off).

Run (about 3 minutes on 2 shared cores)::

    .venv/bin/python bench/profile_serve.py --levels 1,8,32 --py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from http_stream import (  # bench/ is on sys.path when run as a script
    TOPICS,
    greedy_chat_body,
    pct,
    stream_request,
)
from serve_proc import cpu_seconds, free_port

# ------------------------------------------------------------ child (server)


def _child(port: int, dump: str, model: str | None, no_uvloop: bool) -> None:
    """``cairn serve`` with counters; SIGUSR1 writes them to ``dump`` and resets them."""
    if no_uvloop:  # uvicorn's "auto" loop then falls back to asyncio's own
        sys.modules["uvloop"] = None  # type: ignore[assignment]
    import mlx_cairn  # noqa: F401  (optimized BLAS before mlx.core)
    from mlx_cairn.api import respond as runner
    from mlx_cairn.cli import main
    from mlx_cairn.engine.stream import RequestStream
    from mlx_cairn.protocol.openai_chat import ChatCodec
    from mlx_cairn.types import TextDelta

    clock = time.perf_counter
    rows: list[tuple[float, float, float, float]] = []  # per token: push, feed, send0, send1
    lock = threading.Lock()
    lag: list[float] = []

    push0 = RequestStream._push

    def push(self: Any, events: list[Any]) -> None:
        now = clock()
        pushes = self.__dict__.setdefault("_prof_push", [])
        pushes.extend(now for ev in events if isinstance(ev, TextDelta))
        push0(self, events)

    feed0 = ChatCodec.feed

    def feed(self: Any, ev: Any) -> Any:
        if isinstance(ev, TextDelta):
            self.__dict__.setdefault("_prof_feed", []).append(clock())
        return feed0(self, ev)

    call0 = runner.GenerationResponse.__call__

    async def call(self: Any, scope: Any, receive: Any, send: Any) -> None:
        sends: list[tuple[float, float, int]] = []

        async def timed_send(msg: Any) -> None:
            t0 = clock()
            await send(msg)
            n = len(getattr(self.codec, "_prof_feed", ()))
            sends.append((t0, clock(), n))

        try:
            await call0(self, scope, receive, timed_send)
        finally:
            pushes = getattr(self.gen.stream, "_prof_push", [])
            feeds = getattr(self.codec, "_prof_feed", [])
            out = []
            j = 0
            for i, (tp, tf) in enumerate(zip(pushes, feeds, strict=False)):
                while j < len(sends) and sends[j][2] <= i:
                    j += 1
                if j < len(sends):
                    out.append((tp, tf, sends[j][0], sends[j][1]))
            with lock:
                rows.extend(out)

    RequestStream._push = push  # type: ignore[method-assign]
    ChatCodec.feed = feed  # type: ignore[method-assign]
    runner.GenerationResponse.__call__ = call  # type: ignore[method-assign]

    def cpu(tid: int) -> float:
        try:
            return cpu_seconds(os.getpid(), tid)
        except OSError:  # the thread has ended
            return 0.0

    def threads() -> dict[str, float]:
        out: dict[str, float] = {"process": cpu_seconds(os.getpid())}
        for t in threading.enumerate():
            if t.native_id is not None:
                name = "loop" if t is threading.main_thread() else t.name
                out[name] = out.get(name, 0.0) + cpu(t.native_id)
        return out

    def on_usr1(*_: Any) -> None:
        with lock:
            data = {"rows": list(rows), "lag": list(lag), "cpu": threads()}
            rows.clear()
            lag.clear()
        Path(dump + ".tmp").write_text(json.dumps(data))
        os.replace(dump + ".tmp", dump)

    # The ticker runs on the server's loop: patch uvicorn's startup to start it.
    import uvicorn

    serve0 = uvicorn.Server.serve

    async def serve(self: Any, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, on_usr1)

        async def ticker() -> None:
            while True:
                t0 = loop.time()
                await asyncio.sleep(0.02)
                lag.append(loop.time() - t0 - 0.02)

        task = asyncio.ensure_future(ticker())
        try:
            await serve0(self, sockets)
        finally:
            task.cancel()

    uvicorn.Server.serve = serve  # type: ignore[method-assign]
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    argv += ["--max-queue", "256"] + (["--model", model] if model else [])
    sys.exit(main(argv))


# ------------------------------------------------------------ parent (driver)


def body(i: int, tokens: int) -> dict[str, Any]:
    content = f"Write a long story about {TOPICS[i % 8]}."
    return greedy_chat_body("default", [{"role": "user", "content": content}], tokens)


async def level(port: int, n: int, tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    rs = await asyncio.gather(
        *(
            stream_request("127.0.0.1", port, "/v1/chat/completions", body(i, tokens))
            for i in range(n)
        )
    )
    wall = time.perf_counter() - t0
    bad = [r.error for r in rs if r.error]
    return {"tokens": sum(r.tokens for r in rs), "wall": wall, "errors": bad}


def wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    for _ in range(900):
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not come up")


def summarize(dump: dict[str, Any], agg: dict[str, Any], cpu0: dict[str, float]) -> dict[str, Any]:
    rows = dump["rows"]
    ms = 1000.0
    stages = {
        "handoff": [(f - p) * ms for p, f, _, _ in rows],
        "encode": [(s0 - f) * ms for _, f, s0, _ in rows],
        "send": [(s1 - s0) * ms for _, _, s0, s1 in rows],
        "total": [(s1 - p) * ms for p, _, _, s1 in rows],
    }
    tok = max(1, len(rows))
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in dump["cpu"].items()}
    return {
        "tokens": agg["tokens"],
        "tok_s": agg["tokens"] / agg["wall"],
        "errors": agg["errors"][:3],
        "stages_ms": {k: (statistics.median(v), pct(v, 90)) for k, v in stages.items() if v},
        "loop_cpu_ms_per_token": cpu.get("loop", 0.0) * ms / tok,
        "engine_cpu_ms_per_token": cpu.get("mlx-cairn-engine", 0.0) * ms / tok,
        "process_cpu_ms_per_token": cpu.get("process", 0.0) * ms / tok,
        "lag_ms": (pct(dump["lag"], 50) * ms, pct(dump["lag"], 99) * ms),
    }


def run_pass(args: argparse.Namespace, spy: Path | None) -> dict[int, dict[str, Any]]:
    port = free_port()
    dump = tempfile.mktemp(prefix="cairn-prof-", suffix=".json")
    cmd = [sys.executable, __file__, "--child", str(port), "--dump", dump]
    if args.model:
        cmd += ["--model", args.model]
    if args.no_uvloop:
        cmd += ["--no-uvloop"]
    if spy is not None:
        cmd = [
            str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "-r", "97",
            "-f", "raw", "--threads", "-o", str(spy), "--", *cmd,
        ]  # fmt: skip
    log = open(tempfile.mktemp(prefix="cairn-prof-", suffix=".log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    out: dict[int, dict[str, Any]] = {}
    try:
        wait_up(port, proc)
        pid = _server_pid(proc, spy is not None)
        asyncio.run(level(port, 2, 8))  # warm-up
        time.sleep(0.5)
        cpu0 = _snapshot(pid, dump)["cpu"]
        for n in args.levels:
            agg = asyncio.run(level(port, n, args.tokens))
            time.sleep(0.5)  # the last responses' counters land after their last byte
            d = _snapshot(pid, dump)
            out[n] = summarize(d, agg, cpu0)
            cpu0 = d["cpu"]
            print(f"  c={n:2d}: {json.dumps(out[n])}", flush=True)
    finally:
        if proc.poll() is None:
            os.kill(_server_pid(proc, spy is not None), signal.SIGTERM)
            proc.wait(timeout=60)
    return out


def _server_pid(proc: subprocess.Popen[bytes], under_spy: bool) -> int:
    if not under_spy:
        return proc.pid
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(kids[0]) if kids else proc.pid


def _snapshot(pid: int, dump: str) -> dict[str, Any]:
    with_mtime = os.path.getmtime(dump) if os.path.exists(dump) else 0.0
    os.kill(pid, signal.SIGUSR1)
    for _ in range(200):
        time.sleep(0.05)
        if os.path.exists(dump) and os.path.getmtime(dump) != with_mtime:
            return json.loads(Path(dump).read_text())  # type: ignore[no-any-return]
    raise RuntimeError("no counters from the server")


CATEGORIES = [  # first match wins, looked up in the loop thread's stack, innermost first
    ("SSE framing (Rust)", ("sse.py", "encode_event")),
    ("JSON encoding", ("json_bytes", "orjson", "json/encoder")),
    ("codec (dialect)", ("protocol/openai_chat", "protocol/anthropic_stream", "protocol/base")),
    ("h11 / httptools", ("h11/", "httptools")),
    ("uvicorn protocol", ("uvicorn/protocols",)),
    ("stream hand-off", ("engine/stream.py",)),
    ("runner", ("api/respond.py",)),
    ("starlette / app", ("starlette/", "fastapi/", "api/app.py", "api/auth.py", "metrics.py")),
    ("asyncio (Python: tasks, futures, wait)", ("asyncio/", "uvloop")),
]


def spy_breakdown(path: Path) -> dict[str, Any]:
    """py-spy samples per thread, and the loop thread's serving samples by category."""
    per_thread: Counter[str] = Counter()
    loop_cats: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        per_thread[thread] += int(count)
        if thread != "MainThread" or "uvicorn/server.py" not in stack:
            continue
        cat = "other"
        if "runners.py" in frames[-1]:  # no Python frame below the loop: its own C code
            cat = "loop internals (uvloop C: epoll, I/O, callbacks)"
        for f in reversed(frames[1:] if cat == "other" else []):
            hit = next((c for c, keys in CATEGORIES if any(k in f for k in keys)), None)
            if hit:
                cat = hit
                break
        loop_cats[cat] += int(count)
    total = sum(loop_cats.values()) or 1
    return {
        "samples_per_thread": dict(per_thread.most_common(8)),
        "loop_serving_samples": sum(loop_cats.values()),
        "loop_share": {k: round(v / total, 3) for k, v in loop_cats.most_common()},
    }


def markdown(res: dict[int, dict[str, Any]]) -> str:
    lines = [
        "| streams | tok/s | handoff p50/p90 ms | encode p50/p90 ms | send p50/p90 ms "
        "| push→written p50/p90 ms | loop CPU ms/token | engine CPU ms/token | loop lag p50/p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in res.items():
        s = r["stages_ms"]

        def f(k: str, s: dict[str, Any] = s) -> str:
            return f"{s[k][0]:.2f} / {s[k][1]:.2f}" if k in s else "-"

        lines.append(
            f"| {n} | {r['tok_s']:.1f} | {f('handoff')} | {f('encode')} | {f('send')} "
            f"| {f('total')} | {r['loop_cpu_ms_per_token']:.3f} "
            f"| {r['engine_cpu_ms_per_token']:.2f} | {r['lag_ms'][0]:.2f} / {r['lag_ms'][1]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-uvloop", action="store_true", help="serve on asyncio's own loop")
    ap.add_argument("--py-spy", action="store_true", help="run the server under py-spy")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.dump, args.model, args.no_uvloop)
        return 0
    args.levels = [int(x) for x in args.levels.split(",")]
    print(f"load average before: {os.getloadavg()}", flush=True)
    spy = Path(tempfile.mktemp(prefix="cairn-spy-", suffix=".txt")) if args.py_spy else None
    res = run_pass(args, spy)
    print(f"load average after: {os.getloadavg()}\n", flush=True)
    print(markdown(res), flush=True)
    if spy is not None:
        print(json.dumps(spy_breakdown(spy), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
