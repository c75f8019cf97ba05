"""``cairn serve --kv-disk-dir``: a restart keeps Claude Code's long system prompt cached.

A real server process answers a request with a long system prompt and is
stopped (SIGTERM: its cached blocks go to the disk tier); a new process on
the same directory gets the same system prompt with another question and
reports nearly all of it as ``cache_read_input_tokens``, with the answer a
server without a disk tier gives.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anthropic
import pytest

from live_server import cairn_serve
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SYSTEM = "You are a meticulous assistant for a software team; answer briefly. " * 12


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)


def ask(url: str, question: str) -> anthropic.types.Message:
    with client(url) as c:
        return c.messages.create(
            model="m",
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},
        )


def system_tokens(url: str) -> int:
    msgs = [{"role": "user", "content": "x"}]
    with client(url) as c:
        with_sys = c.messages.count_tokens(model="m", system=SYSTEM, messages=msgs)
        without = c.messages.count_tokens(model="m", messages=msgs)
    return with_sys.input_tokens - without.input_tokens


def test_a_restart_keeps_the_system_prompt_cached(tmp_path: Path) -> None:
    folder = save_folder(tiny_model("llama", seed=2), tmp_path / "m")
    disk = tmp_path / "disk"
    args = ["--model", str(folder), "--kv-disk-dir", str(disk), "--log-level", "warning"]
    with cairn_serve(args, tmp_path / "a.log") as (url, proc):
        first = ask(url, "What does the build do?")
        assert first.usage.cache_read_input_tokens in (0, None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert list(disk.glob("*/*.kvb")), "nothing was kept at shutdown"
    with cairn_serve(args, tmp_path / "b.log") as (url, proc):
        n_system = system_tokens(url)
        again = ask(url, "Which tests are slow?")
    assert again.usage.cache_read_input_tokens >= 0.95 * n_system, (again.usage, n_system)
    plain = ["--model", str(folder), "--log-level", "warning"]
    with cairn_serve(plain, tmp_path / "c.log") as (url, proc):
        cold = ask(url, "Which tests are slow?")
    assert again.content == cold.content


def test_a_kill_during_use_leaves_a_tier_that_starts_and_answers(tmp_path: Path) -> None:
    """kill -9 at any moment: the next start uses only complete files."""
    folder = save_folder(tiny_model("llama", seed=2), tmp_path / "m")
    disk = tmp_path / "disk"
    args = ["--model", str(folder), "--kv-disk-dir", str(disk), "--log-level", "warning"]
    args += ["--kv-cache-gb", "0.0006"]  # ~1,200 tokens: blocks leave it (and go to disk)
    with cairn_serve(args, tmp_path / "a.log") as (url, proc):
        for i in range(8):
            ask(url, f"Question {i}: " + "tell me more. " * 20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    model_dir = next(p for p in disk.iterdir() if p.is_dir())
    (model_dir / "999.kvb.tmp").write_bytes(b"a write cut short")
    kept = sorted(model_dir.glob("*.kvb"))
    assert kept, "no block left the pool before the kill"
    kept[-1].write_bytes(kept[-1].read_bytes()[:-10])  # and a file cut short
    with cairn_serve(args, tmp_path / "b.log") as (url, proc):
        again = ask(url, "Question 0: " + "tell me more. " * 20)
    plain = ["--model", str(folder), "--log-level", "warning"]
    with cairn_serve(plain, tmp_path / "c.log") as (url, proc):
        cold = ask(url, "Question 0: " + "tell me more. " * 20)
    assert again.content == cold.content
    assert not list(model_dir.glob("*.tmp"))
