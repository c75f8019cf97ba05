"""Text core throughput: StopScanner + OutputParser via the Python API vs plain Python.

Feeds model-like text (reasoning blocks, prose, markdown, code with ``<``,
tool calls, end-of-turn markers) in token-sized chunks of 3 to 6 characters
through:

- ``rust 2 calls``: ``StopScanner.push`` then ``OutputParser.push`` per chunk;
- ``rust pipeline``: ``TextPipeline.push`` per chunk (what the engine calls);
- ``python``: a plain-Python implementation of the same semantics (below).

All three must produce the same segments; the script checks that first.

Usage::

    .venv/bin/python bench/bench_text.py            # 10 MB (CAIRN_BENCH_TEXT_MB)
    CAIRN_BENCH_TEXT_MB=2 .venv/bin/python bench/bench_text.py
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import time
from collections.abc import Callable
from typing import Any

import mlx_cairn  # noqa: F401  (loads the extension's package first)
from mlx_cairn.text import OutputParser, StopScanner, TextPipeline

STOPS = ["\n\nUser:", "###END###", "Observation:", "<|endoftext|>STOP"]
MARKERS = [
    "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|end_of_text|>", "<|begin_of_text|>",
    "<|eot_id|>", "<|eom_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|end|>",
    "<end_of_turn>", "<start_of_turn>",
]  # fmt: skip
_PROSE = (
    "the model reads a prompt and writes tokens one at a time while the server "
    "streams them to the client and checks each chunk for stop sequences tool "
    "calls and reasoning blocks so that nothing leaks café naïve 東京 🙂"
)
WORDS = _PROSE.split()

Segment = tuple[str, str, str]  # (kind, text or name, arguments)


# ----------------------------------------------------------------- input text


def model_text(n_bytes: int, seed: int = 0) -> str:
    """Deterministic model-like output of about ``n_bytes`` UTF-8 bytes."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    while size < n_bytes:
        turn = [f"<think>\n{words(rng.randint(20, 80))}.\n</think>\n\n"]
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.15:
                turn.append(f"## {words(3).title()}\n\n")
            elif kind < 0.3:
                turn.append(f"```python\nif a < b and b <= c:\n    print(a # {words(2)})\n```\n\n")
            elif kind < 0.4:
                turn.append(f"Use <b>{words(2)}</b> or <i>{words(1)}</i> tags.\n\n")
            else:
                turn.append(f"{words(rng.randint(15, 60)).capitalize()}.\n\n")
        if rng.random() < 0.3:
            args = {"query": words(3), "limit": rng.randint(1, 50), "tags": [words(1)]}
            call = json.dumps({"name": "search", "arguments": args}, ensure_ascii=False)
            turn.append(f"<tool_call>\n{call}\n</tool_call>")
        turn.append("<|im_end|>")
        s = "".join(turn)
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def token_chunks(text: str, seed: int = 1) -> list[str]:
    """Cuts ``text`` into chunks of 3 to 6 characters."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(3, 6)
        out.append(text[i : i + n])
        i += n
    return out


# ------------------------------------------------ plain-Python implementation


class PyStopScanner:
    """Earliest-completing stop wins (ties by list order); holds back stop prefixes."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""
        self.done = False

    def push(self, text: str) -> tuple[str, str | None]:
        if self.done:
            return "", None
        buf = self.held + text
        best: tuple[int, int, int] | None = None
        for i, s in enumerate(self.stops):
            j = buf.find(s)
            if j >= 0 and (best is None or j + len(s) < best[0]):
                best = (j + len(s), i, j)
        if best is not None:
            self.done, self.held = True, ""
            return buf[: best[2]], self.stops[best[1]]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> tuple[str, str | None]:
        out = "" if self.done else self.held
        self.held, self.done = "", False
        return out, None


def _parse_call(body: str) -> Segment | None:
    try:
        v = json.loads(body)
    except ValueError:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not v["name"]:
        return None
    args = v.get("arguments", v.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ("tool_call", v["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":")))


class PyOutputParser:
    """Hermes tool calls, ``<think>`` reasoning, dropped markers, held partial tags."""

    TEXT_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", *MARKERS)
    REASONING_TAGS = ("<think>", "</think>", *MARKERS)
    TOOL_TAGS = ("</tool_call>", *MARKERS)

    def __init__(self) -> None:
        self.mode, self.buf, self.body, self.trim = "text", "", "", False

    def push(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        self._run(self.buf + text, out, final=False)
        return out

    def flush(self) -> list[Segment]:
        out: list[Segment] = []
        self._run(self.buf, out, final=True)
        if self.mode == "tool":
            self._finish_call(out, "")
        self.mode, self.buf, self.body, self.trim = "text", "", "", False
        return out

    def _run(self, s: str, out: list[Segment], final: bool) -> None:
        self.buf = ""
        pos = 0
        while pos < len(s):
            i = s.find("<", pos)
            if i < 0:
                self._content(s[pos:], out)
                return
            if i > pos:
                self._content(s[pos:i], out)
            tags = self.TEXT_TAGS if self.mode == "text" else (
                self.REASONING_TAGS if self.mode == "reasoning" else self.TOOL_TAGS
            )  # fmt: skip
            for t in tags:
                if s.startswith(t, i):
                    self._tag(t, out)
                    pos = i + len(t)
                    break
            else:
                rest = s[i:]
                if not final and any(len(rest) < len(t) and t.startswith(rest) for t in tags):
                    self.buf = rest
                    return
                self._content("<", out)
                pos = i + 1

    def _content(self, s: str, out: list[Segment]) -> None:
        if self.mode == "tool":
            self.body += s
            return
        if self.mode == "text" and self.trim:
            s = s.lstrip(" \t\n\r\f\v")
            if not s:
                return
            self.trim = False
        out.append((self.mode, s, ""))

    def _tag(self, t: str, out: list[Segment]) -> None:
        if t in MARKERS:
            return
        if self.mode == "text" and t == "<think>":
            self.mode = "reasoning"
        elif self.mode == "text" and t == "<tool_call>":
            self.mode, self.body = "tool", ""
        elif self.mode == "reasoning" and t == "</think>":
            self.mode, self.trim = "text", True
        elif self.mode == "tool" and t == "</tool_call>":
            self._finish_call(out, t)

    def _finish_call(self, out: list[Segment], close: str) -> None:
        call = _parse_call(self.body)
        self.mode = "text"
        if call is None:
            self.trim = False
            out.append(("text", f"<tool_call>{self.body}{close}", ""))
        else:
            self.trim = True
            out.append(call)


# --------------------------------------------------------------------- runs


def coalesce(segs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segs:
        if out and s[0] != "tool_call" and out[-1][0] == s[0]:
            out[-1] = (s[0], out[-1][1] + s[1], "")
        elif s[0] == "tool_call" or s[1]:
            out.append(s)
    return out


def as_tuples(segs: list[Any]) -> list[Segment]:
    """Rust Segments in the plain-Python shape (outside the timed region)."""
    if segs and isinstance(segs[0], tuple):
        return segs
    return [(s.kind, s.name or s.text, s.arguments or "") for s in segs]


# Each run returns the segments with keep=True (to compare them) and only
# counts them otherwise, as a server that sends each one on would.


def scan_then_parse(scan: Any, parse: Any, chunks: list[str], keep: bool) -> list[Any] | int:
    """Feed each chunk through a stop scanner, then its visible text through a parser."""
    segs, n = [], 0
    for c in chunks:
        vis, _stop = scan.push(c)
        got = parse.push(vis)
        n += len(got)
        if keep:
            segs += got
    got = parse.push(scan.flush()[0]) + parse.flush()
    return segs + got if keep else n + len(got)


def run_rust(chunks: list[str], keep: bool = False) -> list[Any] | int:
    scan, parse = StopScanner(STOPS), OutputParser(family="hermes", reasoning=True)
    return scan_then_parse(scan, parse, chunks, keep)


def run_pipeline(chunks: list[str], keep: bool = False) -> list[Any] | int:
    pipe = TextPipeline(STOPS, family="hermes", reasoning=True)
    segs, n = [], 0
    for c in chunks:
        got, _stop = pipe.push(c)
        n += len(got)
        if keep:
            segs += got
    got = pipe.flush()
    return segs + got if keep else n + len(got)


def run_python(chunks: list[str], keep: bool = False) -> list[Any] | int:
    return scan_then_parse(PyStopScanner(STOPS), PyOutputParser(), chunks, keep)


def timed(fn: Callable[[list[str]], Any], chunks: list[str]) -> tuple[float, int]:
    """CPU seconds of this process (the machine is shared; wall time is not ours)."""
    gc.collect()
    t0 = time.process_time()
    n = fn(chunks)
    return time.process_time() - t0, n


def main() -> None:
    mb = float(os.environ.get("CAIRN_BENCH_TEXT_MB", "10"))
    text = model_text(int(mb * 1_000_000))
    chunks = token_chunks(text)
    n_bytes = len(text.encode())

    # Same semantics first: all three agree on a 200 kB slice.
    head = token_chunks(model_text(200_000, seed=7))
    want = coalesce(run_python(head, keep=True))  # type: ignore[arg-type]
    for fn in (run_rust, run_pipeline):
        assert coalesce(as_tuples(fn(head, keep=True))) == want, f"{fn.__name__} differs"  # type: ignore[arg-type]
    assert any(s[0] == "tool_call" for s in want) and any(s[0] == "reasoning" for s in want)

    print(f"text: {n_bytes / 1e6:.1f} MB, {len(chunks):,} chunks of 3-6 chars, {len(STOPS)} stops")
    print(f"python {platform.python_version()}, {platform.machine()}; times are process CPU time")
    rows = []
    for name, fn in (
        ("rust 2 calls", run_rust),
        ("rust pipeline", run_pipeline),
        ("python", run_python),
    ):
        secs, nseg = timed(fn, chunks)
        rows.append((name, secs, nseg))
    py_secs = rows[-1][1]
    print(f"{'impl':<14} {'MB/s':>8} {'us/chunk':>9} {'vs python':>10}")
    for name, secs, _nseg in rows:
        print(
            f"{name:<14} {n_bytes / 1e6 / secs:8.1f} {secs / len(chunks) * 1e6:9.3f} "
            f"{py_secs / secs:9.1f}x"
        )


if __name__ == "__main__":
    main()
