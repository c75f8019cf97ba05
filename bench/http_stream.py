"""A lean streaming HTTP client for the serving benchmarks (one request per connection).

httpx and the SDKs cost the client far more CPU per token than the server
spends: on a 2-core machine that CPU comes out of the server under test. This
client writes one HTTP/1.1 request on a raw asyncio connection, undoes chunked
transfer coding when the server uses it (uvicorn does, ``mlx_lm.server`` writes
the body raw and closes), and records the arrival time of every SSE ``data:``
line that carries generated text::

    r = await stream_request("127.0.0.1", 8000, "/v1/chat/completions", body, headers)
    r.ttft_s, r.tokens, r.gaps_s                       # first text, count, inter-token gaps

``tokens`` counts text deltas (one per generated token on both servers) unless
the stream ends with an OpenAI ``usage`` chunk or an Anthropic
``message_delta``, whose ``output_tokens`` figure is used instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

#: A data line that carries generated text: an OpenAI chat delta with non-empty
#: content (compact or Python-spaced JSON), an Anthropic text delta, a Responses one.
_TEXT = re.compile(rb'"content": ?"[^"]|"text_delta"|"output_text\.delta"')


#: Story subjects the serving benchmarks write about ("Write a long story about ...").
TOPICS = [
    "a lighthouse keeper", "a cat who learns to sail", "the history of bread", "a robot gardener",
    "mountain weather", "a lost library", "the first winter on Mars", "a jazz trio",
    "a detective in Lisbon", "volcanoes", "a dragon who hates gold", "bees in the city",
    "a time-travelling chef", "the deep sea", "a chess prodigy", "northern lights",
]  # fmt: skip


def greedy_chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy Chat Completions body that reports usage at the end."""
    return {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
        "messages": messages,
    }


@dataclass
class StreamResult:
    status: int = 0
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    deltas: int = 0
    usage_tokens: int | None = None
    #: From an OpenAI ``usage`` chunk: prompt tokens and those read from cache.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None
    #: With ``keep_text``, the OpenAI chat content deltas in order (an agent
    #: benchmark sends the answer back in the next turn).
    keep_text: bool = False
    text: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.deltas

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def gaps_s(self) -> list[float]:
        a = self.arrivals
        return [a[i + 1] - a[i] for i in range(len(a) - 1)]


async def stream_request(
    host: str,
    port: int,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
    keep_text: bool = False,
) -> StreamResult:
    """POST ``body`` and read the SSE answer to its end (see the module doc)."""
    res = StreamResult(t_start=time.perf_counter(), keep_text=keep_text)
    payload = json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        f"host: {host}:{port}",
        "content-type: application/json",
        "accept: text/event-stream",
        f"content-length: {len(payload)}",
        "connection: close",
    ]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await asyncio.wait_for(_read(reader, res), timeout)
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
        res.t_end = time.perf_counter()
    return res


async def _read(reader: asyncio.StreamReader, res: StreamResult) -> None:
    status_line = await reader.readline()
    res.status = int(status_line.split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
    buf = b""
    while True:
        if chunked:
            size_line = await reader.readline()
            if not size_line:
                break
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            data = data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
        now = time.perf_counter()
        buf += data
        *lines, buf = buf.split(b"\n")
        for ln in lines:
            if ln.startswith(b"data:"):
                _on_data(ln, now, res)
    if res.status != 200 and res.error is None:
        res.error = f"HTTP {res.status}"


def _on_data(line: bytes, now: float, res: StreamResult) -> None:
    if _TEXT.search(line):
        res.deltas += 1
        res.arrivals.append(now)
        if res.keep_text:
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                res.text.append(json.loads(line[5:])["choices"][0]["delta"]["content"] or "")
        if res.t_first is None:
            res.t_first = now
    elif b'"usage"' in line and (b"completion_tokens" in line or b"output_tokens" in line):
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return
        usage = obj.get("usage") or {}
        n = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(n, int) and n > 0:
            res.usage_tokens = n
        if isinstance(usage.get("prompt_tokens"), int):
            res.prompt_tokens = usage["prompt_tokens"]
            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]
