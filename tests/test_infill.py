"""llama.cpp's ``POST /infill`` (llama.vim, llama.vscode) through the real server.

The same tiny coder model as tests/test_openai_completions.py: the answer
equals mlx-lm's on the FIM prompt built by hand (repository context
included), and equals ``/v1/completions`` with a suffix; the stream's chunks
fold to the JSON answer; bad input is a 400 in llama.cpp's envelope.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fim_fixtures import fim_model, mlx_lm_generate, qwen_fim_ids
from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.chat.fim import fim_stop_ids
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.protocol.llama_infill import fold_chunks
from mlx_cairn.testing.engine_checks import assert_at_rest

PREFIX = "def add(x, y):\n"
LINE = "    return"
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "X = 1\n"}]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engines = {
        "coder": Engine(fim_model("qwen"), EngineConfig(num_blocks=128, block_size=8)),
        "chat": Engine(fim_model(None), EngineConfig(num_blocks=32, block_size=8)),
    }
    with serve(registry_for(engines), ServerConfig(ping_interval=0.05)) as srv:
        yield {"url": srv.url, "engines": engines}
    for e in engines.values():
        e.close()


def _post(env: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(env["url"] + "/infill", json=body, timeout=60)


def test_infill_equals_mlx_lm_on_the_hand_built_prompt(env: dict[str, Any]) -> None:
    lm = env["engines"]["coder"].loaded
    tok = lm.tokenizer
    tid = tok.token_to_id
    by_hand = [
        tid("<|repo_name|>"),
        *tok.encode_plain("myproject\n"),
        tid("<|file_sep|>"),
        *tok.encode_plain("util.py\n"),
        *tok.encode_plain("X = 1\n"),
        tid("<|file_sep|>"),
        *tok.encode_plain("filename\n"),
        *qwen_fim_ids(tok, PREFIX + LINE, SUFFIX),
    ]
    stops = set(lm.eos_token_ids) | fim_stop_ids(tok)
    ids = mlx_lm_generate(lm, by_hand, 12, stops)
    text = tok.decode(ids[:-1] if ids[-1] in stops else ids)
    # No model named: llama.cpp serves one, so the first served model answers.
    body = {
        "input_prefix": PREFIX,
        "prompt": LINE,
        "input_suffix": SUFFIX,
        "input_extra": EXTRA,
        "n_predict": 12,
        "temperature": 0,
        "t_max_predict_ms": 500,  # llama.vim's fields are accepted
        "samplers": ["top_k", "top_p", "infill"],
    }
    r = _post(env, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == text and got["stop"] is True
    assert got["tokens_evaluated"] == len(by_hand) and got["tokens_predicted"] == len(ids)
    assert got["stop_type"] == ("limit" if len(ids) == 12 and ids[-1] not in stops else "eos")
    assert set(got["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}
    assert got["generation_settings"]["n_ctx"] == lm.context_length
    # Streamed: the chunks fold to the same answer (timings aside).
    with httpx.stream("POST", env["url"] + "/infill", json={**body, "stream": True}) as s:
        wire = [(None, json.loads(line[5:])) for line in s.iter_lines() if line.startswith("data:")]
    assert all(not p["stop"] for _, p in wire[:-1]) and wire[-1][1]["stop"]
    folded = fold_chunks(wire)
    drop = ("timings",)
    assert {k: v for k, v in folded.items() if k not in drop} == {
        k: v for k, v in got.items() if k not in drop and k != "tokens_cached"
    } | {"tokens_cached": folded["tokens_cached"]}
    assert folded["tokens_cached"] > 0  # the second request read the first from the cache


def test_infill_equals_v1_completions_with_a_suffix(env: dict[str, Any]) -> None:
    body = {"model": "coder", "n_predict": 8, "temperature": 0}
    a = _post(env, {**body, "input_prefix": PREFIX, "input_suffix": SUFFIX}).json()
    b = httpx.post(
        env["url"] + "/v1/completions",
        json={"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8,
              "temperature": 0},
        timeout=60,
    ).json()  # fmt: skip
    assert a["content"] == b["choices"][0]["text"]


def test_bad_infill_requests_are_400s(env: dict[str, Any]) -> None:
    before = {n: e.stats().requests_total for n, e in env["engines"].items()}
    for body, words in (
        ({"model": "chat", "input_prefix": "a", "input_suffix": "b"}, "fill-in-the-middle"),
        ({"input_prefix": 3}, "input_prefix"),
        ({"input_extra": [{"text": 1}]}, "input_extra[0].text"),
        ({"n_predict": 0}, "n_predict"),
        ({"model": "nope"}, "not found"),
    ):
        r = _post(env, body)
        assert r.status_code in (400, 404), (body, r.text)
        err = r.json()["error"]
        assert err["code"] == r.status_code and words in err["message"], (body, err)
    for n, e in env["engines"].items():
        assert assert_at_rest(e).requests_total == before[n]
