"""A recording HTTP proxy between the Claude Code CLI and ``cairn serve``.

The CLI's ``ANTHROPIC_BASE_URL`` points here; every request is forwarded to
the server (less ``accept-encoding``) and streamed back unchanged, and one :class:`Exchange`
is kept per request: method, path with query, headers (credentials
redacted), a summary of the JSON body, the status, and from the answer the
stop reason, the usage and the error, if any. It is also the CLI's
``HTTPS_PROXY`` / ``HTTP_PROXY``: a request for any other host (a CONNECT, or
an absolute URL) is recorded as ``outside`` and refused with 403, so the
harness both sees and blocks traffic that would leave the machine.

Example::

    rec = Recorder(upstream_port=8080)
    rec.start()                      # rec.port: where the CLI should connect
    ...
    rec.stop()
    print(summarize(rec.exchanges))
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

#: Request headers whose values are secrets.
_SECRET = {"x-api-key", "authorization", "proxy-authorization", "cookie"}
#: Hop-by-hop headers a proxy must not forward.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
}
#: Not forwarded, so that answers arrive uncompressed and can be read.
_DROP = {"accept-encoding"}
#: How much of an answer is kept for parsing (streams are passed through whole).
_KEEP_BYTES = 4 << 20


@dataclass
class Exchange:
    """One request the CLI sent and what it got back."""

    label: str
    method: str
    path: str
    headers: dict[str, str]
    body_bytes: int
    body: dict[str, Any] | None
    status: int = 0
    outside: bool = False
    seconds: float = 0.0
    answer: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """The proxy; ``label`` is copied into each new exchange (set it per CLI run)."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.label = ""
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, ex: Exchange) -> None:
        with self._lock:
            self.exchanges.append(ex)

    def of(self, label: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.label == label]


def _handler(rec: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_CONNECT(self) -> None:
            self._refuse(self.path)

        def _refuse(self, target: str) -> None:
            rec.add(
                Exchange(rec.label, self.command, target, _redact(self.headers), 0, None, 403, True)
            )
            self.send_response(403)
            self.send_header("content-length", "0")
            self.send_header("connection", "close")
            self.end_headers()
            self.close_connection = True

        def _read_body(self) -> bytes:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("content-length") or 0)
            return self.rfile.read(n) if n else b""

        def _forward(self) -> None:
            path = self.path
            if not path.startswith("/"):  # absolute form: the CLI used us as its proxy
                url = urlsplit(path)
                if (url.hostname, url.port) != ("127.0.0.1", rec.port):
                    self._refuse(path)
                    return
                path = url.path + (f"?{url.query}" if url.query else "")
            body = self._read_body()
            ex = Exchange(
                rec.label, self.command, path, _redact(self.headers), len(body), _json(body)
            )
            start = time.monotonic()
            up = http.client.HTTPConnection(*rec.upstream, timeout=3600)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP | _DROP}
                headers["content-length"] = str(len(body))
                up.request(self.command, path, body=body or None, headers=headers)
                resp = up.getresponse()
                ex.status = resp.status
                self.send_response_only(resp.status, resp.reason)
                length = resp.getheader("content-length")
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                chunked = length is None and self.command != "HEAD"
                if chunked:
                    self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                kept = bytearray()
                while self.command != "HEAD":
                    data = resp.read1(65536)
                    if not data:
                        break
                    if len(kept) < _KEEP_BYTES:
                        kept += data
                    if chunked:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    else:
                        self.wfile.write(data)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                ex.answer = _answer(bytes(kept), resp.getheader("content-type") or "")
            except (OSError, http.client.HTTPException) as e:
                ex.answer = {"proxy_error": repr(e)}
                self.close_connection = True
            finally:
                up.close()
                ex.seconds = time.monotonic() - start
                rec.add(ex)

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _forward

    return Handler


def _redact(headers: Any) -> dict[str, str]:
    out = {}
    for k, v in headers.items():
        key = k.lower()
        if key in _SECRET:
            scheme = v.split(" ", 1)[0] if key == "authorization" and " " in v else ""
            v = f"{scheme} <redacted>".strip()
        out[key] = v
    return out


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _answer(raw: bytes, content_type: str) -> dict[str, Any]:
    """Stop reason, usage, text and error from a JSON answer or an SSE stream."""
    if "text/event-stream" not in content_type:
        body = _json(raw) or {}
        out: dict[str, Any] = {}
        if "error" in body:
            out["error"] = body["error"]
        for key in ("stop_reason", "usage", "input_tokens"):
            if key in body:
                out[key] = body[key]
        text = [b.get("text", "") for b in body.get("content") or [] if isinstance(b, dict)]
        if text:
            out["text"] = "".join(text)
        return out
    out = {"events": 0, "text": ""}
    usage: dict[str, Any] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith(":") and "x-session-cache" in line:
            out["cache_comment"] = line[1:].strip()
        if not line.startswith("data:"):
            continue
        data = _json(line[5:].strip().encode()) or {}
        out["events"] += 1
        kind = data.get("type")
        if kind == "message_start":
            usage.update(data.get("message", {}).get("usage") or {})
        elif kind == "message_delta":
            usage.update(data.get("usage") or {})
            out["stop_reason"] = (data.get("delta") or {}).get("stop_reason")
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            out["text"] += delta.get("text", "")
        elif kind == "error":
            out["error"] = data.get("error")
    if usage:
        out["usage"] = usage
    return out


def prompt_tokens(usage: dict[str, Any]) -> int:
    """The whole prompt: the API splits it into uncached, cache-read and cache-write parts."""
    return sum(
        int(usage.get(k) or 0)
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )


def describe_body(body: dict[str, Any] | None) -> str:
    """One line on what a Messages request asked for."""
    if body is None:
        return "-"
    parts = [f"model={body.get('model')}"]
    for key in ("max_tokens", "stream", "temperature", "tool_choice"):
        if key in body:
            parts.append(f"{key}={json.dumps(body[key])}")
    for key in ("thinking", "output_config", "context_management"):
        if key in body:
            parts.append(f"{key}={json.dumps(body[key], separators=(',', ':'))[:120]}")
    msgs = body.get("messages") or []
    roles = [m.get("role", "?") for m in msgs if isinstance(m, dict)]
    parts.append(f"roles={','.join(r[0] for r in roles)}")
    if "system" in roles:
        parts.append(f"system_turns={roles.count('system')}")
    system = body.get("system")
    if isinstance(system, list):
        first = str(system[0].get("text", "")) if system and isinstance(system[0], dict) else ""
        billing = " (1st: billing header)" if first.startswith("x-anthropic-billing") else ""
        parts.append(f"system_blocks={len(system)}{billing}")
    elif isinstance(system, str):
        parts.append(f"system=str[{len(system)}]")
    parts.append(f"tools={len(body.get('tools') or [])}")
    extra = sorted(
        set(body)
        - {"model", "messages", "system", "tools", "max_tokens", "stream", "temperature"}
        - {"tool_choice", "thinking", "output_config", "context_management"}
    )
    if extra:
        parts.append(f"other={','.join(extra)}")
    return " ".join(parts)


def describe_answer(ans: dict[str, Any]) -> str:
    """One line on what the server answered."""
    if "proxy_error" in ans:
        return ans["proxy_error"]
    parts = []
    if "error" in ans:
        err = ans["error"]
        parts.append(f"error={err.get('type')}: {str(err.get('message'))[:160]}")
    if ans.get("stop_reason"):
        parts.append(f"stop={ans['stop_reason']}")
    usage = ans.get("usage") or {}
    if usage:
        keys = ("input_tokens", "cache_read_input_tokens", "output_tokens")
        parts.append(
            " ".join(
                f"{k.split('_')[0]}{'_read' if 'read' in k else ''}={usage.get(k)}" for k in keys
            )
        )
    if ans.get("text"):
        parts.append(f"text={ans['text'][:60]!r}")
    return " ".join(parts) or "-"


def summarize(exchanges: list[Exchange]) -> str:
    """The request log as text: one block per request, then counts."""
    lines = []
    for i, ex in enumerate(exchanges, 1):
        where = "OUTSIDE " if ex.outside else ""
        lines.append(
            f"{i:3d} [{ex.label}] {where}{ex.method} {ex.path} -> {ex.status} "
            f"({ex.body_bytes} B, {ex.seconds:.2f}s)"
        )
        h = ex.headers
        auth = "x-api-key" if "x-api-key" in h else h.get("authorization", "none")
        shown = [f"auth={auth}"]
        for key in ("anthropic-version", "anthropic-beta", "user-agent", "x-app"):
            if key in h:
                shown.append(f"{key}={h[key]}")
        others = sorted(
            k
            for k in h
            if k not in {"x-api-key", "authorization", "anthropic-version", "anthropic-beta"}
            and k not in {"user-agent", "x-app", "host", "content-length", "content-type"}
            and k not in {"accept", "accept-encoding", "connection"}
        )
        if others:
            shown.append(f"other headers: {', '.join(others)}")
        lines.append("      " + " | ".join(shown))
        if ex.body is not None:
            lines.append("      sent: " + describe_body(ex.body))
        lines.append("      got:  " + describe_answer(ex.answer))
    counts: dict[str, int] = {}
    for ex in exchanges:
        key = f"{ex.method} {ex.path} {ex.status}"
        counts[key] = counts.get(key, 0) + 1
    lines.append("totals: " + "; ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
    return "\n".join(lines)
