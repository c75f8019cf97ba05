"""The one-sequence reference loop and `cairn generate`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.cli import main
from mlx_cairn.engine import reference
from mlx_cairn.engine.reference import GenerationStats, generate_ids, generate_tokens
from mlx_cairn.models import ContiguousKVCache
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Message, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _greedy_by_recompute(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence every step (no cache reuse)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        h = model(mx.array([ids]), ContiguousKVCache(model.num_layers))
        t = int(np.argmax(np.array(model.logits(h[:, -1, :]))[0]))
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_full_recompute(arch):
    lm = tiny_model(arch, seed=8)
    prompt = lm.prompt(
        ChatRequest(messages=[Message("user", "What is the capital of France?")])
    ).ids
    got = generate_ids(lm.model, prompt, max_tokens=20, sampling=GREEDY)
    assert got == _greedy_by_recompute(lm.model, prompt, 20)


def test_chunked_prefill_gives_the_same_tokens(monkeypatch):
    lm = tiny_model("qwen3", seed=9)
    prompt = np.random.default_rng(0).integers(0, 300, size=70).tolist()
    want = generate_ids(lm.model, prompt, max_tokens=8, sampling=GREEDY)
    monkeypatch.setattr(reference, "PREFILL_STEP", 16)
    assert generate_ids(lm.model, prompt, max_tokens=8, sampling=GREEDY) == want


def test_eos_and_max_tokens():
    lm = tiny_model("llama", seed=10)
    prompt = [1, 20, 30, 40]
    first = generate_ids(lm.model, prompt, max_tokens=5, sampling=GREEDY)
    assert len(first) == 5
    stats = GenerationStats()
    ids = list(
        generate_tokens(
            lm.model, prompt, max_tokens=50, sampling=GREEDY, eos_token_ids={first[2]}, stats=stats
        )
    )
    assert ids == first[: first.index(first[2]) + 1]
    assert stats.finish_reason == "eos" and stats.generated_tokens == len(ids)
    assert generate_ids(lm.model, prompt, max_tokens=0) == []
    with pytest.raises(ValueError, match="empty"):
        generate_ids(lm.model, [], max_tokens=3)


def test_seeded_sampling_reproduces():
    lm = tiny_model("qwen3", seed=11)
    prompt = [1, 50, 60, 70]
    s = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    a = generate_ids(lm.model, prompt, max_tokens=24, sampling=s)
    assert a == generate_ids(lm.model, prompt, max_tokens=24, sampling=s)
    b = generate_ids(
        lm.model, prompt, max_tokens=24, sampling=SamplingParams(temperature=1.0, seed=124)
    )
    assert a != b
    top1 = generate_ids(
        lm.model, prompt, max_tokens=24, sampling=SamplingParams(temperature=1.0, top_k=1, seed=5)
    )
    assert top1 == generate_ids(lm.model, prompt, max_tokens=24, sampling=GREEDY)


def test_cli_generate_with_a_folder_model(tmp_path, capsys):
    lm = tiny_model("llama", seed=12)
    folder = save_folder(lm, tmp_path / "tiny")
    rc = main(
        [
            "generate",
            "Hello there",
            "--model",
            str(folder),
            "--max-tokens",
            "12",
            "--seed",
            "4",
            "--temperature",
            "0.7",
            "-v",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    prompt = lm.prompt(ChatRequest(messages=[Message("user", "Hello there")])).ids
    ids = generate_ids(
        lm.model,
        prompt,
        max_tokens=12,
        sampling=SamplingParams(temperature=0.7, seed=4),
        eos_token_ids=lm.eos_token_ids,
    )
    ids = [i for i in ids if i not in lm.eos_token_ids]
    assert out == lm.tokenizer.decode(ids) + "\n"
    assert "tok/s" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/definitely/not/here"], "not found"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_cli_generate_errors(tmp_path, capsys, argv, message):
    folder = save_folder(tiny_model("llama"), tmp_path / "tiny")
    base = ["generate", "hi", "--model", str(folder)]
    rc = main(base + argv)
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_generate_default_model(capsys, default_model, monkeypatch):
    from mlx_cairn.cli import generate as generate_cli

    monkeypatch.setattr(generate_cli, "_load_with_progress", lambda *a: (default_model, 0.0))
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "24"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_generate_stops_at_a_stop_sequence(tmp_path, capsys):
    lm = tiny_model("llama", seed=12)
    folder = save_folder(lm, tmp_path / "tiny")
    base = ["generate", "Hello there", "--model", str(folder), "--max-tokens", "24"]
    assert main(base) == 0
    full = capsys.readouterr().out.rstrip("\n")
    assert len(full) > 6
    stop = full[3:6]
    assert main([*base, "--stop", stop]) == 0
    cut = capsys.readouterr().out.rstrip("\n")
    assert cut == full[: full.index(stop)]
