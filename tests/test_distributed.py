"""One model over two ranks (MLX distributed, ring backend on loopback; issue 37).

- One ``mlx.launch --backend ring -n 2`` run serves three tiny random-weight
  models in turn (tensor parallel llama, tensor parallel MoE qwen3_moe,
  pipeline-only hybrid qwen3_next): a constrained and a streamed answer; a
  stream its client closes mid-answer beside a plain request; then 4 concurrent
  requests twice (batched, the second round hits the prefix cache, partial
  blocks included), greedy, through the OpenAI SDK. Every answer equals the
  single-process server's on the same folder, and afterwards rank 0 holds no
  KV block nor state slot. Last, llama and qwen3_next again in a pool too small
  for 4 requests at once: they preempt each other and still answer as one
  process does.
- ``cairn serve`` with ``MLX_HOSTFILE`` / ``MLX_RANK`` set by hand: a follower that
  stops answering makes requests fail with 503 and rank 0 exit; rank 0 dying
  makes the follower exit; both within a bounded time.
- Start-up refusals (flags that cannot work across ranks, an architecture mlx-lm
  cannot split) exit 2 before any load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from distributed_ranks import TINY_POOL_BLOCKS, preempt_workload, workload
from live_server import free_port, serve, wait_healthy
from mlx_cairn.api import ModelRegistry
from mlx_cairn.engine.distributed import (
    EXIT_RANK_LOST,
    decode_forward,
    encode_forward,
    head_problem,
    sharding_of,
    startup_problems,
)
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_zoo_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
#: Tensor parallel dense, tensor parallel MoE, pipeline-only hybrid.
FAMILIES = ["llama", "qwen3_moe", "qwen3_next"]
LAUNCH = Path(sys.executable).with_name("mlx.launch")
#: Served once more in a tiny KV pool: tensor parallel, and pipeline with recurrent state.
PREEMPTED = ["llama", "qwen3_next"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    for mt in FAMILIES:
        save_folder(tiny_zoo_model(mt, seed=5), root / f"tiny-{mt}")
    return root


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (mlx.launch's ring takes both)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("CAIRN_API_KEY", "MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_RANK")
    }


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_two_ranks_answer_as_one_process(model_dir: Path, tmp_path: Path) -> None:
    assert LAUNCH.exists()
    out = tmp_path / "ranks.json"
    log = tmp_path / "launch.log"
    cmd = [
        str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(_free_port_pair()),
        "--python", sys.executable, str(HERE / "distributed_ranks.py"), "--timeout", "30",
        "--out", str(out), *(f"--preempt={model_dir / f'tiny-{mt}'}" for mt in PREEMPTED),
        *(str(model_dir / f"tiny-{mt}") for mt in FAMILIES),
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
    try:
        # Meanwhile: the single-process server on the same folders, the same workload.
        want = {}
        for mt in FAMILIES:
            name = f"tiny-{mt}"
            registry = ModelRegistry([str(model_dir / name)])
            try:
                with serve(registry) as srv:
                    want[name] = workload(srv.url, name)
                    if mt in PREEMPTED:
                        want[f"{name} (preempted)"] = {"texts": preempt_workload(srv.url, name)}
            finally:
                registry.close()
        assert proc.wait(150) == 0, log.read_text()[-4000:]
    finally:
        _kill_group(proc)
    # mlx.launch may exit 0 when a rank failed: no answers then.
    assert out.exists(), log.read_text()[-4000:]
    got = json.loads(out.read_text())
    for mt in FAMILIES:
        name = f"tiny-{mt}"
        ref, run = want[name], got[name]
        assert run["texts"] == ref["texts"], name
        assert run["constrained"] == ref["constrained"], name
        assert json.loads(run["constrained"])["city"] is not None
        assert run["streamed"] == ref["streamed"], name
        # A stream closed by its client mid-answer: cancelled on rank 0 (and so
        # never stepped again on any rank), the request beside it unharmed.
        assert run["cancelled_chunks"] == 2, name
        assert run["beside_outlived_cancel"], name
        assert run["stats"]["requests_cancelled"] == 1, (name, run["stats"])
        assert run["beside_cancelled"] == ref["beside_cancelled"], name
        # Round 2 re-sends every prompt: each hits the cache (at least the system prompt).
        assert all(c >= 64 for c in run["cached"][1]), (name, run["cached"])
        assert run["stats"]["prefix_hit_tokens"] > 0
        if mt != "qwen3_next":  # a recurrent state cannot start mid-block
            # Partial-block hits: rank 0 sends each copy of cached rows to the others.
            assert run["stats"]["partial_hit_tokens"] > 0, (name, run["stats"])
        # No block or state slot left held by the cancelled, finished or failed rows.
        assert run["at_rest"] is None, (name, run["at_rest"])
        assert run["stats"]["blocks_in_use"] == 0, (name, run["stats"])
    # Greedy answers repeat across rounds (and are not all empty).
    assert any(t for t in got["tiny-llama"]["texts"][0])
    # A pool too small for 4 requests at once: they preempt each other (recomputed
    # later on every rank), and answer as one process with a roomy pool does.
    for mt in PREEMPTED:
        name = f"tiny-{mt} (preempted)"
        run = got[name]
        assert run["stats"]["blocks_total"] == TINY_POOL_BLOCKS, (name, run["stats"])
        assert run["stats"]["preemptions"] > 0, (name, run["stats"])
        assert run["texts"] == want[name]["texts"], name
        assert run["at_rest"] is None, (name, run["at_rest"])


@contextmanager
def _ranks(
    folder: Path, tmp_path: Path, timeout: float
) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """``cairn serve`` over 2 ranks, MLX_HOSTFILE / MLX_RANK set by hand; yields (url, [rank 0, rank 1])."""
    base = _free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**_env(), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        cmd = [
            sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(folder), "--rank-timeout", str(timeout),
        ]  # fmt: skip
        with open(tmp_path / f"rank{rank}.log", "wb") as f:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, procs[0], tmp_path / "rank0.log", timeout=90, what="the ranks")
        yield url, procs
    finally:
        for p in procs:
            with_cont = p.poll() is None
            if with_cont:
                os.killpg(p.pid, signal.SIGCONT)
            _kill_group(p)


def _ask(url: str) -> str | None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        r = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=6,
            temperature=0,
        )
        return r.choices[0].message.content
    finally:
        client.close()


def test_a_rank_that_stops_answering_ends_the_group(model_dir: Path, tmp_path: Path) -> None:
    with _ranks(model_dir / "tiny-llama", tmp_path, timeout=3) as (url, (r0, r1)):
        _ask(url)
        os.kill(r1.pid, signal.SIGSTOP)  # alive, silent: only the watchdog notices
        with pytest.raises(openai.APIStatusError) as err:
            _ask(url)
        assert err.value.status_code == 503
        assert "rank" in str(err.value.message)
        assert r0.wait(15) == EXIT_RANK_LOST  # the watchdog ends rank 0 in bounded time


def test_rank_zero_dying_ends_the_followers(model_dir: Path, tmp_path: Path) -> None:
    with _ranks(model_dir / "tiny-llama", tmp_path, timeout=3) as (url, (r0, r1)):
        _ask(url)
        os.kill(r0.pid, signal.SIGKILL)
        assert r1.wait(15) == EXIT_RANK_LOST, (tmp_path / "rank1.log").read_text()


# ------------------------------------------------------------------ cheap checks


def test_step_messages_round_trip() -> None:
    tokens = np.array([[5, 6, 7], [8, 0, 0]], dtype=np.int32)
    tables = [[1, 2], [3]]
    slots = [(0, [4, 5]), (2, [])]
    data = encode_forward(tokens, tables, [14, 3], [3, 1], slots)
    got_tokens, got_tables, offs, lens, got_slots = decode_forward(data)
    assert got_tokens.tolist() == tokens.tolist()
    assert (got_tables, offs, lens, got_slots) == (tables, [14, 3], [3, 1], [(0, [4, 5]), (2, [])])
    _, _, _, lens, none = decode_forward(encode_forward(tokens, tables, [1, 1], 1, None))
    assert lens == [1, 1] and none is None


def test_which_architectures_split() -> None:
    assert sharding_of("llama") == "tensor"
    assert sharding_of("qwen3_moe") == "tensor"
    assert sharding_of("qwen3_next") == "pipeline"
    with pytest.raises(Exception, match=r"'gemma3_text'.*neither"):
        sharding_of("gemma3_text")
    # Tensor parallel splits heads evenly: SmolLM2-135M's 9 do not go over 2 ranks.
    assert head_problem({"num_attention_heads": 4, "num_key_value_heads": 2}, 2) is None
    assert "= 9" in str(head_problem({"num_attention_heads": 9, "num_key_value_heads": 3}, 2))
    assert "= 2" in str(head_problem({"text_config": {"num_key_value_heads": 2}}, 4))


def _args(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = dict(model=[], kv_disk_dir=None, speculative=None, draft_model=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_start_up_refusals(model_dir: Path, tmp_path: Path) -> None:
    folder = str(model_dir / "tiny-llama")
    assert startup_problems(_args(model=[folder])) == []
    assert "--kv-disk-dir" in startup_problems(_args(model=[folder], kv_disk_dir="/tmp/x"))[0]
    assert "--speculative" in startup_problems(_args(model=[folder], speculative="ngram"))[0]
    assert "exactly one model" in startup_problems(_args(model=[folder, folder]))[0]
    gemma = tmp_path / "tiny-gemma3_text"
    shutil.copytree(model_dir / "tiny-llama", gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma3_text"}))
    # `cairn serve` itself: exit 2 before any rank joins, naming the architecture.
    env = {**_env(), "MLX_RANK": "0"}
    cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--model", str(gemma)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "gemma3_text" in done.stderr and "across ranks" in done.stderr
