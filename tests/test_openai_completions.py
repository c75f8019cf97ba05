"""``POST /v1/completions`` through the real server and the ``openai`` SDK.

A tiny random-weight mlx-lm ``qwen2`` model whose tokenizer has Qwen-Coder
FIM tokens (``coder``) and one without them (``chat``). Greedy answers are
compared with mlx-lm's own generation loop on the raw prompt and on the FIM
prompt built by hand; bad requests are 400s in the OpenAI envelope that leave
the engines at rest; an extended prompt reads the last one from the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from fim_fixtures import fim_model, mlx_lm_generate, qwen_fim_ids
from live_server import registry_for, serve, wait_until
from mlx_cairn.api import ServerConfig
from mlx_cairn.chat.fim import fim_stop_ids
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest

PREFIX = "def add(x, y):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engines = {
        "coder": Engine(fim_model("qwen"), EngineConfig(num_blocks=256, block_size=8)),
        "chat": Engine(fim_model(None), EngineConfig(num_blocks=64, block_size=8)),
    }
    registry = registry_for(engines)
    with serve(registry, ServerConfig(ping_interval=0.05)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            yield {"url": srv.url, "client": client, "engines": engines, "registry": registry}
        finally:
            client.close()
    for e in engines.values():
        e.close()


def _reference(lm: Any, prompt: list[int], max_tokens: int, stops: set[int]) -> tuple[str, int]:
    """mlx-lm's greedy text on ``prompt`` (a final stop token is not text) and its token count."""
    ids = mlx_lm_generate(lm, prompt, max_tokens, stops)
    n = len(ids)
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return lm.tokenizer.decode(ids), n


def test_greedy_equals_mlx_lm_on_the_raw_prompt(env: dict[str, Any]) -> None:
    c: openai.OpenAI = env["client"]
    lm = env["engines"]["coder"].loaded
    prompt = "Hello world! How are you today?"
    want, n = _reference(lm, lm.tokenizer.encode(prompt), 12, set(lm.eos_token_ids))
    got = c.completions.create(model="coder", prompt=prompt, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and len(got.choices) == 1
    assert got.choices[0].text == want
    assert got.usage is not None and got.usage.completion_tokens == n
    assert got.usage.prompt_tokens == len(lm.tokenizer.encode(prompt))
    chunks = list(
        c.completions.create(
            model="coder",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == got.choices[0].finish_reason and not any(finish[:-1])


def test_fim_equals_mlx_lm_on_the_hand_built_prompt(env: dict[str, Any]) -> None:
    c: openai.OpenAI = env["client"]
    lm = env["engines"]["coder"].loaded
    tok = lm.tokenizer
    by_hand = qwen_fim_ids(tok, PREFIX, SUFFIX)
    want, n = _reference(lm, by_hand, 16, set(lm.eos_token_ids) | fim_stop_ids(tok))
    got = c.completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0
    )
    assert got.choices[0].text == want
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(by_hand), n)


def test_bad_requests_are_400s_before_any_work(env: dict[str, Any]) -> None:
    c: openai.OpenAI = env["client"]
    before = {name: e.stats().requests_total for name, e in env["engines"].items()}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"model": "chat", "prompt": PREFIX, "suffix": SUFFIX}, "suffix", "fill-in-the-middle"),
        ({"model": "coder", "prompt": [1, "a"]}, "prompt", "one shape"),
        ({"model": "coder", "prompt": []}, "prompt", "non-empty"),
        ({"model": "coder", "prompt": [[1, 2], [99999]]}, "prompt", "outside the vocabulary"),
        ({"model": "coder", "prompt": [1, 2], "suffix": "x"}, "suffix", "token ids"),
        ({"model": "coder", "prompt": "a", "n": 2, "best_of": 3}, "best_of", "best_of"),
        ({"model": "coder", "prompt": "a", "echo": True, "logprobs": 1}, "echo", "logprobs"),
        ({"model": "coder", "prompt": "a", "logprobs": 21}, "logprobs", "between"),
        ({"model": "coder", "prompt": "a", "max_tokens": 100_000}, "max_tokens", ""),
        ({"model": "coder"}, "prompt", "required"),
    ]
    for body, param, words in cases:
        r = httpx.post(env["url"] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert words in err["message"], (body, err)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="chat", prompt=PREFIX, suffix=SUFFIX)
    for name, e in env["engines"].items():
        assert assert_at_rest(e).requests_total == before[name]  # none reached an engine


def test_an_extended_prompt_reads_the_last_one_from_the_cache(env: dict[str, Any]) -> None:
    """Editors resend the text around the cursor on every keystroke."""
    c: openai.OpenAI = env["client"]
    code = "def add(x, y):\n    return x + y\n\n" * 4
    first = c.completions.create(
        model="coder", prompt=code, suffix=SUFFIX, max_tokens=2, temperature=0
    )
    raw = c.completions.with_raw_response.create(
        model="coder", prompt=code + "def", suffix=SUFFIX, max_tokens=2, temperature=0
    )
    second = raw.parse()
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Every full block before the edit is a hit (8-token blocks).
    assert details.cached_tokens >= first.usage.prompt_tokens - 2 * 8 - len(
        env["engines"]["coder"].loaded.tokenizer.encode_plain(SUFFIX)
    )
    assert raw.headers["x-session-cache"] == "prefix_hit"


def test_prompt_lists_n_logprobs_and_echo(env: dict[str, Any]) -> None:
    c: openai.OpenAI = env["client"]
    lm = env["engines"]["coder"].loaded
    ids = lm.tokenizer.encode("Hello world! How are you today?")
    got = c.completions.create(
        model="coder", prompt=[ids, ids[:3]], n=2, max_tokens=4, temperature=0, logprobs=2
    )
    assert [ch.index for ch in got.choices] == [0, 1, 2, 3]
    # Greedy: both choices of a prompt agree; each prompt as mlx-lm says.
    assert got.choices[0].text == got.choices[1].text
    assert got.choices[2].text == got.choices[3].text
    assert got.choices[0].text == _reference(lm, ids, 4, set(lm.eos_token_ids))[0]
    assert got.usage is not None and got.usage.prompt_tokens == len(ids) + 3
    for ch in got.choices:
        lp = ch.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert lp.text_offset is not None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert "".join(lp.tokens) == ch.text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        for tok, top, x in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
            assert top[tok] == x and 2 <= len(top) <= 3
    echoed = c.completions.create(
        model="coder", prompt="Hello", echo=True, max_tokens=3, temperature=0
    )
    plain = c.completions.create(model="coder", prompt="Hello", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text
    for e in env["engines"].values():
        assert_at_rest(e)
    # Every choice's lease on the model was given back (it may be unloaded again).
    wait_until(lambda: all(sm.active == 0 for sm in env["registry"].models), "a lease was kept")


def test_a_client_that_leaves_cancels_every_choice(env: dict[str, Any]) -> None:
    engine = env["engines"]["coder"]
    before = engine.stats().requests_cancelled
    eos = {str(t): -100 for t in engine.loaded.eos_token_ids}
    body = {"model": "coder", "prompt": ["a", "b"], "n": 2, "max_tokens": 1500,
            "temperature": 0, "logit_bias": eos, "stream": True}  # fmt: skip
    with httpx.stream("POST", env["url"] + "/v1/completions", json=body, timeout=60) as r:
        seen = {json.loads(line[5:])["choices"][0]["index"] for line in _first(r, 20)}
    assert seen  # it was streaming; the client is gone now
    wait_until(
        lambda: engine.stats().requests_cancelled >= before + 4, "the choices were not cancelled"
    )
    assert_at_rest(engine)
    wait_until(lambda: all(sm.active == 0 for sm in env["registry"].models), "a lease was kept")


def _first(r: httpx.Response, n: int) -> list[str]:
    """The first ``n`` data lines of a streamed answer (then the caller closes it)."""
    out: list[str] = []
    for line in r.iter_lines():
        if line.startswith("data:") and line != "data: [DONE]":
            out.append(line)
            if len(out) == n:
                break
    return out
