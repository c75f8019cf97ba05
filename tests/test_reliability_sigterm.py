"""A real ``cairn serve`` process: a broken model beside a good one, and SIGTERM mid-stream.

The server runs a tiny random-weight model saved as a Hugging Face folder (so
its answers are long and never stop early) next to a ``.gguf`` file that is
garbage. The broken model is a 500 in each dialect's envelope while the other
keeps serving. On SIGTERM every in-flight stream is either finished or ended
with an ``error`` event within the grace period, and the process exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from live_server import cairn_serve
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model

pytestmark = pytest.mark.timeout(180)

#: ``cairn serve --shutdown-grace``: short, so the streams below outlive it.
GRACE = 1.0
#: Generous slack for a loaded machine (the engine thread joins, frames flush).
SLACK = 20.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    save_folder(tiny_model("qwen3", seed=0), root / "tiny")  # greedy: 1800 tokens, no EOS
    (root / "broken.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    return root


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    log = tmp_path / "serve.log"
    args = [
        "--model", str(model_dir / "tiny"), "--model", str(model_dir / "broken.gguf"),
        "--kv-cache-gb", "0.05", "--log-level", "warning", "--shutdown-grace", str(GRACE),
    ]  # fmt: skip
    with cairn_serve(args, log) as (url, proc):
        yield {"url": url, "proc": proc, "log": log}


BODIES = {
    "/v1/messages": lambda model, stream: {
        "model": model,
        "max_tokens": 1800,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    },
    "/v1/chat/completions": lambda model, stream: {
        "model": model,
        "max_tokens": 1800,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    },
    "/v1/responses": lambda model, stream: {
        "model": model,
        "max_output_tokens": 1800,
        "stream": stream,
        "store": False,
        "input": "Tell me a long story.",
    },
}
HEADERS = {"anthropic-version": "2023-06-01"}


def test_a_broken_model_leaves_the_others_serving(server):
    url = server["url"]
    for path, make in BODIES.items():
        r = httpx.post(url + path, json=make("broken", False), headers=HEADERS, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert "failed to load" in err["message"], err
        good = make("tiny", False)
        good["max_tokens" if "max_tokens" in good else "max_output_tokens"] = 4
        assert httpx.post(url + path, json=good, headers=HEADERS, timeout=60).status_code == 200
    health = httpx.get(url + "/health", timeout=10).json()
    models = {m["name"]: m for m in health["models"]}
    assert models["tiny"]["loaded"] and not models["broken.gguf"]["loaded"]
    assert "failed to load" in models["broken.gguf"]["error"]


def final_state(path: str, text: str) -> str:
    """'finished', 'error' or 'truncated' for one stream's full text."""
    if path == "/v1/messages":
        if "event: error" in text:
            return "error"
        return "finished" if "event: message_stop" in text else "truncated"
    if path == "/v1/chat/completions":
        datas = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
        if any('"error"' in d and d.startswith('{"error"') for d in datas):
            return "error"
        return "finished" if datas and datas[-1] == "[DONE]" else "truncated"
    if "response.failed" in text or "event: error" in text:
        return "error"
    return "finished" if "response.completed" in text else "truncated"


def test_sigterm_ends_every_stream_then_exits_zero(server):
    url, proc = server["url"], server["proc"]
    texts: dict[str, list[str]] = {p: [] for p in BODIES}
    started = {p: threading.Event() for p in BODIES}
    failures: list[BaseException] = []

    def stream(path: str) -> None:
        try:
            body = BODIES[path]("tiny", True)
            with httpx.stream("POST", url + path, json=body, headers=HEADERS, timeout=60) as r:
                assert r.status_code == 200
                for chunk in r.iter_text():
                    texts[path].append(chunk)
                    if "delta" in chunk:
                        started[path].set()
        except httpx.HTTPError:
            pass  # a truncated stream shows in the text check below
        except BaseException as e:  # pragma: no cover - reported below
            failures.append(e)
        finally:
            started[path].set()

    json_answer: list[httpx.Response | BaseException] = []

    def non_streamed() -> None:
        try:
            # Greedy: this random model then never samples its end token early.
            body = BODIES["/v1/chat/completions"]("tiny", False) | {"temperature": 0}
            json_answer.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
        except BaseException as e:
            json_answer.append(e)

    # The non-streamed request runs beside the streams (if it finishes before the
    # signal, that is fine too).
    threads = [threading.Thread(target=non_streamed, daemon=True)]
    threads += [threading.Thread(target=stream, args=(p,), daemon=True) for p in BODIES]
    for t in threads:
        t.start()
    for p, ev in started.items():
        assert ev.wait(60), f"{p} never started streaming"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(GRACE + SLACK)
    assert not any(t.is_alive() for t in threads), "a stream was still open after the grace period"
    code = proc.wait(GRACE + SLACK)
    elapsed = time.monotonic() - t0
    log = server["log"].read_text()
    assert not failures, failures
    states = {p: final_state(p, "".join(t)) for p, t in texts.items()}
    assert "truncated" not in states.values(), (
        states,
        {p: "".join(t)[-300:] for p, t in texts.items()},
        log[-2000:],
    )
    assert code == 0, (code, log[-2000:])
    assert elapsed < GRACE + SLACK, elapsed
    # The non-streamed request got a whole answer or a 500 in its envelope, not a cut socket.
    (answer,) = json_answer
    assert isinstance(answer, httpx.Response), answer
    if answer.status_code != 200:
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    # The streams that were cut say so in their dialect's error shape.
    for p, state in states.items():
        if state != "error":
            continue
        datas = [ln[5:].strip() for ln in "".join(texts[p]).splitlines() if ln.startswith("data:")]
        last = json.loads(datas[-1])
        if p == "/v1/messages":
            assert last["type"] == "error" and last["error"]["type"] == "api_error", last
        elif p == "/v1/chat/completions":
            assert last["error"]["type"] == "server_error", last
        else:
            assert last["type"] in ("response.failed", "error"), last
