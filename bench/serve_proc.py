"""A ``cairn serve`` subprocess for the load benchmarks, and what can be read of it from outside.

Used by ``bench/load.py``: start it on a free loopback port (with the shared
test token), wait until it answers, wait until it is at rest, and read its
resident memory and open sockets (Linux ``/proc``), its answers by status
(``/metrics``) and the WARNING / ERROR lines it logged.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

TOKEN = "load-test-token-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid``, or of its thread ``tid`` (Linux /proc)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    f = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--max-queue", str(args.max_queue), "--log-level", "warning",
    ]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_cache_gb:
        cmd += ["--kv-cache-gb", str(args.kv_cache_gb)]
    for flag in ("max_body_mb", "header_timeout", "body_timeout"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    env = dict(os.environ, CAIRN_API_KEY=TOKEN)
    log = open(args.server_log, "wb")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see the server log")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError("server did not come up in time")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_rest(url: str, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until every model is idle; return the engine stats of the first one."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", headers={"x-api-key": TOKEN}, timeout=10).json()
        st = h["models"][0].get("stats", {})
        if st.get("queue_depth") == 0 and st.get("running") == 0 and st.get("waiting") == 0:
            return st  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            return st  # type: ignore[no-any-return]
        time.sleep(0.2)


REST_KEYS = ("queue_depth", "running", "waiting", "blocks_in_use", "blocks_free", "blocks_cached")


def rest_check(url: str) -> dict[str, Any]:
    st = wait_rest(url)
    return {k: st.get(k) for k in REST_KEYS}


def status_counts(url: str) -> Counter[str]:
    """Answers by HTTP status so far, as the server's /metrics counts them."""
    text = httpx.get(url + "/metrics", headers={"x-api-key": TOKEN}, timeout=10).text
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("cairn_http_requests_total{") and 'status="' in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            out[status] += int(float(line.rsplit(" ", 1)[1]))
    return out


def server_log_since(path: str, offset: int) -> tuple[int, dict[str, Any]]:
    """WARNING / ERROR lines the server logged after ``offset``; the new offset."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
        end = f.tell()
    lines = text.splitlines()
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    warnings = [ln for ln in lines if ln.startswith("WARNING")]
    first = list(dict.fromkeys(ln[:200] for ln in errors + warnings))[:8]
    tracebacks = sum(ln.startswith("Traceback") for ln in lines)
    return end, {
        "errors": len(errors),
        "warnings": len(warnings),
        "tracebacks": tracebacks,
        "first_lines": first,
    }


def server_sockets(pid: int) -> int:
    """Open sockets of ``pid`` (the listening one included)."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we looked
            n += os.readlink(fd).startswith("socket:")
    return n
