"""``cairn serve`` end to end on mlx-lm architectures: dense, MoE, sliding-window, MLA.

One real server process serves four tiny random-weight models saved as HF
folders. Each answers through the OpenAI and Anthropic SDKs, streamed and not,
with the same greedy text; the OpenAI answer is what the in-process engine
produces for the same request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from live_server import cairn_serve, engine_text
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_zoo_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: One family shape each: dense, MoE, sliding window + sinks, MLA, and two hybrids
#: (Gated DeltaNet, Mamba 2).
HYBRIDS = ["qwen3_5", "nemotron_h"]
FAMILIES = ["olmo2", "qwen3_moe", "gpt_oss", "deepseek_v3", *HYBRIDS]
PROMPT = "What is the capital of France?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    for mt in FAMILIES:
        save_folder(tiny_zoo_model(mt, seed=11), root / mt)
    return root


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "serve.log"
    models = [a for mt in FAMILIES for a in ("--model", str(model_dir / mt))]
    with cairn_serve([*models, "--kv-cache-gb", "0.05", "--log-level", "warning"], log) as (url, _):
        yield url


@pytest.mark.parametrize("model_type", FAMILIES)
def test_serves_through_both_sdks(server: str, model_dir: Path, model_type: str) -> None:
    want = engine_text(model_dir / model_type, PROMPT, MAX_TOKENS)
    oa = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    body: dict[str, Any] = dict(
        model=model_type,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = oa.chat.completions.create(**body)
    assert whole.choices[0].message.content == want
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    chunks = oa.chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want

    an = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=120)
    msg = an.messages.create(
        model=model_type,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # (this SDK version has no temperature argument)
        messages=[{"role": "user", "content": PROMPT}],
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    with an.messages.stream(
        model=model_type,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": PROMPT}],
    ) as stream:
        final = stream.get_final_message()
    oa.close()
    an.close()
    # (The Anthropic dialect renders its own prompt, so only its two forms are compared.)
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert msg.usage.output_tokens > 0
    if model_type in HYBRIDS:
        # The same prompt came four times: the later ones restored a state snapshot.
        health = httpx.get(server + "/health", timeout=30).json()
        (entry,) = [m for m in health["models"] if m["name"] == model_type]
        st = entry["stats"]
        assert st["state_slots_total"] > 0 and st["state_snapshots"] > 0, st
        assert st["state_snapshot_hits"] > 0 and st["state_snapshot_bytes"] > 0, st
        assert msg.usage.cache_read_input_tokens, msg.usage
