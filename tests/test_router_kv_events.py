"""Two ``cairn serve --kv-events`` replicas behind the real vllm-router, ``--policy kv_aware``.

Each session's first turn is sent straight to one replica (sessions alternate),
so only that replica holds its prefix; the router learns that from the
replicas' KV events alone. The later turns go through the router: each must
reach the replica holding its prefix, measured as the share of the re-sent
prompt (the previous turn's prompt) the replica reports cached. The same
sessions behind a round-robin router are the baseline.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from live_server import free_port, wait_healthy
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROUTER = Path(sys.executable).parent / "vllm-router"
SESSIONS = 5  # odd: round-robin then sends a session's turns to alternating replicas
TURNS = 4
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def replicas(folder: Path, tmp: Path, n: int) -> Iterator[list[tuple[str, str]]]:
    """``n`` replicas started at once; yields (http url, kv-event endpoint) each."""
    procs, out = [], []
    try:
        for i in range(n):
            port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
            cmd = [
                sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--model", str(folder), "--preload",
                "--kv-events", events, "--log-level", "warning",
            ]  # fmt: skip
            with open(tmp / f"replica{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            out.append((f"http://127.0.0.1:{port}", events))
        for (url, _), proc, i in zip(out, procs, range(n), strict=True):
            wait_healthy(url, proc, tmp / f"replica{i}.log")
        yield out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def router(policy: str, workers: list[tuple[str, str]], log: Path) -> Iterator[str]:
    port = free_port()
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *(url for url, _ in workers), "--log-level", "debug"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if policy == "kv_aware":
        cmd += ["--kv-event-model", "m"]
        for url, events in workers:
            cmd += ["--kv-event-source", f"{url}={events}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def subscribed(workers: list[tuple[str, str]], log: Path) -> None:
    """Wait until the router has read a KV event from every replica (a ZMQ subscriber
    misses what is published before it joins): probe each replica with a prompt of
    its own until the router logs its event sequence advancing."""
    deadline = time.monotonic() + 30
    for i in range(1000):
        for url, _ in workers:
            chat(url, [{"role": "user", "content": f"probe {i} " * 8}], max_tokens=1)
        time.sleep(0.3)
        lines = [ANSI.sub("", x) for x in log.read_text(errors="replace").splitlines()]
        seen = {
            url
            for url, _ in workers
            for x in lines
            if "live sequence advanced" in x and f"source={url}" in x
        }
        if len(seen) == len(workers):
            return
        assert time.monotonic() < deadline, f"the router never read events from {seen}"


def chat(url: str, messages: list[dict], max_tokens: int = 6) -> dict:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def sessions_hit_rate(router_url: str, workers: list[tuple[str, str]], tag: str) -> float:
    """Run the sessions (first turn straight to replica ``s % 2``, the rest through the
    router); the share of re-sent prompt tokens the replicas found cached."""
    hist = [
        [{"role": "system", "content": f"{tag} session {s}: you maintain module {s * 7919}. " * 10}]
        for s in range(SESSIONS)
    ]
    prev = [0] * SESSIONS
    resent = hit = 0
    for t in range(TURNS):
        for s in range(SESSIONS):
            hist[s].append({"role": "user", "content": f"turn {t}: what about item {s}-{t}?"})
            url = workers[s % len(workers)][0] if t == 0 else router_url
            j = chat(url, hist[s])
            hist[s].append({"role": "assistant", "content": j["choices"][0]["message"]["content"]})
            if t:
                cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]
                resent += prev[s]
                hit += min(cached, prev[s])
            prev[s] = j["usage"]["prompt_tokens"]
    return hit / resent


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (the dev extra)")
def test_kv_aware_router_follows_the_replicas_kv_events(tmp_path: Path) -> None:
    folder = save_folder(tiny_model("llama", seed=2), tmp_path / "m")
    with ExitStack() as stack:
        workers = stack.enter_context(replicas(folder, tmp_path, 2))
        kv_log = tmp_path / "router-kv.log"
        kv_url = stack.enter_context(router("kv_aware", workers, kv_log))
        subscribed(workers, kv_log)
        kv_rate = sessions_hit_rate(kv_url, workers, "kv")
        decisions = [
            ANSI.sub("", x) for x in kv_log.read_text().splitlines() if "KV prefix decision" in x
        ]
        credited = [x for x in decisions if "credited_prefix_tokens=0 " not in x]
        with router("round_robin", workers, tmp_path / "router-rr.log") as rr_url:
            rr_rate = sessions_hit_rate(rr_url, workers, "rr")
        stats = [httpx.get(url + "/health").json()["models"][0]["stats"] for url, _ in workers]
    print(f"kv_aware: {kv_rate:.1%} of re-sent prompt tokens cached; round_robin: {rr_rate:.1%}")
    assert kv_rate >= 0.9, (kv_rate, rr_rate)
    assert rr_rate < 0.8, rr_rate  # the sessions do need steering
    assert len(credited) >= SESSIONS * (TURNS - 1)  # decisions made on the events
    assert all(st["kv_events_batches"] > 0 and st["kv_events_dropped"] == 0 for st in stats)
    assert all(st["requests_completed"] > SESSIONS for st in stats), stats  # both served
