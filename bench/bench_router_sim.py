"""N simulated replicas behind a real router on an agent workload: cache-aware vs round-robin (issue 37).

A team puts several servers behind a router. Whether the router sends each
turn of a session back to the replica that holds its history decides how much
of every prompt is computed again. This benchmark measures that with the
router people deploy and simulated replicas, so that 64 replicas fit on one
small machine:

- the router is the real one: ``sglang-router`` (PyPI; its ``cache_aware``
  policy keeps an approximate radix tree of the request text per worker, sends
  a request to the worker with the longest match when the match covers more
  than ``--cache-threshold`` of it, else to the worker with the smallest tree,
  and switches to the least-loaded worker while the load is out of balance:
  ``max - min > --balance-abs-threshold`` and ``max > min *
  --balance-rel-threshold``, loads being the router's own in-flight counts),
  started with its defaults against ``round_robin``;
- the replicas are N HTTP servers in one asyncio process (one port each) that
  answer what the router asks of a worker (``/health``, ``/server_info``,
  ``/model_info``) and the chat completion itself. Each has a prefix cache of
  ``--cache-tokens`` tokens built on the engine's own KV core
  (``mlx_cairn.kv.BlockPool`` + ``PrefixCache``, 16-token blocks, chained
  xxh3-128 block hashes, LRU reuse of freed blocks), and a scheduler after the
  engine's (admission while blocks last, up to 32 rows, a 512-token step budget
  shared by decode rows and chunked prefill). Nothing is computed: a step
  takes ``prefill tokens x --prefill-ms + (--decode-ms + rows x
  --decode-row-ms)`` simulated time, the figures measured for SmolLM2-135M on
  this machine (README: 2,000-token prefill at 178.7 tok/s = 5.6 ms a token;
  decode steps of 1 / 8 / 16 rows 62.3 / 101.4 / 149.7 ms = 56.5 + 5.83 per
  row). Decode steps with nothing to prefill are taken ``--macro-steps`` at a
  time (an arrival waits at most that many steps to be admitted);
- simulated time runs as real time scaled by ``--time-scale`` (0.05: a
  simulated second is 50 ms), so the router sees real concurrency and its
  in-flight counts mean what they mean in production;
- the workload: ``--sessions-per-replica`` x N agent sessions, starting at
  random over ``--arrival-s`` simulated seconds, each ``--turns`` turns; every
  turn re-sends the shared prefix (the redacted Claude Code system prompt and
  21 tool definitions, ``--prefix-tokens`` tokens, as ``bench_agentic.py``
  builds it), the session's history and a new user message (a tool result of
  ``--turn-tokens`` tokens of the fixtures' message text). The replica answers
  ``--answer-tokens`` tokens of fixture text, which the session sends back in
  its next turn; between turns the session waits an exponential tool time of
  mean ``--tool-s`` simulated seconds. Token ids: the embedded SmolLM2
  tokenizer, messages in ChatML, so an answer's blocks hit on the next turn as
  the engine's do.

Reported per replica count and policy: prompt-token cache hit rate (all turns;
turns 2+), prompt tokens computed, throughput (prompt + answer tokens of all
sessions per simulated second, first arrival to last answer, replicas in
parallel), turn latency p50 / p95 (simulated), requests per replica max / mean.

Run (4, 16 and 64 replicas, both policies; a few minutes on 2 shared cores)::

    .venv/bin/python bench/bench_router_sim.py
    .venv/bin/python bench/bench_router_sim.py --policies cache_aware \\
        --router-arg=--balance-abs-threshold=2 --router-arg=--balance-rel-threshold=1.2
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (the package's native core)

# isort: on
import aiohttp
from aiohttp import web

from bench_agentic import FIXTURES, Prompts  # bench/ is on sys.path
from mlx_cairn.kv import BlockPool, PrefixCache
from serve_proc import free_port

BLOCK_SIZE = 16  # the engine's default
MAX_BATCH = 32  # engine.DEFAULT_MAX_BATCH
STEP_BUDGET = 512  # the engine's step_token_budget
MODEL = "smollm2-sim"


def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer, read from the GGUF header (no weights loaded)."""
    from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_header
    from mlx_cairn.models.gguf_check import read_header
    from mlx_cairn.models.loader import default_model_path

    return tokenizer_from_header(read_header(default_model_path()).metadata)


class ChatML:
    """Prompt token ids of a chat: ChatML turns, each message's text encoded once."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.start = tok.encode("<|im_start|>")
        self.end = tok.encode("<|im_end|>\n")
        self.memo: dict[tuple[str, str], list[int]] = {}

    def message(self, role: str, content: str) -> list[int]:
        key = (role, content)
        ids = self.memo.get(key)
        if ids is None:
            ids = self.start + self.tok.encode(f"{role}\n") + self.tok.encode(content) + self.end
            self.memo[key] = ids
        return ids

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += self.message(str(m["role"]), str(m["content"]))
        return out + self.start + self.tok.encode("assistant\n")


# ----------------------------------------------------------------- one simulated replica


@dataclass
class Job:
    prompt: list[int]
    answer: list[int]  # the tokens the replica "generates" (then <|im_end|>\n)
    turn2: bool  # a later turn of a session (history re-sent)
    done: asyncio.Future[float]
    hashes: Any = None
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    prefilled: int = 0
    generated: int = 0


@dataclass
class Costs:
    prefill_s: float  # a prompt token computed
    decode_s: float  # a decode step, fixed part
    decode_row_s: float  # a decode step, per row
    scale: float  # real seconds per simulated second
    macro: int  # decode steps taken at once when nothing prefills


class Replica:
    """A prefix cache on the engine's KV core and a cost-model scheduler in simulated time."""

    def __init__(self, idx: int, cache_tokens: int, costs: Costs, end_ids: list[int]) -> None:
        self.idx = idx
        self.pool = BlockPool(num_blocks=cache_tokens // BLOCK_SIZE + 1, block_size=BLOCK_SIZE)
        self.cache = PrefixCache(self.pool, seed=0)
        self.costs = costs
        self.end_ids = end_ids
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.wake = asyncio.Event()
        self.t_free = 0.0  # simulated time the replica is next free
        self.t0 = 0.0  # loop time of simulated 0
        self.stats = {"requests": 0, "prompt": 0, "cached": 0, "prompt2": 0, "cached2": 0,
                      "answer": 0, "busy_s": 0.0}  # fmt: skip
        self.info_asked = 0

    def now(self) -> float:
        return (asyncio.get_running_loop().time() - self.t0) / self.costs.scale

    def submit(self, job: Job) -> None:
        need = -(-(len(job.prompt) + len(job.answer) + len(self.end_ids)) // BLOCK_SIZE)
        if need > self.pool.num_blocks - 1:
            raise ValueError(f"a prompt of {len(job.prompt)} tokens exceeds the replica's cache")
        self.waiting.append(job)
        self.wake.set()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < MAX_BATCH:
            job = self.waiting[0]
            if job.hashes is None:
                job.hashes = self.cache.hash_blocks(job.prompt)
            hit = self.cache.lookup(job.hashes)
            total = len(job.prompt) + len(job.answer) + len(self.end_ids)
            new = self.pool.allocate(-(-total // BLOCK_SIZE) - len(hit))
            if new is None:  # the pool is held by running rows: wait for one to finish
                self.pool.free(hit)
                return
            self.waiting.popleft()
            job.blocks = hit + new
            job.cached = job.prefilled = len(hit) * BLOCK_SIZE
            s = self.stats
            s["requests"] += 1
            s["prompt"] += len(job.prompt)
            s["cached"] += job.cached
            if job.turn2:
                s["prompt2"] += len(job.prompt)
                s["cached2"] += job.cached
            self.running.append(job)

    async def run(self) -> None:
        c = self.costs
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            start = max(self.t_free, self.now())
            rows = [j for j in self.running if j.prefilled == len(j.prompt)]
            budget = STEP_BUDGET - len(rows)
            chunks: list[tuple[Job, int]] = []
            for j in self.running:
                left = len(j.prompt) - j.prefilled
                if left and budget > 0:
                    chunks.append((j, min(left, budget)))
                    budget -= chunks[-1][1]
            steps = 1
            if not chunks:
                steps = max(1, min([c.macro] + [len(j.answer) - j.generated for j in rows]))
            prefill = sum(n for _, n in chunks)
            dur = prefill * c.prefill_s
            if rows:
                dur += steps * (c.decode_s + c.decode_row_s * len(rows))
            end = start + dur
            self.t_free = end
            self.stats["busy_s"] += dur
            await asyncio.sleep(max(0.0, self.t0 + end * c.scale - loop.time()))
            for j in rows:
                j.generated += steps
            for j, n in chunks:
                j.prefilled += n
                if j.prefilled == len(j.prompt):
                    self.cache.insert(j.hashes, j.blocks)  # the prompt's full blocks
                    j.generated = 1  # the last prefill chunk samples the first token
            for j in [j for j in self.running if j.generated >= len(j.answer)]:
                self.running.remove(j)
                seq = j.prompt + j.answer + self.end_ids
                self.cache.insert(self.cache.hash_blocks(seq), j.blocks)  # answers hit next turn
                self.pool.free(j.blocks)
                self.stats["answer"] += len(j.answer)
                if not j.done.done():
                    j.done.set_result(end)


# ----------------------------------------------------------------- the replicas' HTTP side


class Replicas:
    """N replicas served on N ports by one aiohttp application."""

    def __init__(self, n: int, args: argparse.Namespace, chat: ChatML, answer_ids: list[int]):
        costs = Costs(args.prefill_ms / 1e3, args.decode_ms / 1e3, args.decode_row_ms / 1e3,
                      args.time_scale, args.macro_steps)  # fmt: skip
        self.chat = chat
        self.corpus = answer_ids
        self.reps = [Replica(i, args.cache_tokens, costs, chat.end) for i in range(n)]
        self.by_port: dict[int, Replica] = {}
        self.ports = [free_port() for _ in range(n)]
        self.runner: web.AppRunner | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.answers: dict[tuple[str, int], tuple[str, list[int]]] = {}

    def answer(self, key: str, n: int) -> tuple[str, list[int]]:
        """``n`` tokens of fixture text chosen by ``key``; its ids re-encoded, as the next turn sends it."""
        if (key, n) not in self.answers:
            h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
            start = h % (len(self.corpus) - n)
            text = self.chat.tok.decode(self.corpus[start : start + n])
            self.answers[key, n] = (text, self.chat.tok.encode(text))
        return self.answers[key, n]

    async def handle(self, req: web.Request) -> web.StreamResponse:
        rep = self.by_port[req.transport.get_extra_info("sockname")[1]]  # type: ignore[union-attr]
        path = req.path
        if req.method == "POST" and path in ("/v1/chat/completions", "/v1/chat/completions/render"):
            body = await req.json()
            msgs = body["messages"]
            prompt = self.chat.prompt(msgs)
            if path.endswith("/render"):
                return web.json_response({"prompt_token_ids": prompt})
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            text, ids = self.answer(str(msgs[-1]["content"])[-2000:], n)
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            job = Job(prompt=prompt, answer=ids, turn2=len(msgs) > 2, done=fut)
            rep.submit(job)
            await fut
            return web.json_response({
                "id": f"chatcmpl-{rep.idx}", "object": "chat.completion", "model": MODEL,
                "created": int(time.time()),
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids),
                          "prompt_tokens_details": {"cached_tokens": job.cached}},
                "replica": rep.idx,
            })  # fmt: skip
        if path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            rep.info_asked += 1
            return web.json_response({
                "model_path": MODEL, "tokenizer_path": None, "is_generation": True,
                "served_model_name": MODEL, "page_size": BLOCK_SIZE, "dp_size": 1,
                "max_total_num_tokens": rep.pool.num_blocks * BLOCK_SIZE,
            })  # fmt: skip
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if path in ("/health", "/health_generate", "/ping", "/get_load", "/load"):
            return web.json_response({"status": "ok", "load": len(rep.running) + len(rep.waiting)})
        return web.json_response({"error": f"no route {path}"}, status=404)

    async def start(self) -> None:
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # the router's HTTP/2 probe
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        for port, rep in zip(self.ports, self.reps, strict=True):
            await web.TCPSite(self.runner, "127.0.0.1", port, backlog=1024).start()
            self.by_port[port] = rep
            self.tasks.append(asyncio.create_task(rep.run()))

    def set_clock(self, t0: float) -> None:
        for r in self.reps:
            r.t0 = t0

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.runner is not None:
            await self.runner.cleanup()


# ----------------------------------------------------------------- router and sessions


def start_router(kind: str, port: int, workers: list[int], policy: str, extra: list[str],
                 log: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    exe = Path(sys.executable).parent / f"{kind}-router"
    urls = [f"http://127.0.0.1:{p}" for p in workers]
    cmd = [str(exe)] + (["launch"] if kind == "sglang" else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *urls]
    cmd += ["--log-level", "warn" if kind == "sglang" else "warning", *extra]
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


async def wait_router(http: aiohttp.ClientSession, port: int, reps: Replicas,
                      proc: subprocess.Popen[bytes], log: Path) -> None:  # fmt: skip
    """Until the router lists every worker and answers a chat request."""
    deadline = time.monotonic() + 120
    n = len(reps.reps)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the router exited: {log.read_text()[-2000:]}")
        try:
            async with http.get(f"http://127.0.0.1:{port}/workers") as r:
                if r.status == 200:
                    data = await r.json(content_type=None)
                    listed = data.get("workers", data) if isinstance(data, dict) else data
                    if isinstance(listed, list) and len(listed) >= n:
                        break
        except (aiohttp.ClientError, json.JSONDecodeError, ValueError):
            pass
        await asyncio.sleep(0.5)
    else:
        raise SystemExit(f"the router did not list {n} workers in 120 s; see {log}")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"the router answered {r.status}: {await r.text()}")


async def session(http: aiohttp.ClientSession, url: str, prompts: Prompts, args: argparse.Namespace,
                  s: int, at: float, rng: random.Random, sim: Any) -> list[dict[str, Any]]:  # fmt: skip
    await asyncio.sleep(max(0.0, sim.real(at) - sim.loop_now()))
    msgs = [{"role": "system", "content": prompts.prefix}]
    out = []
    for t in range(args.turns):
        msgs.append({"role": "user", "content": prompts.message(s, t, args.turn_tokens)})
        body = {"model": MODEL, "stream": False, "temperature": 0.0,
                "max_tokens": args.answer_tokens, "messages": msgs}  # fmt: skip
        t_send = sim.now()
        for attempt in range(3):
            async with http.post(url, json=body) as r:
                if r.status == 200:
                    res = await r.json()
                    break
                err = await r.text()
            if attempt == 2:
                raise RuntimeError(f"session {s} turn {t}: {r.status} {err[:300]}")
        t_done = sim.now()
        msgs.append({"role": "assistant", "content": res["choices"][0]["message"]["content"]})
        u = res["usage"]
        out.append({"session": s, "turn": t, "sent": t_send, "done": t_done,
                    "prompt": u["prompt_tokens"], "answer": u["completion_tokens"],
                    "cached": u["prompt_tokens_details"]["cached_tokens"],
                    "replica": res.get("replica")})  # fmt: skip
        await asyncio.sleep(rng.expovariate(1.0 / args.tool_s) * args.time_scale)
    return out


class SimClock:
    def __init__(self, scale: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.scale = scale

    def loop_now(self) -> float:
        return self.loop.time()

    def real(self, sim_t: float) -> float:
        return self.t0 + sim_t * self.scale

    def now(self) -> float:
        return (self.loop.time() - self.t0) / self.scale


async def run_one(n: int, policy: str, args: argparse.Namespace, prompts: Prompts, chat: ChatML,
                  logs: Path) -> dict[str, Any]:  # fmt: skip
    reps = Replicas(n, args, chat, prompts.corpus_ids)
    await reps.start()
    rport = free_port()
    log = logs / f"router-{n}-{policy}.log"
    proc = start_router(args.router, rport, reps.ports, policy, args.router_arg, log)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            await wait_router(http, rport, reps, proc, log)
            for r in reps.reps:  # the warm-up request (no full block) is not part of the run
                r.stats = dict.fromkeys(r.stats, 0)
                r.t_free = 0.0
            rng = random.Random(args.seed)
            n_sessions = args.sessions_per_replica * n
            starts = sorted(rng.uniform(0, args.arrival_s) for _ in range(n_sessions))
            sim = SimClock(args.time_scale)
            reps.set_clock(sim.t0)
            url = f"http://127.0.0.1:{rport}/v1/chat/completions"
            wall = time.perf_counter()
            per = await asyncio.gather(*(
                session(http, url, prompts, args, s, starts[s], random.Random(args.seed * 1000 + s), sim)
                for s in range(n_sessions)
            ))  # fmt: skip
            wall = time.perf_counter() - wall
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        await reps.stop()
    turns = [x for p in per for x in p]
    return summarize(n, policy, turns, reps, wall, args)


def summarize(n: int, policy: str, turns: list[dict[str, Any]], reps: Replicas, wall: float,
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    st = [r.stats for r in reps.reps]
    prompt = sum(s["prompt"] for s in st)
    cached = sum(s["cached"] for s in st)
    prompt2 = sum(s["prompt2"] for s in st)
    cached2 = sum(s["cached2"] for s in st)
    answer = sum(s["answer"] for s in st)
    span = max(x["done"] for x in turns) - min(x["sent"] for x in turns)
    lat = sorted(x["done"] - x["sent"] for x in turns)
    reqs = [s["requests"] for s in st]
    return {
        "replicas": n, "policy": policy, "sessions": args.sessions_per_replica * n,
        "requests": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt, "hit_rate_turn2": cached2 / prompt2 if prompt2 else math.nan,
        "computed_tokens": prompt - cached, "answer_tokens": answer,
        "span_s": span, "tok_s": (prompt + answer) / span,
        "lat_p50_s": statistics.median(lat), "lat_p95_s": lat[int(0.95 * (len(lat) - 1))],
        "req_max_mean": max(reqs) / statistics.mean(reqs),
        "busy_mean": statistics.mean(s["busy_s"] for s in st) / span,
        "wall_s": wall,
        "client_cached_check": sum(x["cached"] for x in turns),
    }  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| replicas | policy | sessions x turns | prompt-token hit rate (turns 2+) | "
            "prompt tokens computed | throughput, tok/s (sim) | span, s (sim) | "
            "turn latency p50 / p95, s (sim) | requests per replica max / mean | busy |")  # fmt: skip
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['policy']} | {r['sessions']} x {r['requests'] // r['sessions']} "
            f"| {100 * r['hit_rate']:.1f}% ({100 * r['hit_rate_turn2']:.1f}%) "
            f"| {r['computed_tokens']:,} | {r['tok_s']:,.0f} | {r['span_s']:,.0f} "
            f"| {r['lat_p50_s']:.1f} / {r['lat_p95_s']:.1f} | {r['req_max_mean']:.2f} "
            f"| {100 * r['busy_mean']:.0f}% |"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    tok = smollm2_tokenizer()
    prompts = Prompts(tok, args.fixtures, args.prefix_tokens)
    chat = ChatML(tok)
    logs = Path(tempfile.mkdtemp(prefix="cairn-bench-router-"))
    print(f"router logs in {logs}", flush=True)
    rows = []
    for n in args.replicas:
        for policy in args.policies:
            r = await run_one(n, policy, args, prompts, chat, logs)
            rows.append(r)
            print(
                f"{n:3d} replicas {policy:12s} hit {100 * r['hit_rate']:5.1f}% "
                f"(turns 2+ {100 * r['hit_rate_turn2']:5.1f}%) {r['tok_s']:8,.0f} tok/s "
                f"span {r['span_s']:6.0f} s  max/mean {r['req_max_mean']:.2f}  "
                f"wall {r['wall_s']:.0f} s",
                flush=True,
            )
    print(
        f"\n{args.router}-router; {args.sessions_per_replica} sessions per replica x {args.turns} "
        f"turns, prefix {args.prefix_tokens}, {args.turn_tokens} new tokens a turn, answers of "
        f"{args.answer_tokens}, tool time {args.tool_s} s, arrivals over {args.arrival_s} s; "
        f"cache {args.cache_tokens} tokens a replica; prefill {args.prefill_ms} ms/token, "
        f"decode step {args.decode_ms} + {args.decode_row_ms} ms/row; time scale "
        f"{args.time_scale}\n"
    )
    print(markdown(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--replicas", type=ints, default=[4, 16, 64])
    ap.add_argument("--policies", type=lambda s: s.split(","),
                    default=["round_robin", "cache_aware"])  # fmt: skip
    ap.add_argument("--router", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="passed to the router (repeat), e.g. --router-arg=--cache-threshold=0.5")  # fmt: skip
    ap.add_argument("--sessions-per-replica", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="shared system + tools")
    ap.add_argument("--turn-tokens", type=int, default=300, help="new user tokens a turn")
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--tool-s", type=float, default=3.0, help="mean simulated s between turns")
    ap.add_argument("--arrival-s", type=float, default=30.0, help="sessions start over this")
    ap.add_argument("--cache-tokens", type=int, default=32768, help="prefix cache per replica")
    ap.add_argument("--prefill-ms", type=float, default=5.6, help="per prompt token computed")
    ap.add_argument("--decode-ms", type=float, default=56.5, help="per decode step")
    ap.add_argument("--decode-row-ms", type=float, default=5.83, help="per decode step and row")
    ap.add_argument("--macro-steps", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.05, help="real s per simulated s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES.resolve())
    ap.add_argument("--json", type=Path, default=None)
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
