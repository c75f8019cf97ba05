"""Connections that misbehave: slow or partial heads and bodies, over-limit lengths,
half-closes, disconnects mid-body, and a forged ``Host`` on a trailing-slash path.

A real uvicorn server (tests/live_server.py, the protocol ``cairn serve`` runs)
with short read timeouts, spoken to over raw sockets so that every byte and
every close is the test's choice. Waits are functional: a socket read with a
generous timeout returns as soon as the server acts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from live_server import Blocker, read_all, registry_for, serve, settle_cancel, wait_until
from mlx_cairn.api import ServerConfig
from mlx_cairn.api.connection import CairnH11Protocol
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest
from scripted_model import say, scripted_model

pytestmark = pytest.mark.timeout(120)

#: Short, so a test waits about this long for the server to act on a stall.
HEADER_TIMEOUT = 0.5
BODY_TIMEOUT = 1.0
LIMIT = 64 * 1024
#: How long a socket read waits for the server: far above every timeout above.
READ_WAIT = 20.0
ANTHROPIC = b"anthropic-version: 2023-06-01\r\n"


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    engine = Engine(scripted_model(), EngineConfig(num_blocks=256, block_size=16))
    blocker = Blocker()
    engine._fault_hook = blocker
    config = ServerConfig(
        max_body_bytes=LIMIT, header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT
    )
    with serve(registry_for({"scripted": engine}), config) as srv:
        yield {
            "port": srv.port,
            "engine": engine,
            "blocker": blocker,
            "connections": srv.server.server_state.connections,  # uvicorn's protocols
        }
    engine.close()


def connect(env: dict[str, Any]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", env["port"]), timeout=READ_WAIT)
    return s


def head(method: str, path: str, *lines: bytes, length: int | None = None) -> bytes:
    out = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode()
    for line in lines:
        out += line.rstrip(b"\r\n") + b"\r\n"
    if length is not None:
        out += b"content-type: application/json\r\ncontent-length: %d\r\n" % length
    return out + b"\r\n"


def request(method: str, path: str, body: Any = None, *lines: bytes) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    return head(method, path, *lines, length=len(data) if body is not None else None) + data


def informational(raw: bytes) -> tuple[list[int], bytes]:
    """The statuses of the 1xx answers at the start of ``raw``, and what follows them."""
    seen = []
    while raw.startswith(b"HTTP/1.1 1"):
        top, _, raw = raw.partition(b"\r\n\r\n")
        seen.append(int(top.split()[1]))
    return seen, raw


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and (de-chunked) body of the first final response in ``raw``
    (1xx answers before it are skipped, as clients do)."""
    _, raw = informational(raw)
    top, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
        return int(status_line.split()[1]), headers, body
    n = int(headers.get("content-length", len(rest)))
    return int(status_line.split()[1]), headers, rest[:n]


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": say(text)}],
        **kw,
    }


# ------------------------------------------------------------------ heads


def test_a_connection_that_sends_nothing_is_closed(env):
    socks = [connect(env) for _ in range(50)]
    try:
        for s in socks:
            assert read_all(s) == b""  # closed by the server, nothing sent
    finally:
        for s in socks:
            s.close()


def test_half_a_head_gets_408_and_a_close(env):
    with connect(env) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-ty")
        raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 408 "), raw
    assert parse(raw)[1]["connection"] == "close"


def test_a_head_dripped_byte_by_byte_is_still_cut_at_the_deadline(env):
    # Progress does not extend the head deadline: it runs from the connection's start.
    data = head("GET", "/health", *[b"x-filler-%d: %s" % (i, b"y" * 40) for i in range(200)])
    sent = 0
    with connect(env) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in data:
                s.send(bytes([byte]))
                sent += 1
                time.sleep(0.01)
        raw = read_all(s)
    assert sent < len(data), "the whole dripped head was accepted"
    assert raw == b"" or raw.startswith(b"HTTP/1.1 408 "), raw


def test_the_head_deadline_restarts_for_each_request_on_a_keep_alive_connection(env):
    with connect(env) as s:
        for _ in range(6):  # the connection outlives HEADER_TIMEOUT: each head starts anew
            s.sendall(request("GET", "/health"))
            buf = b""
            while b'"models"' not in buf:
                chunk = s.recv(65536)
                assert chunk, f"closed after {buf!r}"
                buf += chunk
            assert buf.startswith(b"HTTP/1.1 200 ")
            time.sleep(HEADER_TIMEOUT / 4)


# ------------------------------------------------------------------ bodies


def test_a_stalled_body_gets_408_in_the_dialect_envelope(env):
    with connect(env) as s:
        s.sendall(head("POST", "/v1/messages", ANTHROPIC, length=1000) + b'{"model": ')
        raw = read_all(s)
    status, headers, body = parse(raw)
    assert status == 408, raw
    assert headers["connection"] == "close"
    err = json.loads(body)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert "no progress" in err["error"]["message"]


def test_a_slow_body_that_keeps_progressing_is_served(env):
    data = json.dumps(chat("slow but steady")).encode()
    with connect(env) as s:
        s.sendall(head("POST", "/v1/messages", ANTHROPIC, length=len(data)))
        for i in range(0, len(data), 8):
            s.sendall(data[i : i + 8])
            time.sleep(BODY_TIMEOUT / 20)
        raw = b""
        while b"slow but steady" not in raw:
            chunk = s.recv(65536)
            assert chunk, raw
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 200 "), raw


def test_a_body_left_unread_after_the_answer_must_keep_moving(env):
    # /health takes no POST: the 405 goes out before any of the body is read, and
    # the connection then waits for the rest of the body only while it progresses.
    with connect(env) as s:
        s.sendall(head("POST", "/health", length=1000) + b"x" * 10)
        raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 405 "), raw


def test_an_over_limit_length_is_refused_before_any_body_byte(env):
    with connect(env) as s:
        s.sendall(head("POST", "/v1/messages", ANTHROPIC, length=33 * 1024 * 1024))
        first = s.recv(65536)  # no body sent: the answer comes anyway
        raw = first + read_all(s)
    status, headers, body = parse(raw)
    assert status == 413 and headers["connection"] == "close", raw
    assert json.loads(body)["error"]["type"] == "request_too_large"


def test_expect_100_continue_over_the_limit_gets_413_and_no_100(env):
    with connect(env) as s:
        s.sendall(
            head("POST", "/v1/messages", ANTHROPIC, b"expect: 100-continue", length=LIMIT + 1)
        )
        raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 413 "), raw
    assert b"100 Continue" not in raw


def test_expect_100_continue_within_the_limit_still_gets_its_100(env):
    data = json.dumps(chat("continued")).encode()
    with connect(env) as s:
        s.sendall(
            head("POST", "/v1/messages", ANTHROPIC, b"expect: 100-continue", length=len(data))
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 100 ")
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        raw = read_all(s)
    status, _, body = parse(raw)
    assert status == 200 and json.loads(body)["content"][0]["text"] == "continued"


def test_an_over_limit_body_sent_in_full_still_reads_its_413(env):
    # The answer goes out at once; the body on its way is drained, not reset.
    data = b"x" * (4 * LIMIT)
    with connect(env) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head("POST", "/v1/chat/completions", length=len(data)) + data)
        raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 413 "), raw


# -------------------------------------------------------------- half-close

HALF_CLOSED = [
    ("GET", "/health", None, b'"status":"ok"'),
    ("GET", "/v1/models", None, b'"scripted"'),
    ("POST", "/v1/messages/count_tokens", chat("count me"), b'"input_tokens"'),
    ("POST", "/v1/messages", chat("answered after a half-close"), b"after a half-close"),
    (
        "POST",
        "/v1/messages",
        chat("streamed after a half-close", stream=True),
        b"event: message_stop",
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat("openai after a half-close"),
        b"openai after a half-close",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "expect"),
    HALF_CLOSED,
    ids=[f"{m} {p}{' stream' if b and b.get('stream') else ''}" for m, p, b, _ in HALF_CLOSED],
)
def test_a_half_closed_client_gets_its_answer(env, method, path, body, expect):
    with connect(env) as s:
        s.sendall(request(method, path, body, ANTHROPIC))
        s.shutdown(socket.SHUT_WR)  # "that is all I will send"
        raw = read_all(s)  # ... and the server closes once it has answered
    status, _, data = parse(raw)
    assert status == 200, raw[:500]
    assert expect in data, data[:500]


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"], ids=["1.1 connection-close", "1.0"])
def test_a_half_closed_client_that_asked_for_a_close_gets_its_answer(env, version):
    data = json.dumps(chat("closing anyway")).encode()
    raw_request = request("POST", "/v1/messages", None, ANTHROPIC, b"connection: close")
    raw_request = raw_request.replace(b"HTTP/1.1", version, 1).removesuffix(b"\r\n")
    raw_request += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
    with connect(env) as s:
        s.sendall(raw_request + data)
        s.shutdown(socket.SHUT_WR)
        raw = read_all(s)
    status, _, body = parse(raw)
    assert status == 200, raw[:500]
    assert json.loads(body)["content"][0]["text"] == "closing anyway"


def test_a_client_that_closes_before_a_slow_answer_starts_is_let_go(env):
    # A FIN is all the server sees of a client that gave up; the 100 Continue
    # the server then writes draws a reset from its closed socket, and the
    # non-streamed answer that has not started is cancelled (the engine is
    # held mid-generation meanwhile).
    eng, blocker = env["engine"], env["blocker"]
    before = eng.stats().requests_cancelled
    blocker.arm(skip=2)
    with connect(env) as s:
        s.sendall(request("POST", "/v1/messages", chat("z " * 100, max_tokens=300), ANTHROPIC))
        assert blocker.entered.wait(30)
    st = settle_cancel(eng, blocker, before)
    assert st.requests_cancelled == before + 1


def read_until(s: socket.socket, marker: bytes) -> bytes:
    raw = b""
    while marker not in raw:
        chunk = s.recv(65536)
        assert chunk, f"closed before {marker!r}: {raw[:500]!r}"
        raw += chunk
    return raw


def wait_half_closed(env: dict[str, Any], s: socket.socket) -> None:
    """Until the server has read the FIN of ``s`` (functional: its protocol says so)."""
    me = s.getsockname()[:2]
    wait_until(
        lambda: any(
            tuple(c.client or ()) == me and c._half_closed for c in list(env["connections"])
        ),
        "the server never saw the half-close",
    )


def streamed_text(data: bytes) -> str:
    """The answer's text in an SSE body of any of the three dialects."""
    out = []
    for line in data.decode().split("\n"):
        if not line.startswith("data: {"):
            continue
        d = json.loads(line[6:])
        if d.get("type") == "content_block_delta":
            out.append(d["delta"].get("text", ""))
        elif d.get("type") == "response.output_text.delta":
            out.append(d["delta"])
        elif d.get("object") == "chat.completion.chunk" and d["choices"]:
            out.append(d["choices"][0]["delta"].get("content") or "")
    return "".join(out)


LATE = [
    ("/v1/messages", b"event: message_start", b"event: message_stop"),
    # Its first chunk waits for the first token: the SSE head is the start here.
    ("/v1/chat/completions", b"text/event-stream", b"data: [DONE]"),
    ("/v1/responses", b"response.created", b"event: response.completed"),
]


@pytest.mark.parametrize(("path", "started", "finished"), LATE, ids=[p for p, _, _ in LATE])
def test_a_half_close_after_the_stream_started_still_gets_all_of_it(env, path, started, finished):
    # The client's shutdown may reach the server after the answer has started (a
    # quick server, a slow client): it is still a half-close, not a goodbye.
    eng, blocker = env["engine"], env["blocker"]
    body = chat("every word after a late half-close", stream=True)
    if path == "/v1/responses":
        body = {"model": "scripted", "input": body["messages"][0]["content"], "stream": True}
    blocker.arm(skip=1)
    try:
        with connect(env) as s:
            s.sendall(request("POST", path, body, ANTHROPIC))
            raw = read_until(s, started)
            assert blocker.entered.wait(30)  # held mid-answer
            s.shutdown(socket.SHUT_WR)
            wait_half_closed(env, s)
            blocker.release.set()
            raw += read_all(s)
    finally:
        blocker.release.set()
    status, _, data = parse(raw)
    assert status == 200 and finished in data, data[-500:]
    assert streamed_text(data) == "every word after a late half-close"
    assert_at_rest(eng)


def test_a_half_closed_client_waits_out_a_slow_json_answer(env, monkeypatch):
    # Longer than HTTP/1.0's grace: an HTTP/1.1 client that only shut its sending
    # side is told 100 Continue and then gets the answer, however long it takes.
    monkeypatch.setattr(CairnH11Protocol, "half_close_grace", 0.05)
    eng, blocker = env["engine"], env["blocker"]
    before = eng.stats().requests_cancelled
    blocker.arm(skip=2)
    try:
        with connect(env) as s:
            s.sendall(request("POST", "/v1/messages", chat("worth the wait"), ANTHROPIC))
            assert blocker.entered.wait(30)
            s.shutdown(socket.SHUT_WR)
            raw = read_until(s, b"\r\n\r\n")
            assert informational(raw)[0] == [100], raw
            wait_half_closed(env, s)
            time.sleep(0.5)  # well past the (shortened) grace, the engine still held
            blocker.release.set()
            raw += read_all(s)
    finally:
        blocker.release.set()
    status, _, body = parse(raw)
    assert status == 200 and json.loads(body)["content"][0]["text"] == "worth the wait"
    assert assert_at_rest(eng).requests_cancelled == before


def test_a_client_that_closes_mid_stream_is_let_go(env):
    # A FIN after the stream started, from a socket that is closed: the stream's
    # next write (a ping here, the engine is held) draws the reset.
    eng, blocker = env["engine"], env["blocker"]
    before = eng.stats().requests_cancelled
    blocker.arm(skip=1)
    with connect(env) as s:
        s.sendall(
            request(
                "POST", "/v1/messages", chat("z " * 100, stream=True, max_tokens=300), ANTHROPIC
            )
        )
        read_until(s, b"event: message_start")
        assert blocker.entered.wait(30)
    st = settle_cancel(eng, blocker, before)
    assert st.requests_cancelled == before + 1


# -------------------------------------------------------------- disconnects


def test_a_disconnect_mid_body_is_one_debug_line_and_no_500(env, caplog):
    def scrape() -> str:
        with connect(env) as s:
            s.sendall(request("GET", "/metrics", None, b"connection: close"))
            return parse(read_all(s))[2].decode()

    def count(text: str, status: str) -> float:
        """Requests counted with ``status`` (any route)."""
        return sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln.startswith("cairn_http_requests_total") and f'status="{status}"' in ln
        )

    before = scrape()
    caplog.set_level(logging.DEBUG)
    with connect(env) as s:
        s.sendall(head("POST", "/v1/messages", ANTHROPIC, length=5000) + b'{"model": "scr')
        time.sleep(0.05)
    wait_until(
        lambda: any(
            "disconnected while sending its body" in r.getMessage() for r in caplog.records
        ),
        "the disconnect was not logged",
    )
    ours = [r for r in caplog.records if "disconnected while sending its body" in r.getMessage()]
    assert len(ours) == 1 and ours[0].levelno == logging.DEBUG
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]
    after = scrape()
    assert count(after, "499") == count(before, "499") + 1
    assert 'method="POST",route="/v1/messages",status="499"' in after
    assert count(after, "500") == count(before, "500"), after


# ------------------------------------------------------------------ redirects


def test_a_trailing_slash_is_served_not_redirected_to_a_forged_host(env):
    forged = b"host: attacker.example\r\n"
    cases = [
        ("POST", "/v1/messages/", chat("no redirect")),
        ("POST", "/v1/messages/count_tokens/", chat("no redirect")),
        ("GET", "/v1/models/", None),
        ("GET", "/health/", None),
    ]
    for method, path, body in cases:
        data = b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1".encode(), forged.strip(), ANTHROPIC.strip()]
        if body is not None:
            lines += [b"content-type: application/json", b"content-length: %d" % len(data)]
        lines.append(b"connection: close")
        with connect(env) as s:
            s.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + data)
            raw = read_all(s)
        status, headers, _ = parse(raw)
        assert status == 200, (path, raw[:300])
        assert "location" not in headers and b"attacker.example" not in raw, (path, raw[:300])
