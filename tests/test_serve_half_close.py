"""A real ``cairn serve`` process and raw sockets: half-closed clients get their whole
answer, clients that close their socket have their generation cancelled.

A client that has sent its whole request may shut its sending side
(``shutdown(SHUT_WR)``) at once, or only after the answer has started; either
way it still reads, and must get every byte. A client that closes its socket
sends the same FIN: the server tells them apart by the reset a write draws
(see :mod:`mlx_cairn.api.connection`). Each round runs every case at once, so
the FIN meets the answer at varied moments; several rounds shake out a race.

The server runs a tiny random-weight model saved as a Hugging Face folder:
greedy, it never samples its end token early, so each answer is exactly
``max_tokens`` long and the same every time.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from live_server import cairn_serve, wait_until
from mlx_cairn.models.export import save_folder
from mlx_cairn.testing.tiny_models import tiny_model
from test_reliability_connections import informational, parse, read_all, streamed_text

pytestmark = pytest.mark.timeout(300)

ROUNDS = 5
#: Socket reads wait at most this long (a safety cap, far above any answer here).
READ_WAIT = 60.0
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("half-close")
    folder = save_folder(tiny_model("qwen3", seed=0), root / "tiny")
    args = ["--model", str(folder), "--kv-cache-gb", "0.05", "--log-level", "warning"]
    with cairn_serve(args, root / "serve.log") as (url, _):
        yield url


def body(*, stream: bool, max_tokens: int = 24) -> dict[str, Any]:
    """The same request in either dialect (both read these fields)."""
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }


def raw_request(path: str, payload: dict[str, Any], port: int) -> bytes:
    data = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"anthropic-version: 2023-06-01\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def answer_of(path: str, stream: bool, data: bytes) -> str:
    """The answer's text in a JSON or SSE body of either dialect."""
    if stream:
        return streamed_text(data)
    doc = json.loads(data)
    if path == "/v1/messages":
        return "".join(b.get("text", "") for b in doc["content"])
    return str(doc["choices"][0]["message"]["content"])


def finished(path: str, stream: bool, data: bytes) -> bool:
    if not stream:
        return True  # a JSON body that parses is whole
    return (b"event: message_stop" if path == "/v1/messages" else b"data: [DONE]") in data


def half_closed(url: str, path: str, stream: bool, late: bool) -> tuple[int, bytes, list[int]]:
    """Send, shut the sending side (at once, or once the answer has started), read all."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=READ_WAIT) as s:
        s.sendall(raw_request(path, body(stream=stream), port))
        raw = b""
        if late:  # once the SSE head is here, the answer has started
            while b"\r\n\r\n" not in informational(raw)[1]:
                chunk = s.recv(65536)
                assert chunk, raw
                raw += chunk
        s.shutdown(socket.SHUT_WR)
        raw += read_all(s)
    early, _ = informational(raw)
    status, _, data = parse(raw)
    return status, data, early


def closed(url: str, path: str, stream: bool) -> None:
    """Send a long request, then close the socket: once the answer has started for a
    stream, at once for a JSON answer."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=READ_WAIT) as s:
        s.sendall(raw_request(path, body(stream=stream, max_tokens=1800), port))
        if stream:
            raw = b""
            while b"\r\n\r\n" not in raw:
                chunk = s.recv(65536)
                assert chunk, raw
                raw += chunk


def stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/health", timeout=10).json()["models"][0]["stats"])


CASES = [
    (path, stream, late)
    for path in ("/v1/messages", "/v1/chat/completions")
    for stream, late in ((False, False), (True, False), (True, True))
]


def test_half_closed_clients_get_every_answer_and_closed_ones_are_cancelled(server: str) -> None:
    # The answers a well-behaved client gets (greedy: the same every time).
    expected = {}
    for path in ("/v1/messages", "/v1/chat/completions"):
        r = httpx.post(server + path, json=body(stream=False), headers=ANTHROPIC, timeout=60)
        assert r.status_code == 200, r.text
        expected[path] = answer_of(path, False, r.content)
        assert expected[path]
    before = stats(server)
    closes = 0
    with ThreadPoolExecutor(len(CASES) + 2) as pool:
        for _ in range(ROUNDS):
            runs: list[tuple[tuple[str, bool, bool], Any]] = [
                (case, pool.submit(half_closed, server, *case)) for case in CASES
            ]
            gone = [
                pool.submit(closed, server, "/v1/messages", True),
                pool.submit(closed, server, "/v1/chat/completions", False),
            ]
            closes += len(gone)
            for (path, stream, late), fut in runs:
                status, data, early = fut.result()
                case = f"{path} stream={stream} late={late}"
                assert status == 200, (case, data[:300])
                assert finished(path, stream, data), (case, data[-300:])
                assert answer_of(path, stream, data) == expected[path], case
                # A JSON answer not started at the FIN is preceded by one 100 Continue.
                assert early in ([], [100]), (case, early)
            for fut in gone:
                fut.result()
    wait_until(
        lambda: stats(server)["requests_cancelled"] == before["requests_cancelled"] + closes,
        f"not every closed client's generation was cancelled: {stats(server)}",
        timeout=120,
    )
    after = stats(server)
    assert after["requests_failed"] == before["requests_failed"]
    assert after["running"] == after["waiting"] == 0
    # Every half-closed request ran to its end.
    assert after["requests_completed"] == before["requests_completed"] + ROUNDS * len(CASES)
    # And it keeps serving as before.
    path = "/v1/messages"
    r = httpx.post(server + path, json=body(stream=False), headers=ANTHROPIC, timeout=60)
    assert r.status_code == 200 and answer_of(path, False, r.content) == expected[path]
