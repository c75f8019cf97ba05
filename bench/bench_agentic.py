"""An agent's workload, side by side: ``cairn serve`` vs ``mlx_lm.server`` on the same weights (issue 35).

Coding agents run several sessions at once; every turn of every session
re-sends one long shared prefix (system prompt + tool definitions) plus the
session's growing history of answers and tool results. This benchmark plays
that workload against both servers over HTTP:

- the prefix comes from the redacted Claude Code fixtures
  (``../shared/fixtures/claude-code/cc-2.1.332-system-turn-21-tools.json``):
  its system blocks (the rotating billing header left out) and its tool
  definitions rendered as text under ``# Tools``, cut to ``--prefix-tokens``
  tokens, so both servers see the same prompt (``mlx_lm.server`` renders no
  tools of its own); a round tag leads it, so each round starts cold;
- ``--sessions`` sessions start together; each runs ``--turns`` turns in
  order. Turn 1 is the prefix and the session's own first message; every later
  turn re-sends everything before it, the model's answer (streamed back to
  the client) and a new user message (a tool result). Each user message is
  about ``--turn-tokens`` tokens of the fixtures' message text, taken at an
  offset of its own, so sessions diverge right after the prefix;
- answers are ``--answer-tokens`` tokens at most, greedy, streamed (OpenAI
  chat, ``stream_options.include_usage``);
- rounds alternate the order of the sides (ours, peer; then peer, ours) so
  the machine's drift hits both alike. Both servers are started once: the
  embedded SmolLM2-135M dequantized to fp32, exported to an HF folder for
  ``mlx_lm.server`` the way ``bench/bench_http.py`` does (OpenBLAS loaded
  first on both sides; ``CAIRN_DECODE_GEMM=0`` on the peer).

It reports per side: total time of a round (first request to last byte),
TTFT p50 / p95 by turn, output tokens/s (all answers' tokens over the total
time), decode tokens/s per stream (tokens after the first over the time since
the first), and prompt tokens computed vs cached (each answer's ``usage``:
``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``, which both
servers fill; for ours also the engine's ``prefill_tokens`` counter from
``/health``).

Run (4 sessions x 4 turns, 3,000-token prefix: about 15 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_agentic.py
    .venv/bin/python bench/bench_agentic.py --sessions 8 --turns 8 --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import httpx

from bench_http import start_mlx_lm, start_ours, wait_up  # bench/ is on sys.path
from http_stream import StreamResult, greedy_chat_body, pct, stream_request
from serve_proc import free_port

FIXTURES = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "claude-code"
CHAT = "/v1/chat/completions"


# ----------------------------------------------------------------- prompts


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    for block in content or []:
        if isinstance(block, dict):
            if isinstance(block.get("text"), str):
                out.append(block["text"])
            elif "content" in block:
                out.extend(_texts(block["content"]))
    return out


def fixture_prefix(fixtures: Path) -> str:
    """The system blocks and the tools as text, from the 21-tool first turn."""
    body = json.loads((fixtures / "cc-2.1.332-system-turn-21-tools.json").read_text())
    system = [b["text"] for b in body["system"] if not b["text"].startswith("x-anthropic-billing")]
    tools = [
        json.dumps(
            {"name": t["name"], "description": t.get("description", ""),
             "input_schema": t.get("input_schema", {})},
            ensure_ascii=False,
        )
        for t in body["tools"]
    ]  # fmt: skip
    return "\n\n".join(system) + "\n\n# Tools\n\nYou may call these tools:\n\n" + "\n".join(tools)


def fixture_corpus(fixtures: Path) -> str:
    """The message text of the fixtures' conversations (user turns, tool results, answers)."""
    out: list[str] = []
    for name in ("cc-2.1.332-system-turn-21-tools.json", "cc-2.1.332-multi-turn.json"):
        body = json.loads((fixtures / name).read_text())
        for m in body["messages"]:
            out.extend(_texts(m["content"]))
    return "\n".join(t for t in out if len(t) > 40)


class Prompts:
    """Token-exact cuts of the fixtures' text with the served model's tokenizer."""

    def __init__(self, tokenizer: Any, fixtures: Path, prefix_tokens: int) -> None:
        self.tok = tokenizer
        ids = self.tok.encode(fixture_prefix(fixtures))
        if len(ids) < prefix_tokens:
            raise SystemExit(f"the fixtures give only {len(ids)} prefix tokens")
        self.prefix = self.tok.decode(ids[:prefix_tokens])
        self.corpus_ids = self.tok.encode(fixture_corpus(fixtures))

    def message(self, session: int, turn: int, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of message text, at an offset of its own."""
        ids = self.corpus_ids
        start = (session * 7919 + turn * 104729) % max(1, len(ids) - n_tokens)
        head = f"Session {session}, step {turn}: " + (
            "the task.\n" if turn == 0 else "tool result.\n"
        )
        return head + self.tok.decode((ids * 2)[start : start + n_tokens])


# ----------------------------------------------------------------- one round


async def session(
    port: int, model: str, prompts: Prompts, args: argparse.Namespace, s: int, rnd: int
) -> list[dict[str, Any]]:
    system = f"[run {rnd}]\n" + prompts.prefix
    msgs = [{"role": "system", "content": system}]
    out: list[dict[str, Any]] = []
    for t in range(args.turns):
        msgs.append({"role": "user", "content": prompts.message(s, t, args.turn_tokens)})
        r: StreamResult = await stream_request(
            "127.0.0.1",
            port,
            CHAT,
            greedy_chat_body(model, msgs, args.answer_tokens),
            keep_text=True,
            timeout=args.request_timeout,
        )
        if r.error:
            raise RuntimeError(f"session {s} turn {t}: {r.error}")
        msgs.append({"role": "assistant", "content": "".join(r.text)})
        a = r.arrivals
        out.append({
            "session": s, "turn": t, "ttft_s": r.ttft_s, "tokens": r.tokens,
            "decode_tok_s": (len(a) - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else None,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "t_start": r.t_start, "t_end": r.t_end,
        })  # fmt: skip
    return out


def engine_stats(port: int) -> dict[str, Any]:
    h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    return h["models"][0].get("stats", {})  # type: ignore[no-any-return]


async def run_round(
    port: int, model: str, prompts: Prompts, args: argparse.Namespace, rnd: int, ours: bool
) -> dict[str, Any]:
    before = engine_stats(port) if ours else {}
    t0 = time.perf_counter()
    per = await asyncio.gather(
        *(session(port, model, prompts, args, s, rnd) for s in range(args.sessions))
    )
    total = time.perf_counter() - t0
    turns = [x for p in per for x in p]
    res: dict[str, Any] = {"total_s": total, "turns": turns}
    if ours:
        await asyncio.sleep(0.5)  # the stats snapshot follows the engine's last step
        after = engine_stats(port)
        res["engine"] = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("prefill_tokens", "prefix_hit_tokens", "partial_hit_tokens",
                      "prefix_join_waits", "prefill_holds", "preemptions", "generated_tokens")
        }  # fmt: skip
    return res


# ----------------------------------------------------------------- report


def summary(rounds: list[dict[str, Any]], n_turns: int) -> dict[str, Any]:
    turns = [x for r in rounds for x in r["turns"]]
    out_tokens = sum(x["tokens"] for x in turns)
    total = sum(r["total_s"] for r in rounds)
    prompt = sum(x["prompt_tokens"] or 0 for x in turns)
    cached = sum(x["cached_tokens"] or 0 for x in turns)

    def ttft(sel: list[dict[str, Any]]) -> tuple[float, float]:
        v = [1000 * x["ttft_s"] for x in sel if x["ttft_s"] is not None]
        return pct(v, 50), pct(v, 95)

    by_turn = {t + 1: ttft([x for x in turns if x["turn"] == t]) for t in range(n_turns)}
    dec = [x["decode_tok_s"] for x in turns if x["decode_tok_s"]]
    out = {
        "total_s_runs": [round(r["total_s"], 1) for r in rounds],
        "total_s": total / len(rounds),
        "ttft_ms_by_turn": by_turn,
        "ttft_ms_turn1": ttft([x for x in turns if x["turn"] == 0]),
        "ttft_ms_turn2plus": ttft([x for x in turns if x["turn"] > 0]),
        "output_tokens": out_tokens / len(rounds),
        "output_tok_s": out_tokens / total,
        "decode_tok_s_p50": statistics.median(dec) if dec else float("nan"),
        "prompt_tokens": prompt / len(rounds),
        "cached_tokens": cached / len(rounds),
        "computed_tokens": (prompt - cached) / len(rounds),
    }
    if "engine" in rounds[0]:
        out["engine"] = {
            k: sum(r["engine"][k] for r in rounds) / len(rounds) for k in rounds[0]["engine"]
        }
    return out


def fmt(x: float) -> str:
    return "-" if x != x else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _turn_cell(t: int) -> Any:
    return lambda m: f"{fmt(m['ttft_ms_by_turn'][t][0])} / {fmt(m['ttft_ms_by_turn'][t][1])}"


def _turn_ratio(p: dict[str, Any], t: int) -> Any:
    return lambda o: o["ttft_ms_by_turn"][t][0] / p["ttft_ms_by_turn"][t][0]


def markdown(sums: dict[str, dict[str, Any]], n_turns: int, peer: str = "mlx_lm.server") -> str:
    """One column per side, then each of our sides against the peer."""
    p = sums[peer]
    ours = [s for s in sums if s != peer]
    rows = [
        ("total time of a round, s (runs)",
         lambda m: f"**{m['total_s']:.1f}** ({', '.join(str(x) for x in m['total_s_runs'])})",
         lambda o: p["total_s"] / o["total_s"], "x faster"),
        *[
            (f"TTFT p50 / p95, turn {t}, ms",
             _turn_cell(t),
             _turn_ratio(p, t),
             "x (p50)")
            for t in range(1, n_turns + 1)
        ],
        ("TTFT p50 / p95, turns 2+, ms",
         lambda m: f"{fmt(m['ttft_ms_turn2plus'][0])} / {fmt(m['ttft_ms_turn2plus'][1])}",
         lambda o: o["ttft_ms_turn2plus"][0] / p["ttft_ms_turn2plus"][0], "x (p50)"),
        ("output tokens/s (all answers over the total time)",
         lambda m: f"{m['output_tok_s']:.2f} ({m['output_tokens']:.0f} tokens)",
         lambda o: o["output_tok_s"] / p["output_tok_s"], "x"),
        ("decode tokens/s per stream, p50",
         lambda m: f"{m['decode_tok_s_p50']:.2f}",
         lambda o: o["decode_tok_s_p50"] / p["decode_tok_s_p50"], "x"),
        ("prompt tokens computed / cached (per round)",
         lambda m: f"{m['computed_tokens']:,.0f} / {m['cached_tokens']:,.0f}",
         lambda o: o["computed_tokens"] / p["computed_tokens"], "x computed"),
    ]  # fmt: skip
    head = "| measure | " + " | ".join([*ours, peer]) + " | "
    head += " | ".join(f"{s} / peer" for s in ours) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(ours) + 1)]
    for name, f, ratio, unit in rows:
        cells = [f(sums[s]) for s in [*ours, peer]] + [f"{ratio(sums[s]):.2f}{unit}" for s in ours]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for s in ours:
        if "engine" in sums[s]:
            e = sums[s]["engine"]
            lines += ["", f"Engine counters per round, {s} (`/health`): " + ", ".join(
                f"{k} {v:,.0f}" for k, v in e.items())]  # fmt: skip
    return "\n".join(lines)


HYBRID_DIR = Path(tempfile.gettempdir()) / "cairn-hybrid-hf"


def hybrid_folder(folder: Path) -> Path:
    """A random-weight Qwen3.5-style hybrid about SmolLM2's size (24 layers of width 576,
    Gated DeltaNet with full attention every 4th layer), as an mlx-lm folder."""
    if (folder / "config.json").exists():
        return folder
    from mlx_cairn.models.export import save_folder
    from mlx_cairn.testing.tiny_configs import tiny_config
    from mlx_cairn.testing.tiny_models import tiny_zoo_model

    text = {
        **tiny_config("qwen3_5")["text_config"],
        "hidden_size": 576, "num_hidden_layers": 24, "intermediate_size": 1536,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "full_attention_interval": 4,
        "max_position_embeddings": 32768,
    }  # fmt: skip
    save_folder(tiny_zoo_model("qwen3_5", text_config=text, num_hidden_layers=24), folder)
    return folder


def served_name(port: int) -> str:
    return str(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"])


async def amain(args: argparse.Namespace) -> int:
    from mlx_cairn.models import load

    if args.hybrid:
        folder = hybrid_folder(args.export_dir or HYBRID_DIR)
        lm = load(str(folder))
        model_args = ["--model", str(folder), "--preload"]
    else:
        lm = load()
        folder = args.export_dir or Path(tempfile.gettempdir()) / "cairn-smollm2-hf"
        if not (folder / "config.json").exists():
            from mlx_cairn.models.export import save_folder

            save_folder(lm, folder)
        model_args = []
    prompts = Prompts(lm.tokenizer, args.fixtures, args.prefix_tokens)
    del lm
    logs = Path(tempfile.mkdtemp(prefix="cairn-bench-agentic-"))
    ours_sides = [("cairn", [])] + [
        (name, extra.split()) for name, _, extra in (x.partition(":") for x in args.cairn_side)
    ]
    procs: list[subprocess.Popen[bytes]] = []
    sides: dict[str, tuple[int, str]] = {}
    warm = [{"role": "user", "content": "Say hello."}]
    loads = [os.getloadavg()[0]]
    try:
        for name, extra in ours_sides:
            port = free_port()
            procs.append(start_ours(port, logs / f"{name}.log", [*model_args, *extra]))
            await wait_up(port, procs[-1], CHAT, greedy_chat_body("default", warm, 4))
            sides[name] = (port, served_name(port))
        p_lm = free_port()
        procs.append(start_mlx_lm(p_lm, folder, args.answer_tokens, logs / "mlx_lm.log"))
        await wait_up(p_lm, procs[-1], CHAT, greedy_chat_body(str(folder), warm, 4))
        sides["mlx_lm.server"] = (p_lm, str(folder))
        raw: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        print(f"logs in {logs}; load average {os.getloadavg()}", flush=True)
        names = list(sides)
        for rnd in range(args.rounds):
            for side in names if rnd % 2 == 0 else names[::-1]:
                port, model = sides[side]
                r = await run_round(port, model, prompts, args, rnd, side != "mlx_lm.server")
                raw[side].append(r)
                loads.append(os.getloadavg()[0])
                t1 = [x["ttft_s"] for x in r["turns"] if x["turn"] == 0]
                tn = [x["ttft_s"] for x in r["turns"] if x["turn"] > 0]
                print(
                    f"round {rnd} {side:14s} total {r['total_s']:6.1f}s  TTFT p50 turn 1 "
                    f"{1000 * statistics.median(t1):6.0f} ms, turns 2+ "
                    f"{1000 * statistics.median(tn) if tn else float('nan'):6.0f} ms  "
                    f"{r.get('engine', '')} load={os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        sums = {s: summary(raw[s], args.turns) for s in sides}
        print(
            f"\n{args.sessions} sessions x {args.turns} turns, prefix {args.prefix_tokens}, "
            f"{args.turn_tokens} new tokens a turn, answers of {args.answer_tokens}; "
            f"{args.rounds} rounds; load average (1 min) min {min(loads):.1f}, "
            f"median {statistics.median(loads):.1f}, max {max(loads):.1f}\n"
        )
        print(markdown(sums, args.turns), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args), "summary": sums, "raw": raw,
                                             "load": loads}, default=str))  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=1800.0,
        help="seconds one turn may take (the peer's turn 1 at 8 sessions runs for minutes)",
    )
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="shared system + tools")
    ap.add_argument("--turn-tokens", type=int, default=300, help="new user tokens a turn")
    ap.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of each answer")
    ap.add_argument("--rounds", type=int, default=2, help="per side, alternating the order")
    ap.add_argument("--fixtures", type=Path, default=FIXTURES.resolve())
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--export-dir", type=Path, default=None, help="the folder both serve")
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="a random Qwen3.5-style hybrid of SmolLM2's size instead of SmolLM2",
    )
    ap.add_argument(
        "--cairn-side",
        action="append",
        default=[],
        metavar="NAME:ARGS",
        help="another cairn server with these serve flags, e.g. 'kv8:--kv-bits 8'",
    )
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
