"""``cairn serve`` refuses bad settings before it loads a model: exit 2, one line naming the flag.

Every run here points ``--model`` at a folder that does not exist. Were that
model loaded, its failure would be logged ("failed to load") and the server
would go on serving (a broken model leaves the others serving), so the
subprocess would not return: a quick exit 2 with no such line shows the flag
was refused first. The KV pool is sized from the model's shapes, so that
check runs after loading a tiny real model, still before serving.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_cairn.cli.serve import (
    MIN_KV_TOKENS,
    ServeError,
    add_arguments,
    bind_sockets,
    build,
    kv_pool_problem,
)
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model

pytestmark = pytest.mark.timeout(300)

#: Far above the second or so a refused start takes; only a hang reaches it.
EXIT_WAIT = 120


def serve(
    *argv: str, model: str = "/nonexistent/cairn-test-model"
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--model", model, *argv]
    env = {k: v for k, v in os.environ.items() if k != "CAIRN_API_KEY"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=EXIT_WAIT, env=env)


BAD_FLAGS = [
    (["--port", "-1"], "--port"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "http"], "--port"),
    (["--kv-cache-gb", "0"], "--kv-cache-gb"),
    (["--kv-cache-gb", "-2"], "--kv-cache-gb"),
    (["--kv-cache-gb", "nan"], "--kv-cache-gb"),
    (["--max-body-mb", "-1"], "--max-body-mb"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--max-body-mb", "1e-12"], "--max-body-mb"),
    (["--max-body-mb", "inf"], "--max-body-mb"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit"),
    (["--max-queue", "0"], "--max-queue"),
    (["--shutdown-grace", "-1"], "--shutdown-grace"),
    (["--context-length", "1"], "--context-length"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--header-timeout", "-5"], "--header-timeout"),
    (["--body-timeout", "0"], "--body-timeout"),
    (["--body-timeout", "inf"], "--body-timeout"),
    (["--host", "no-such-host.invalid", "--allow-no-auth"], "--host"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_flag_exits_2_naming_it_before_any_model_loads(argv, flag):
    r = serve(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert flag in r.stderr, r.stderr
    assert "failed to load" not in r.stderr + r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_a_busy_port_exits_2_before_any_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = serve("--port", str(port))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"--port {port}" in r.stderr and "already in use" in r.stderr, r.stderr
    assert "failed to load" not in r.stderr + r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_bind_sockets_holds_the_port_and_frees_it_on_close():
    (sock,) = bind_sockets("127.0.0.1", free_port())
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ServeError, match=f"--port {port}: .* already in use"):
            bind_sockets("127.0.0.1", port)
    finally:
        sock.close()
    for s in bind_sockets("127.0.0.1", port):
        s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup-model")
    save_folder(tiny_model("qwen3", seed=0), root / "tiny")
    return root / "tiny"


@pytest.mark.parametrize("gb", ["0.0001", "1e-9", "100000"])
def test_a_kv_cache_that_cannot_serve_exits_2_after_loading_before_serving(tiny_dir, gb):
    # 0.0001 GiB: a few blocks, fewer tokens than any request needs; 1e-9: not
    # one block; 100000: more than this machine has.
    r = serve("--kv-cache-gb", gb, "--preload", "--port", str(free_port()), model=str(tiny_dir))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("cairn serve: "))
    assert f"--kv-cache-gb {float(gb):g}" in line, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "Claude Code:" not in r.stdout  # it never got to serving


def test_kv_pool_problem_says_how_much_is_enough():
    # 5 usable blocks of 16 tokens, 16 KiB each (the null block included in the bytes).
    stats = EngineStats(blocks_total=5, block_size=16, kv_cache_bytes=6 * 16384)
    problem = kv_pool_problem("tiny", stats, 2048, 0.0001)
    assert problem is not None
    assert "--kv-cache-gb 0.0001 holds 80 tokens for tiny" in problem
    assert f"fewer than the {MIN_KV_TOKENS}" in problem
    # (1024 / 16 + 1 null) blocks of 16 KiB = 1.02 MiB, rounded up to the MiB.
    assert problem.endswith("use --kv-cache-gb 0.002 or more"), problem
    # A model whose whole context is shorter than the floor needs only its context.
    assert kv_pool_problem("tiny", stats, 64, 0.0001) is None
    big = EngineStats(blocks_total=4096, block_size=16, kv_cache_bytes=4097 * 16384)
    assert kv_pool_problem("tiny", big, 2048, 1.0) is None


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_timeouts_reach_the_server_config():
    _, config = build(args("--header-timeout", "7", "--body-timeout", "9"), {})
    assert (config.header_timeout, config.body_timeout) == (7.0, 9.0)
    _, config = build(args(), {})
    assert (config.header_timeout, config.body_timeout) == (60.0, 60.0)


def test_build_checks_a_namespace_made_in_code():
    for flag, value in (
        ("max_tokens_limit", 0),
        ("max_body_mb", -1.0),
        ("body_timeout", 0.0),
        ("shutdown_grace", float("nan")),
    ):
        ns = args()
        setattr(ns, flag, value)
        with pytest.raises(ServeError, match="--" + flag.replace("_", "-")):
            build(ns, {})


def test_speculative_flags():
    with pytest.raises(ServeError, match="pick one"):
        build(args("--speculative", "ngram", "--draft-model", "some/model"), {})
    for bad in (["--speculative", "medusa"], ["--num-speculative-tokens", "0"]):
        with pytest.raises(SystemExit):
            args(*bad)
    ns = args("--speculative", "ngram", "--num-speculative-tokens", "4")
    assert (ns.speculative, ns.num_speculative_tokens, ns.draft_model) == ("ngram", 4, None)
