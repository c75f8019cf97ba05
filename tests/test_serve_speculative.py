"""``cairn serve --speculative ngram`` end to end: same text as without it, usage, opt-out.

A real server process with speculative decoding serves a tiny random-weight
Llama saved as an HF folder; the answers (OpenAI and Anthropic SDKs, streamed
and not) equal what an engine without speculation writes, ``usage`` reports
the draft tokens, ``"speculative": false`` opts a request out, and /metrics
counts what was accepted.
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

PROMPTS = [
    "one two three four five six seven eight nine ten. one two three four five six",
    "the cat sat on the mat; the cat sat on the mat; the cat sat on",
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n    return x + y\n\ndef add(",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "llama"
    save_folder(tiny_zoo_model("llama", seed=5), path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("log") / "serve.log"
    args = ["--model", str(folder), "--speculative", "ngram", "--kv-cache-gb", "0.05"]
    with cairn_serve([*args, "--log-level", "warning"], log) as (url, _):
        yield url


def test_answers_equal_decoding_without_speculation(server: str, folder: Path) -> None:
    oa = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=120)
    drafted = accepted = 0
    for prompt in PROMPTS:
        want = engine_text(folder, prompt, MAX_TOKENS)
        body: dict[str, Any] = dict(
            model="llama",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        whole = oa.chat.completions.create(**body)
        assert whole.choices[0].message.content == want
        chunks = oa.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        for c in chunks:
            parts.extend(ch.delta.content or "" for ch in c.choices)
            usage = c.usage or usage
        assert "".join(parts) == want
        assert usage is not None and whole.usage is not None
        same = ("completion_tokens", "completion_tokens_details")
        assert {k: getattr(usage, k) for k in same} == {k: getattr(whole.usage, k) for k in same}
        details = whole.usage.completion_tokens_details
        extra = whole.usage.model_extra or {}
        if details is not None:  # the request speculated
            assert details.accepted_prediction_tokens == extra["accepted_draft_tokens"]
            assert (
                details.accepted_prediction_tokens + details.rejected_prediction_tokens
                == extra["draft_tokens"]
            )
            drafted += extra["draft_tokens"]
            accepted += extra["accepted_draft_tokens"]

        kw: dict[str, Any] = dict(
            model="llama",
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": prompt}],
        )
        msg = an.messages.create(**kw)
        with an.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert "".join(b.text for b in final.content if b.type == "text") == text
        m_extra = msg.usage.model_extra or {}
        assert m_extra.get("draft_tokens", 0) >= m_extra.get("accepted_draft_tokens", 0)
    oa.close()
    an.close()
    assert drafted > 0 and 0 < accepted <= drafted

    metrics = httpx.get(server + "/metrics", timeout=30).text
    lines = [x for x in metrics.splitlines() if x.startswith("cairn_speculative_tokens")]
    got = {x.split('kind="')[1].split('"')[0]: float(x.rsplit(" ", 1)[1]) for x in lines}
    assert got["draft"] >= drafted and 0 < got["accepted"] <= got["draft"]
    health = httpx.get(server + "/health", timeout=30).json()
    (entry,) = health["models"]
    assert entry["stats"]["spec_accepted_tokens"] == got["accepted"]


def test_a_draft_model_serves_the_same_text(folder: Path, tmp_path: Path) -> None:
    """``--draft-model``: the model itself as its draft accepts every draft."""
    args = ["--model", str(folder), "--draft-model", str(folder), "--kv-cache-gb", "0.05"]
    with cairn_serve([*args, "--log-level", "warning"], tmp_path / "serve.log") as (url, _):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        for prompt in PROMPTS[:2]:
            out = oa.chat.completions.create(
                model="llama",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            assert out.choices[0].message.content == engine_text(folder, prompt, MAX_TOKENS)
            assert out.usage is not None
            details = out.usage.completion_tokens_details
            assert details is not None and details.accepted_prediction_tokens
            assert details.rejected_prediction_tokens == 0
        oa.close()


def test_opt_out_and_a_bad_value(server: str) -> None:
    oa = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    out = oa.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert out.usage is not None and out.usage.completion_tokens_details is None
    assert "draft_tokens" not in (out.usage.model_extra or {})
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"speculative": "yes"},
        )
    assert e.value.body["param"] == "speculative"  # type: ignore[index]
    an = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as ae:
        an.messages.create(
            model="llama",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"speculative": 1},
        )
    assert "speculative" in str(ae.value)
    oa.close()
    an.close()
