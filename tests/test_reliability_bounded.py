"""Bounded work per request: giant prompts against a real server (issue section 4).

- a prompt that cannot fit is refused on a cheap bound, never tokenized, with
  ``prompt is too long: N tokens > M maximum`` where N is a true lower bound;
  a prompt under the large size keeps its exact count;
- ``count_tokens`` of a 10 MB prompt is exact, and ``/health`` and a small
  request answer while it is tokenized;
- after six 30 MB ``count_tokens`` the resident size is back near its warm level.

Two engines: ``scripted`` (the real tiny byte-level BPE, which the bound
knows) and ``plain``, whose tokenizer is a word-level one without a
pre-tokenizer: every run of text between the template's special tokens is one
unknown token, and it tokenizes megabytes fast enough for a test while
allocating what a real tokenizer does per byte.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from live_server import registry_for, serve, wait_until
from mlx_cairn import heavy
from mlx_cairn.api import ServerConfig
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.protocol.anthropic import parse_count_tokens_request
from mlx_cairn.types import ChatRequest, Message
from scripted_model import scripted_model

pytestmark = pytest.mark.timeout(240)

HEADERS = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
MB = 1_000_000


def plain_model() -> Any:
    """The scripted model with a word-level tokenizer that has no pre-tokenizer (see module doc)."""
    lm = scripted_model("plain", context_length=8192)
    old = lm.tokenizer.hf
    hf = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    added = old.get_added_tokens_decoder().values()
    hf.add_special_tokens([t.content for t in added if t.special])
    hf.add_tokens([AddedToken(t.content, normalized=False) for t in added if not t.special])
    t = lm.tokenizer
    lm.tokenizer = Tokenizer(
        hf, bos_token=t.bos_token, eos_token=t.eos_token, pad_token=t.pad_token
    )
    return lm


class Counted:
    """Counts the prompts an engine's model renders and tokenizes."""

    def __init__(self, lm: Any) -> None:
        self.calls = 0
        self.real = lm.prompt
        lm.prompt = self

    def __call__(self, req: ChatRequest) -> Any:
        self.calls += 1
        return self.real(req)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engines = {
        "scripted": Engine(scripted_model(context_length=8192), EngineConfig(num_blocks=1024)),
        "plain": Engine(plain_model(), EngineConfig(num_blocks=64)),
    }
    counted = {name: Counted(e.loaded) for name, e in engines.items()}
    try:
        with serve(registry_for(engines), ServerConfig(max_body_bytes=32 * 1024 * 1024)) as srv:
            yield {"url": srv.url, "engines": engines, "counted": counted}
    finally:
        for e in engines.values():
            e.close()


def words(n_bytes: int) -> str:
    """Prose-like text of about ``n_bytes``."""
    unit = "The quick brown fox jumps over the lazy dog, then naps. "
    return unit * (n_bytes // len(unit) + 1)


def messages_body(text: str, model: str = "scripted") -> bytes:
    return orjson.dumps(
        {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    )


def count_body(text: str, model: str = "plain") -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})


def chat(text: str) -> ChatRequest:
    return ChatRequest([Message("user", text)], max_tokens=16)


# ------------------------------------------------------------- over context


def test_a_giant_prompt_is_refused_untokenized_with_a_true_lower_bound(
    env: dict[str, Any],
) -> None:
    counted = env["counted"]["scripted"]
    text = words(10 * MB)
    before = counted.calls
    r = httpx.post(
        env["url"] + "/v1/messages", content=messages_body(text), headers=HEADERS, timeout=120
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    m = TOO_LONG.fullmatch(error["message"])  # the exact words Claude Code compacts on
    assert m is not None, error["message"]
    n, limit = int(m.group(1)), int(m.group(2))
    assert limit == 8192 and n > limit
    assert counted.calls == before  # refused on the bound: never tokenized

    # The same text in OpenAI's words; N never above the real count (1.5 MB
    # of the same prose, tokenized here, is about a third of a million tokens).
    small = words(3 * MB // 2)
    r = httpx.post(
        env["url"] + "/v1/chat/completions",
        content=orjson.dumps(
            {
                "model": "scripted",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": small}],
            }
        ),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    said_m = re.search(r"messages resulted in (\d+) tokens", r.json()["error"]["message"])
    assert said_m is not None, r.json()
    said = int(said_m.group(1))
    exact = env["engines"]["scripted"].count_tokens(chat(small))
    assert limit < said <= exact


def test_an_over_context_prompt_under_the_large_size_keeps_its_exact_count(
    env: dict[str, Any],
) -> None:
    text = words(heavy.LARGE_BYTES // 4)
    url = env["url"]
    counted = httpx.post(
        url + "/v1/messages/count_tokens", content=count_body(text, "scripted"), headers=HEADERS
    )
    exact = counted.json()["input_tokens"]
    assert exact > 8192
    r = httpx.post(url + "/v1/messages", content=messages_body(text), headers=HEADERS, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"prompt is too long: {exact} tokens > 8192 maximum"


def test_count_tokens_stays_exact_for_a_large_prompt(env: dict[str, Any]) -> None:
    text = words(heavy.LARGE_BYTES + MB // 2)
    r = httpx.post(
        env["url"] + "/v1/messages/count_tokens",
        content=count_body(text, "scripted"),
        headers=HEADERS,
        timeout=120,
    )
    assert r.status_code == 200
    same = parse_count_tokens_request(orjson.loads(count_body(text, "scripted"))).chat
    assert r.json() == {"input_tokens": env["engines"]["scripted"].count_tokens(same)}


# --------------------------------------------------------- the event loop


def test_health_and_small_requests_answer_while_10mb_is_counted(env: dict[str, Any]) -> None:
    url = env["url"]
    text = words(10 * MB)
    big: dict[str, Any] = {}

    def send_big() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/messages/count_tokens", content=count_body(text), headers=HEADERS)
            big["response"] = r
            big["done"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    try:
        # The big request is being worked on (decoded, then rendered and tokenized).
        wait_until(lambda: heavy.GATE.busy > 0, "the big request never reached the gate", 60)
        answered_while_busy = 0
        with httpx.Client(base_url=url, timeout=120) as c:
            for _ in range(3):
                health = c.get("/health")  # open server: the full figures, from a worker thread
                assert health.status_code == 200 and health.json()["status"] == "ok"
                r = c.post(
                    "/v1/messages/count_tokens", content=count_body("hello"), headers=HEADERS
                )
                assert r.status_code == 200
                answered_while_busy += heavy.GATE.busy > 0 and "done" not in big
    finally:
        thread.join(120)
    assert big["response"].status_code == 200
    # All three /health and small count_tokens answers came while the 10 MB
    # request was still being worked on, before it finished.
    assert answered_while_busy == 3


# ---------------------------------------------------------------- memory

#: Sends N concurrent copies of one count_tokens body (read from stdin) from a
#: process of its own, so that only the server's memory is in this one.
CLIENT = """
import json, sys, threading, httpx
url, n = sys.argv[1], int(sys.argv[2])
body = sys.stdin.buffer.read()
out = [None] * n
def send(i):
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post("/v1/messages/count_tokens", content=body,
                   headers={"anthropic-version": "2023-06-01", "content-type": "application/json"})
        out[i] = [r.status_code, r.json()]
threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def send_from_another_process(url: str, body: bytes, n: int) -> list[list[Any]]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, url, str(n)],
        input=body,
        capture_output=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def settled_rss(trims: int) -> int:
    """The resident size once the trim after the last large job has run (``trims``:
    the count before that work was sent; the trim may come before the client returns)."""
    wait_until(lambda: heavy.trim_count() > trims, "no trim after large work", 30)
    rss = heavy.rss_bytes()
    assert rss is not None
    return rss


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and malloc_trim")
def test_memory_returns_to_its_warm_level_after_six_30mb_count_tokens(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two at once instead of one (this machine's default), to halve the wait.
    monkeypatch.setattr(heavy, "GATE", heavy.WorkGate(slots=2, thread_queue=4))
    url = env["url"]
    body = count_body("x" * (30 * MB))
    expect = httpx.post(url + "/v1/messages/count_tokens", content=count_body("x"), headers=HEADERS)
    # Warm: the server has answered a large request (its threads and their
    # allocator arenas exist) and handed the memory back.
    trims = heavy.trim_count()
    assert send_from_another_process(url, body, 2) == [[200, expect.json()]] * 2
    warm = settled_rss(trims)

    peak = [warm]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], heavy.rss_bytes() or 0)

    sampler = threading.Thread(target=sample)
    sampler.start()
    trims = heavy.trim_count()
    try:
        results = send_from_another_process(url, body, 6)
    finally:
        stop.set()
        sampler.join()
    # Every text between the template's tokens is one word to this tokenizer.
    assert results == [[200, expect.json()]] * 6
    after = settled_rss(trims)
    assert peak[0] > warm + 500 * 2**20  # the burst did take memory
    assert after <= warm * 1.10, (warm >> 20, peak[0] >> 20, after >> 20)
